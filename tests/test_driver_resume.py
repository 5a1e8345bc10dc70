"""Checkpoint and resume of the RL run, through the `train` command as a user (or Slurm) runs it.

One run over a single epoch of prompts is stopped twice: first by SIGUSR1 (Slurm's pre-timeout signal: the
run must checkpoint and exit 0), then by SIGKILL of its whole process group mid-step (a node failure: only
the periodic checkpoints survive). Resumed to the end, the run must have trained every prompt of the epoch
exactly once with all its responses (which is what an uninterrupted run over one epoch trains, whatever the
completion order), every step must appear once in the metrics, and policy versions must continue.

    python -m pytest tests/test_driver_resume.py -q        # about 3 minutes on 2 cores (x2 with -m slow: colocated)
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
from helpers import kill_group, step_rows, wait_for_step

from megatron_sortedrl.config import load_config
from megatron_sortedrl.data import load_prompts

N_PROMPTS, N_SAMPLES = 16, 4


def _overrides(model_dir: Path, run_dir: Path) -> list[str]:
    return [f"model.path={model_dir}", f"logging.run_dir={run_dir}", "trainer.total_steps=1000",
            f"data.num_train_prompts={N_PROMPTS}", "data.num_epochs=1", "data.num_eval_prompts=4",
            "trainer.warmup_sft_steps=5", "trainer.eval_interval=0", "checkpoint.save_interval=1",
            "rollout.max_response_length=48", "logging.tensorboard=false", "scheduler.rollout_batch_size=2",
            "scheduler.update_batch_size=8", "scheduler.group_size=4", f"rollout.n_samples_per_prompt={N_SAMPLES}"]


def _start(args: list[str], log: Path) -> subprocess.Popen:
    # A session of its own, so that SIGKILL can take the driver with its Ray processes, as a node failure does.
    return subprocess.Popen([sys.executable, "-m", "megatron_sortedrl", "train", "configs/tiny_cpu.yaml", *args],
                            stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)


MINI_BATCH = 12  # three prompt groups: harvests of two leave remainders that wait (and cross the stops)


# minibatches: about 3 minutes, run with -m slow (the remainder's checkpoint state is also checked in tests/test_minibatch.py)
@pytest.mark.parametrize("layout", ["disaggregated", pytest.param("minibatches", marks=pytest.mark.slow),
                                    pytest.param("colocated", marks=pytest.mark.slow)])
def test_sigusr1_then_sigkill_then_resume_trains_every_prompt_once(tiny_model_dir, tmp_path, layout):
    run_dir = tmp_path / "run"
    # colocated: the same invariants with engines that sleep and a trainer whose state leaves for every round;
    # minibatches: optimizer steps of 12 samples, so the remainder waiting for the next harvest is checkpointed
    extra = {"colocated": ["cluster.colocate=true"], "minibatches": [f"algorithm.ppo_mini_batch_size={MINI_BATCH}"]}
    args = _overrides(tiny_model_dir, run_dir) + extra.get(layout, [])
    train_ids = {p.prompt_id for p in load_prompts(load_config("configs/tiny_cpu.yaml", args).data, "train")}
    assert len(train_ids) == N_PROMPTS

    # 1. SIGUSR1: finish the step, checkpoint, exit 0.
    proc = _start(args, tmp_path / "log1.txt")
    try:
        wait_for_step(proc, run_dir, 1, tmp_path / "log1.txt")
        os.kill(proc.pid, signal.SIGUSR1)
        assert proc.wait(180) == 0, (tmp_path / "log1.txt").read_text()[-3000:]
    finally:
        kill_group(proc)
    summary = json.loads((run_dir / "summary.json").read_text())
    stopped_at = summary["steps"]
    assert summary["interrupted"] == "SIGUSR1" and stopped_at >= 1
    assert (run_dir / "checkpoints" / f"iter_{stopped_at:07d}" / "COMPLETE.json").is_file()

    # 2. Resume, then SIGKILL the whole process group at least one step later.
    proc = _start(args, tmp_path / "log2.txt")
    try:
        wait_for_step(proc, run_dir, stopped_at + 1, tmp_path / "log2.txt")
        time.sleep(0.5)  # land somewhere inside the next step
    finally:
        kill_group(proc)
    log2 = (tmp_path / "log2.txt").read_text()
    assert f"resuming from {run_dir / 'checkpoints'}" in log2 and f"step {stopped_at}," in log2
    killed_after = step_rows(run_dir)[-1]["step"]

    # 3. Resume to the end of the epoch.
    proc = _start(args, tmp_path / "log3.txt")
    try:
        assert proc.wait(600) == 0, (tmp_path / "log3.txt").read_text()[-3000:]
    finally:
        kill_group(proc)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["data_exhausted"] and summary["resumed_from"]

    rows = step_rows(run_dir)
    steps = [r["step"] for r in rows]
    assert steps == list(range(1, len(steps) + 1)), f"steps missing or repeated: {steps}"
    if layout == "minibatches":  # a version per step that made optimizer steps; every sample trained once
        made = [r["train/optimizer_steps"] for r in rows]
        assert [r["policy/version"] for r in rows] == [sum(1 for m in made[:i + 1] if m) for i in range(len(rows))]
        assert sum(made) == -(-N_PROMPTS * N_SAMPLES // MINI_BATCH) and 0.0 in made
        assert sum(r["train/samples_trained"] for r in rows) == N_PROMPTS * N_SAMPLES
        assert rows[-1]["train/samples_waiting"] == 0
    else:
        assert [r["policy/version"] for r in rows] == steps
    assert len(steps) > killed_after >= stopped_at + 1
    sample_ids = [sid for r in rows for sid in r["reward/per_sample"]]
    assert len(sample_ids) == len(set(sample_ids)), "a sample was trained twice"
    per_prompt = Counter(sid.split("/e")[0] for sid in sample_ids)
    assert set(per_prompt) == train_ids, f"lost prompts: {sorted(train_ids - set(per_prompt))}"
    assert set(per_prompt.values()) == {N_SAMPLES}
    assert summary["steps"] == len(steps) and (run_dir / "report" / "report.html").is_file()
    if layout == "colocated":  # every step's transitions are on the timeline, each ending with its bytes
        from megatron_sortedrl.telemetry.timeline import read_timeline

        ends = [e for e in read_timeline(run_dir / "timeline.jsonl") if e.kind == "phase" and e.event == "end"]
        for phase in ("sleep", "offload", "reload", "wake", "handoff"):
            got = {e.step for e in ends if e.phase == phase and e.bytes}
            assert set(steps) <= got, f"{phase}: no phase with bytes in steps {sorted(set(steps) - got)}"


def test_resume_required_without_checkpoint_is_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "megatron_sortedrl", "train", "configs/tiny_cpu.yaml", "resume=true",
                           f"logging.run_dir={tmp_path / 'empty'}"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "no complete checkpoint" in lines[0] and "checkpoint.resume=auto" in lines[0]


@pytest.mark.parametrize("value", ["maybe"])
def test_resume_flag_rejects_other_values(tmp_path, value):
    proc = subprocess.run([sys.executable, "-m", "megatron_sortedrl", "train", "configs/tiny_cpu.yaml", f"resume={value}",
                           f"logging.run_dir={tmp_path / 'x'}"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "true or false" in proc.stderr and "Traceback" not in proc.stderr
