"""Failures under repetition, through the `train` command as a user (or Slurm) runs it. Slow: minutes each.

    python -m pytest tests/test_failure_repetition.py -q -m slow        # 3 policies, ~6-10 min each on 2 cores

1. The driver's whole process group (driver, trainer ranks, engines, Ray) is SIGKILLed four times in a row, at
   moments drawn at random inside four phases: start-up (trainer and engines starting), the supervised
   warm-up, mid-rollout of a step after a checkpoint, and mid-checkpoint (the save held open by the fault
   hook `MSRL_FAULTS=checkpoint.after_shards=sleepN`). Then the run goes to its end. Over two epochs of
   prompts the run must have logged every step once, with policy version == step, trained no sample twice
   and every prompt of every epoch with exactly n samples, for `twotier`, `sorted` and `tail`. The seed of
   the moments is printed (and `MSRL_KILL_SEED` replays one).
2. A checkpoint write that fails part way (`enospc` after the shards) ends `train` with exit 2, the one
   line naming the disk error, no traceback, and the previous checkpoint the newest complete one.
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
from helpers import kill_group, step_rows

from megatron_sortedrl.config import load_config
from megatron_sortedrl.data import load_prompts
from megatron_sortedrl.trainer.checkpoint import find_latest_checkpoint

pytestmark = pytest.mark.slow
N_PROMPTS, N_SAMPLES, N_EPOCHS = 8, 4, 2


def _overrides(model_dir: Path, run_dir: Path, policy: str) -> list[str]:
    return [f"model.path={model_dir}", f"logging.run_dir={run_dir}", "trainer.total_steps=1000",
            f"data.num_train_prompts={N_PROMPTS}", f"data.num_epochs={N_EPOCHS}", "data.num_eval_prompts=4",
            "trainer.warmup_sft_steps=5", "trainer.eval_interval=0", "checkpoint.save_interval=1",
            "checkpoint.keep_last=2", "rollout.max_response_length=48", "logging.tensorboard=false",
            f"scheduler.policy={policy}", "scheduler.rollout_batch_size=2", "scheduler.update_batch_size=8",
            "scheduler.group_size=4", f"rollout.n_samples_per_prompt={N_SAMPLES}"]


def _start(args: list[str], log: Path, faults: str = "") -> subprocess.Popen:
    # A session of its own, so that SIGKILL takes the driver with its Ray processes, as a node failure does.
    env = {k: v for k, v in os.environ.items() if k != "MSRL_FAULTS"}
    env.setdefault("RAY_raylet_start_wait_time_s", "600")  # a busy 2-core machine starts Ray slowly
    env["PYTHONUNBUFFERED"] = "1"  # the kill moments are read from the log as it is written
    if faults:
        env["MSRL_FAULTS"] = faults
    return subprocess.Popen([sys.executable, "-m", "megatron_sortedrl", "train", "configs/tiny_cpu.yaml", *args],
                            stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True, env=env)


def _wait_for(proc: subprocess.Popen, cond, what: str, log: Path, timeout: float = 1200) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return
        assert proc.poll() is None, f"the run ended (rc {proc.returncode}) before {what}:\n{log.read_text()[-4000:]}"
        time.sleep(0.05)
    raise AssertionError(f"no {what} within {timeout} s:\n{log.read_text()[-4000:]}")


def _in_log(log: Path, text: str):
    return lambda: text in log.read_text(errors="replace")


@pytest.mark.parametrize("policy", ["twotier", "sorted", "tail"])
def test_sigkill_four_times_then_run_to_end(policy, tiny_model_dir, tmp_path):
    seed = int(os.environ.get("MSRL_KILL_SEED", random.randrange(1 << 30)))
    rng = random.Random(seed)
    print(f"kill moments seed {seed} (MSRL_KILL_SEED={seed} replays them)")
    run_dir = tmp_path / "run"
    ckpts = run_dir / "checkpoints"
    args = _overrides(tiny_model_dir, run_dir, policy)
    train_ids = {p.prompt_id for p in load_prompts(load_config("configs/tiny_cpu.yaml", args).data, "train")}
    assert len(train_ids) == N_PROMPTS
    moments = []

    def kill(proc: subprocess.Popen, phase: str, delay: float) -> None:
        time.sleep(delay)
        moments.append((phase, round(delay, 2), proc.poll() is None))
        kill_group(proc)

    # 1. Start-up: the trainer group or the engines are starting.
    log = tmp_path / "log1.txt"
    proc = _start(args, log)
    try:
        _wait_for(proc, _in_log(log, "starting trainer group"), "trainer start-up", log)
        kill(proc, "start-up", rng.uniform(0.0, 3.0))
    finally:
        kill_group(proc)
    assert find_latest_checkpoint(ckpts) is None

    # 2. Warm-up: the supervised steps before RL (nothing checkpointed yet, so the next run starts over).
    log = tmp_path / "log2.txt"
    proc = _start(args, log)
    try:
        _wait_for(proc, _in_log(log, "warm-up 1/"), "warm-up", log)
        kill(proc, "warm-up", rng.uniform(0.0, 1.0))
    finally:
        kill_group(proc)
    assert find_latest_checkpoint(ckpts) is None

    # 3. Mid-rollout: after step k's checkpoint is complete, inside step k+1 (rollout is most of a step).
    log = tmp_path / "log3.txt"
    proc = _start(args, log)
    k = rng.randint(1, 2)
    try:
        _wait_for(proc, lambda: (ckpts / f"iter_{k:07d}" / "COMPLETE.json").is_file(), f"checkpoint {k}", log)
        kill(proc, "mid-rollout", rng.uniform(0.0, 1.0))
    finally:
        kill_group(proc)
    resumed_at = int(find_latest_checkpoint(ckpts).name.split("_")[1])
    assert resumed_at >= k

    # 4. Mid-checkpoint: the save of the step after the next one is held open after its shards.
    held = resumed_at + 2
    log = tmp_path / "log4.txt"
    proc = _start(args, log, faults=f"checkpoint.after_shards=sleep6@iter_{held:07d}")
    try:
        _wait_for(proc, lambda: (ckpts / f".iter_{held:07d}.partial").is_dir(), f"checkpoint {held} in progress", log)
        kill(proc, "mid-checkpoint", rng.uniform(0.5, 4.0))
    finally:
        kill_group(proc)
    # The run resumed from the newest complete checkpoint: the one seen after the kill or, when the killed run's
    # trainer finished its save after the driver died (Ray workers do not share the driver's process group),
    # the next one. Either way a complete checkpoint, never a partial one.
    resumed = re.search(r"resuming from \S+/iter_(\d+): step (\d+)", log.read_text())
    assert resumed and int(resumed.group(1)) in (resumed_at, resumed_at + 1) and resumed.group(1) == f"{int(resumed.group(2)):07d}"
    assert find_latest_checkpoint(ckpts) == ckpts / f"iter_{held - 1:07d}", "a half-written checkpoint counts"
    print(f"kill moments ({policy}): {moments}")
    assert all(alive for _, _, alive in moments), f"the run was not running at every kill: {moments}"

    # 5. Run to the end of the data.
    log = tmp_path / "log5.txt"
    proc = _start(args, log)
    try:
        assert proc.wait(2400) == 0, log.read_text()[-4000:]
    finally:
        kill_group(proc)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["data_exhausted"] and summary["resumed_from"].endswith(f"iter_{held - 1:07d}")

    rows = step_rows(run_dir)
    steps = [r["step"] for r in rows]
    assert steps == list(range(1, len(steps) + 1)), f"steps missing or repeated: {steps}"
    assert [r["policy/version"] for r in rows] == steps
    sample_ids = [sid for r in rows for sid in r["reward/per_sample"]]
    assert len(sample_ids) == len(set(sample_ids)), "a sample was trained twice"
    per_prompt_epoch = Counter(sid.rsplit("/", 1)[0] for sid in sample_ids)  # "<prompt>/e<epoch>"
    expected = {f"{pid}/e{e}" for pid in train_ids for e in range(N_EPOCHS)}
    assert set(per_prompt_epoch) == expected, f"lost: {sorted(expected - set(per_prompt_epoch))}"
    assert set(per_prompt_epoch.values()) == {N_SAMPLES}
    assert summary["steps"] == len(steps) and summary["policy_version"] == len(steps)


def test_disk_full_checkpoint_through_train_is_one_line(tiny_model_dir, tmp_path):
    run_dir = tmp_path / "run"
    args = _overrides(tiny_model_dir, run_dir, "twotier")
    err = tmp_path / "stderr.txt"
    env = {"RAY_raylet_start_wait_time_s": "600", **os.environ,
           "MSRL_FAULTS": "checkpoint.after_shards=enospc@iter_0000002"}
    proc = subprocess.Popen([sys.executable, "-m", "megatron_sortedrl", "train", "configs/tiny_cpu.yaml", *args],
                            stdout=open(tmp_path / "stdout.txt", "w"), stderr=open(err, "w"),
                            start_new_session=True, env=env)
    try:
        assert proc.wait(2400) == 2, (tmp_path / "stdout.txt").read_text()[-3000:] + err.read_text()[-3000:]
    finally:
        kill_group(proc)
    text = err.read_text()
    lines = [ln for ln in text.splitlines() if ln.startswith("error:")]
    assert "Traceback" not in text, text[-3000:]
    assert len(lines) == 1 and text.rstrip().endswith(lines[0]), text[-3000:]
    assert "iter_0000002 could not be written" in lines[0] and "No space left on device" in lines[0]
    assert "newest complete checkpoint is still iter_0000001" in lines[0]
    assert find_latest_checkpoint(run_dir / "checkpoints") == run_dir / "checkpoints" / "iter_0000001"
    assert not (run_dir / "checkpoints" / ".iter_0000002.partial").exists()
