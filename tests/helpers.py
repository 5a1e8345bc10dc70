"""Helpers shared by the end-to-end tests that run `train` (directly or through the Slurm emulation)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def step_rows(run_dir: Path) -> list[dict]:
    """The per-step rows of `<run_dir>/metrics.jsonl` (a line still being written is skipped)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "reward/mean" in row:
            rows.append(row)
    return rows


def slurm_env(tmp_path: Path, job_id: int, ray_tmp: str, **extra: str) -> dict:
    """Environment of an sbatch script under tests/slurm_emulation: two nodes, this checkout, the test's Python.

    `ray_tmp` must be a short path (Ray's unix socket paths stay under ~107 characters; pytest's tmp_path
    is too deep)."""
    env = dict(os.environ)
    env.update({
        "PATH": f"{REPO / 'tests' / 'slurm_emulation'}:{Path(sys.executable).parent}:{env['PATH']}",
        "SLURM_JOB_ID": str(job_id),
        "SLURM_JOB_NODELIST": "nodeA,nodeB",
        "SLURM_SUBMIT_DIR": str(REPO),
        "MSRL_HOME": str(REPO),
        "MSRL_PYTHON": sys.executable,
        "MSRL_HEAD_IP": "127.0.0.1",
        "MSRL_RAY_TMP": ray_tmp,
        "MSRL_RAY_START_ARGS": "--num-cpus=1 --object-store-memory=200000000",
        "FAKE_SLURM_LOG": str(tmp_path / "slurm.log"),
        "MSRL_CONFIG": "configs/tiny_cpu.yaml",
    })
    env.update(extra)
    return env
