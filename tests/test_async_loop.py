"""The asynchronous loop (`scheduler.policy=async`, megatron_sortedrl/async_loop.py) on the real engines and trainer.

One run over two epochs is killed (SIGKILL of its whole process group, as a node failure) three times at random
points and resumed each time; at the end every prompt of every epoch must have been trained exactly once with its
n responses, no sample twice, every step logged once, no trained sample older than the bound, none discarded, and
every update of the same mini-batch size. The controller's checkpoint state is checked on its own (pure), and the
refusals are one line each.

    python -m pytest tests/test_async_loop.py -q        # about 3 minutes on 2 cores
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
from helpers import kill_group, step_rows, wait_for_step

from megatron_sortedrl.config import load_config
from megatron_sortedrl.data import load_prompts
from megatron_sortedrl.sample import Sample
from scheduler.asynchronous import AsyncController

N_PROMPTS, N_SAMPLES, EPOCHS, MINI_BATCH, BOUND = 24, 4, 2, 8, 2


def _overrides(model_dir: Path, run_dir: Path) -> list[str]:
    return [f"model.path={model_dir}", f"logging.run_dir={run_dir}", "trainer.total_steps=1000",
            "scheduler.policy=async", f"scheduler.staleness_bound={BOUND}", f"algorithm.ppo_mini_batch_size={MINI_BATCH}",
            f"data.num_train_prompts={N_PROMPTS}", f"data.num_epochs={EPOCHS}", "data.num_eval_prompts=4",
            "trainer.warmup_sft_steps=5", "trainer.eval_interval=5", "checkpoint.save_interval=2",
            "rollout.max_response_length=48", "logging.tensorboard=false", f"rollout.n_samples_per_prompt={N_SAMPLES}"]


def _start(args: list[str], log: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "megatron_sortedrl", "train", "configs/tiny_cpu.yaml", *args],
                            stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)


def test_three_kills_then_resume_train_every_prompt_once_per_epoch_within_the_bound(tiny_model_dir, tmp_path):
    run_dir = tmp_path / "run"
    args = _overrides(tiny_model_dir, run_dir)
    train_ids = {p.prompt_id for p in load_prompts(load_config("configs/tiny_cpu.yaml", args).data, "train")}
    total_steps = N_PROMPTS * EPOCHS * N_SAMPLES // MINI_BATCH
    rng = random.Random(0)
    last = 0
    for k in range(3):  # each start runs past a checkpoint of its own (every 2 steps), then dies mid-step
        log = tmp_path / f"log{k}.txt"
        proc = _start(args, log)
        try:
            wait_for_step(proc, run_dir, last + 3, log)
            time.sleep(rng.uniform(0.0, 0.6))  # land somewhere in a step: collecting, training or pushing
        finally:
            kill_group(proc)
        last = step_rows(run_dir)[-1]["step"]
        assert last < total_steps, "the run ended before it could be killed: give it more steps"
        if k:
            assert "resuming from" in log.read_text()
    log = tmp_path / "log_end.txt"
    proc = _start(args, log)
    try:
        assert proc.wait(600) == 0, log.read_text()[-3000:]
    finally:
        kill_group(proc)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["data_exhausted"] and summary["resumed_from"]

    rows = step_rows(run_dir)
    steps = [r["step"] for r in rows]
    assert steps == list(range(1, total_steps + 1)), f"steps missing or repeated: {steps}"
    assert [r["policy/version"] for r in rows] == steps  # one in-flight push per optimizer step
    ids = [sid for r in rows for sid in r["reward/per_sample"]]
    assert len(ids) == len(set(ids)), "a sample was trained twice"
    per_group = Counter(sid.rsplit("/", 1)[0] for sid in ids)
    assert set(per_group) == {f"{p}/e{e}" for p in train_ids for e in range(EPOCHS)}
    assert set(per_group.values()) == {N_SAMPLES}
    assert max(r["train/staleness_steps_max"] for r in rows) <= BOUND
    assert max(r["async/oldest_age_steps"] for r in rows) <= BOUND
    assert all(r["async/discarded"] == 0 for r in rows)
    assert all(r["train/samples_trained"] == MINI_BATCH for r in rows)


def test_controller_checkpoint_keeps_finished_samples_and_generates_the_rest_again():
    """The controller's state round-trips: finished samples come back with their tokens, unfinished ones come back
    fresh to generate again, and training on from either copy trains the same samples within the bound."""
    ids = [f"p{i}" for i in range(6)]
    ctl = AsyncController(ids, n=2, mini_batch=4, bound=1, num_epochs=1, length_aware=False)
    groups = ctl.admit()
    assert groups and sum(len(g.samples) for g in groups) <= (BOUND + 1) * 4
    for g in groups[:2]:  # two groups finish, the rest are still generating
        for s in g.samples:
            s.append([1, 2, 3], [-0.1] * 3, 0)
            ctl.on_finished(s)
    batch = ctl.next_minibatch()
    assert batch is not None and len(batch) == 4
    ctl.stepped(batch)
    ctl.synced(1)
    state = json.loads(json.dumps(ctl.state_dict()))
    other = AsyncController(ids, n=2, mini_batch=4, bound=1, num_epochs=1, length_aware=False)
    again = other.load_state_dict(state)
    assert {s.sample_id for s in again} == {s.sample_id for g in ctl.groups for s in g.samples
                                            if s.sample_id not in g.finished}
    assert all(not s.response_tokens for s in again)
    assert (other.steps, other.engine_step, other.admitted) == (ctl.steps, ctl.engine_step, ctl.admitted)

    def finish(c: AsyncController, pending: list[Sample]) -> list[str]:
        trained: list[str] = []
        while not c.done:
            for g in c.admit():
                pending += g.samples
            for s in pending:
                s.append([7], [-0.5], c.engine_step)
                c.on_finished(s)
            pending.clear()
            b = c.next_minibatch()
            assert b is not None
            ages = c.stepped(b)
            assert max(ages) <= 1
            c.synced(c.steps + 1)
            trained += [s.sample_id for s in b]
        return trained

    rest = [s for g in ctl.groups for s in g.samples if s.sample_id not in g.finished]
    a, b = finish(ctl, rest), finish(other, again)
    assert sorted(a) == sorted(b) and len(a) == len(set(a)) == 12 - 4


@pytest.mark.parametrize("args,key", [
    (["scheduler.policy=async", "cluster.colocate=true"], "cluster.colocate"),
    (["scheduler.policy=async", "scheduler.staleness_bound=-1"], "scheduler.staleness_bound"),
    (["scheduler.policy=async", "scheduler.staleness_bound=1", "scheduler.weight_update_interval=3"],
     "scheduler.weight_update_interval"),
])
def test_bad_asynchronous_config_is_refused_in_one_line(tmp_path, args, key):
    proc = subprocess.run([sys.executable, "-m", "megatron_sortedrl", "train", "configs/tiny_cpu.yaml", *args,
                           f"logging.run_dir={tmp_path / 'r'}"], capture_output=True, text=True, timeout=120)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and key in lines[0], proc.stderr[-2000:]
    assert not (tmp_path / "r" / "checkpoints").exists()
