"""The sbatch recipe runs `train` end to end under the Slurm emulation, is requeued by its pre-timeout signal and
resumes: the issue's acceptance test for the Slurm launch.

The emulation (`tests/slurm_emulation/`: stand-ins for srun and scontrol, SLURM_* variables) starts two "nodes"
as local processes with their own Ray ports; the tiny CPU config replaces the recipe's. USR1 goes to the batch
script alone, as `--signal=B:USR1@600` sends it; the script forwards it to the driver, which checkpoints and
exits, and calls `scontrol requeue`. The requeued job (same job id, SLURM_RESTART_COUNT=1) must resume from that
checkpoint and finish with every step logged once.

    python -m pytest tests/test_slurm_train.py -q        # about 2-3 minutes on 2 cores
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from helpers import kill_group, slurm_env, step_rows, wait_for_step

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "slurm" / "qwen7b_16gpu.sh"
TOTAL_STEPS = 4

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the Slurm emulation needs bash and Linux")


def _env(tmp_path: Path, ray_tmp: str, job_id: int, **extra: str) -> dict:
    return slurm_env(tmp_path, job_id, ray_tmp, MSRL_JOIN_TIMEOUT="120", MSRL_SUBCOMMAND="train", **extra)


def _overrides(model_dir: Path, run_dir: Path) -> list[str]:
    return [f"model.path={model_dir}", f"logging.run_dir={run_dir}", f"trainer.total_steps={TOTAL_STEPS}",
            "trainer.warmup_sft_steps=5", "trainer.eval_interval=0", "rollout.max_response_length=48",
            "checkpoint.save_interval=1", "data.num_eval_prompts=4", "logging.tensorboard=false",
            "scheduler.rollout_batch_size=4", "scheduler.update_batch_size=8", "scheduler.group_size=8",
            "cluster.socket_ifname=lo"]


def _start(env: dict, args: list[str], log: Path) -> subprocess.Popen:
    # A session of its own: the test can find (and, if it fails, kill) everything the job started.
    return subprocess.Popen(["bash", str(SCRIPT), *args], env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def _job_processes(marker: str) -> list[int]:
    """Live processes whose environment holds `marker` (this job's Ray temp dir, which srun passes to every
    process the nodes start: Ray's daemons, its workers and what they spawn)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            environ = (proc / "environ").read_bytes()
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:  # gone, or not ours
            continue
        if marker.encode() in environ and state != "Z":
            found.append(int(proc.name))
    return found


def _has_env(pid: int, entry: str) -> bool:
    try:
        entries = (Path(f"/proc/{pid}") / "environ").read_bytes().split(b"\0")
    except OSError:  # gone meanwhile
        return True
    if b"=" not in entries[0]:
        # Ray's dashboard and runtime-env agents write their process title over the start of the environment
        # block (setproctitle): it can no longer be read, whether or not the variable was there.
        return True
    return entry.encode() in entries


def _wait_gone(marker: str, timeout: float = 30) -> list[int]:
    end = time.monotonic() + timeout
    while (left := _job_processes(marker)) and time.monotonic() < end:
        time.sleep(0.5)
    return left


@pytest.mark.slow  # about 160 s; the driver resume test covers SIGUSR1 in the default suite
def test_train_is_requeued_by_usr1_and_resumes(tiny_model_dir, tmp_path):
    # Ray's unix socket paths must stay under ~107 characters: pytest's tmp_path is too deep for them.
    ray_tmp = tempfile.mkdtemp(prefix="msrl", dir="/tmp")
    job_id = 3456 + os.getpid() % 500
    run_dir = tmp_path / "run"
    args = _overrides(tiny_model_dir, run_dir)
    log1, log2 = tmp_path / "job.out", tmp_path / "job-requeued.out"
    try:
        # 1. The first run: USR1 to the batch script once step 1 is logged.
        proc = _start(_env(tmp_path, ray_tmp, job_id), args, log1)
        try:
            wait_for_step(proc, run_dir, 1, log1, timeout=240)
            # The process check below can see this job's Ray processes (two nodes: at least two raylets).
            job = _job_processes(ray_tmp)
            assert len(job) >= 4
            # cluster.socket_ifname reaches every process the job started (driver, Ray daemons, trainer ranks,
            # engines); the batch script exported it, so only its own initial environment lacks it.
            lacking = [pid for pid in job if pid != proc.pid and not _has_env(pid, "GLOO_SOCKET_IFNAME=lo")]
            assert lacking == [], [Path(f"/proc/{pid}/cmdline").read_bytes()[:120] for pid in lacking]
            os.kill(proc.pid, signal.SIGUSR1)
            rc = proc.wait(180)
        finally:
            kill_group(proc)
        out1 = log1.read_text()
        assert rc == 0, out1[-4000:]
        assert f"requeueing job {job_id}" in out1
        assert f"requeue {job_id}" in (tmp_path / "slurm.log").read_text().splitlines()
        summary = json.loads((run_dir / "summary.json").read_text())
        stopped_at = summary["steps"]
        assert summary["interrupted"] == "SIGUSR1" and 1 <= stopped_at < TOTAL_STEPS, summary
        assert (run_dir / "checkpoints" / f"iter_{stopped_at:07d}" / "COMPLETE.json").is_file()
        assert _wait_gone(ray_tmp) == [], "Ray processes of the job are left after it exited"

        # 2. The requeued job: same job id, restart count 1; it resumes and runs to the end.
        (tmp_path / "slurm.log").unlink()
        proc = _start(_env(tmp_path, ray_tmp, job_id, SLURM_RESTART_COUNT="1"), args, log2)
        try:
            rc = proc.wait(300)
        finally:
            kill_group(proc)
        out2 = log2.read_text()
        assert rc == 0, out2[-4000:]
        assert f"resuming from {run_dir / 'checkpoints' / f'iter_{stopped_at:07d}'}: step {stopped_at}" in out2
        assert "requeue" not in (tmp_path / "slurm.log").read_text()  # a run that ends is not requeued
        summary = json.loads((run_dir / "summary.json").read_text())
        assert "interrupted" not in summary and summary["steps"] == TOTAL_STEPS, summary
        assert summary["resumed_from"]
        rows = step_rows(run_dir)
        assert [r["step"] for r in rows] == list(range(1, TOTAL_STEPS + 1))
        assert [r["policy/version"] for r in rows] == [r["step"] for r in rows]
        assert _wait_gone(ray_tmp) == [], "Ray processes of the requeued job are left after it exited"
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
