"""Slurm launch under a small emulation: stand-ins for srun/scontrol and SLURM_* variables start two
"nodes" as local processes with their own Ray ports; the bring-up joins them and runs the head command."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from helpers import slurm_env

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = sorted((REPO / "slurm").glob("*.sh"))


SLURM_RESOURCE_VARS = ("SLURM_CPUS_ON_NODE", "SLURM_GPUS_ON_NODE", "SLURM_GPUS_PER_NODE")


def _env(tmp_path, job_id: int, **extra) -> dict:
    env = slurm_env(tmp_path, job_id, tempfile.mkdtemp(prefix="msrl", dir="/tmp"), **extra)
    for var in SLURM_RESOURCE_VARS:  # only what the test sets, even when the suite itself runs under Slurm
        if var not in extra:
            env.pop(var, None)
    return env


def test_scripts_parse():
    for script in SCRIPTS:
        subprocess.run(["bash", "-n", str(script)], check=True)


def test_dry_run_prints_layout_without_starting(tmp_path):
    env = _env(tmp_path, 4242, MSRL_DRY_RUN="1", MSRL_MODEL_DIR=str(tmp_path), MSRL_RUN_DIR=str(tmp_path),
               MSRL_CONFIG="configs/tiny_cpu.yaml")
    out = subprocess.run(["bash", str(REPO / "slurm" / "qwen32b_128gpu.sh")], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "2 nodes (nodeA nodeB), head nodeA (127.0.0.1:" in out.stdout
    assert "CPU run" in out.stdout
    assert "each node: ray start --num-gpus=0" in out.stdout  # no SLURM_CPUS_ON_NODE: Ray counts the CPUs
    assert not (tmp_path / "slurm.log").exists()  # nothing was started on any node


def test_ray_start_resources_come_from_the_config(tmp_path):
    # The config declares the node (as the GPU recipes do); Slurm's GPU count agrees with it.
    env = _env(tmp_path, 4243, MSRL_DRY_RUN="1", SLURM_GPUS_ON_NODE="4", SLURM_CPUS_ON_NODE="16")
    out = subprocess.run(["bash", str(REPO / "slurm" / "qwen7b_16gpu.sh"), "cluster.gpus_per_node=4",
                          "cluster.cpus_per_node=12"], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "each node: ray start --num-cpus=12 --num-gpus=4" in out.stdout
    # Nothing in the config: Slurm's counts, with the type prefix of --gpus-per-node=a100:2 dropped.
    env = _env(tmp_path, 4244, MSRL_DRY_RUN="1", SLURM_GPUS_PER_NODE="a100:2", SLURM_CPUS_ON_NODE="16")
    out = subprocess.run(["bash", str(REPO / "slurm" / "qwen7b_16gpu.sh")], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "each node: ray start --num-cpus=16 --num-gpus=2" in out.stdout


def test_gpu_count_disagreeing_with_slurm_is_one_line(tmp_path):
    env = _env(tmp_path, 4245, MSRL_DRY_RUN="1", SLURM_GPUS_ON_NODE="4")
    out = subprocess.run(["bash", str(REPO / "slurm" / "qwen7b_16gpu.sh"), "cluster.gpus_per_node=8"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert out.stderr.strip() == ("ray_on_slurm: cluster.gpus_per_node=8 but Slurm gives 4 GPUs per node; set "
                                  "cluster.gpus_per_node=4 or ask sbatch for --gpus-per-node=8")


def test_two_node_bringup_runs_head_command(tmp_path):
    # Slurm gives each node 2 GPUs: `ray start` declares them (no CUDA needed) and the nodes report them.
    env = _env(tmp_path, 1234 + os.getpid() % 500, MSRL_SUBCOMMAND="ray-check", MSRL_JOIN_TIMEOUT="120",
               SLURM_GPUS_ON_NODE="2")
    out = subprocess.run(["bash", str(REPO / "slurm" / "qwen7b_16gpu.sh")], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("ray cluster at 127.0.0.1:") == 2  # the join check, then the head command
    assert "2 nodes joined" in out.stdout
    assert out.stdout.count("1 CPUs, 2 GPUs") >= 2  # MSRL_RAY_START_ARGS' --num-cpus=1 comes last and wins
    log = (tmp_path / "slurm.log").read_text()
    assert log.count("--num-gpus=2") == 2  # head and worker node
    assert "srun[nodeA]" in log and "srun[nodeB]" in log
    # the per-job port block: GCS port and a distinct dashboard-agent port per node
    base = 20000 + (int(env["SLURM_JOB_ID"]) % 1000) * 40
    assert f"--port={base}" in log
    assert f"--dashboard-agent-listen-port={base + 2}" in log and f"--dashboard-agent-listen-port={base + 3}" in log
    stopped = subprocess.run([sys.executable, "-m", "ray.scripts.scripts", "status", f"--address=127.0.0.1:{base}"],
                             capture_output=True, text=True, timeout=60)
    assert stopped.returncode != 0  # cleanup stopped the cluster


def test_missing_node_is_named(tmp_path):
    # nodeC is down: its srun fails at once, so only two of three nodes ever join.
    env = _env(tmp_path, 2345 + os.getpid() % 500, SLURM_JOB_NODELIST="nodeA,nodeB,nodeC",
               MSRL_SUBCOMMAND="ray-check", MSRL_JOIN_TIMEOUT="90", FAKE_SLURM_DEAD_NODES="nodeC")
    out = subprocess.run(["bash", str(REPO / "slurm" / "qwen7b_16gpu.sh")], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode != 0
    assert "only 2 of 3 nodes joined" in out.stderr and "nodeC" in out.stderr.split("not joined:")[1]


pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the Slurm emulation needs bash and Linux")
