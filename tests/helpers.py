"""Helpers shared by the tests: end-to-end runs of `train` (directly or through the Slurm emulation) and trainer
inputs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from megatron_sortedrl.metrics import read_jsonl

REPO = Path(__file__).resolve().parent.parent


def step_rows(run_dir: Path) -> list[dict]:
    """The per-step rows of `<run_dir>/metrics.jsonl` (a line still being written is skipped)."""
    return [row for row in read_jsonl(Path(run_dir) / "metrics.jsonl")[0] if "reward/mean" in row]


def wait_for_step(proc: subprocess.Popen, run_dir: Path, step: int, log: Path, timeout: float = 300) -> None:
    """Waits until the run of `proc` has logged `step`; fails with the log's tail if it ends or times out."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        rows = step_rows(run_dir)
        if rows and rows[-1]["step"] >= step:
            return
        assert proc.poll() is None, f"the run ended (rc {proc.returncode}) before step {step}:\n{log.read_text()[-4000:]}"
        time.sleep(0.1)
    raise AssertionError(f"no step {step} within {timeout} s:\n{log.read_text()[-4000:]}")


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL to the process group `proc` leads (started with start_new_session=True), then reaps it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(60)


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
        "SLURM_CPUS_ON_NODE": str(os.cpu_count() or 1),  # each node's step asks for them (the fake srun enforces it)
        "FAKE_SLURM_LOG": str(tmp_path / "slurm.log"),
        "MSRL_CONFIG": "configs/tiny_cpu.yaml",
    })
    env.update(extra)
    return env


def tp2_trainer_after_sft(model_dir: Path, sft_steps: int = 3, pp: int = 1, num_pairs: int = 8):
    """A Megatron trainer group at TP=2 (x `pp` stages) on CPU (Ray must be up) after a few supervised steps on
    random pairs, so its weights differ from the files in `model_dir`. Returns (group, pairs)."""
    import torch

    from megatron_sortedrl.config import RunConfig
    from megatron_sortedrl.trainer.group import TrainerGroup

    cfg = RunConfig()
    cfg.model.path = str(model_dir)
    cfg.cluster.device = "cpu"
    cfg.parallel.tensor_model_parallel_size = 2
    cfg.parallel.pipeline_model_parallel_size = pp
    cfg.trainer.warmup_sft_lr = 3e-3
    group = TrainerGroup(cfg)
    g = torch.Generator().manual_seed(0)
    pairs = [(torch.randint(4, 100, (6,), generator=g).tolist(), torch.randint(4, 100, (12,), generator=g).tolist())
             for _ in range(num_pairs)]
    for _ in range(sft_steps):
        group.sft_step(pairs)
    return group, pairs



def random_rl_samples(n: int = 8, seed: int = 0) -> list:
    """`n` RL samples with random prompts and responses (groups of 2), rewards and behaviour log-probs slightly off
    the trainer's, as a rollout engine's would be; the same `seed` gives the same samples."""
    import torch

    from megatron_sortedrl.sample import Sample

    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        plen, rlen = int(torch.randint(3, 10, (1,), generator=g)), int(torch.randint(2, 16, (1,), generator=g))
        s = Sample(prompt_id=f"p{i // 2}", index=i % 2,
                   prompt_tokens=torch.randint(4, 100, (plen,), generator=g).tolist(),
                   response_tokens=torch.randint(4, 100, (rlen,), generator=g).tolist(),
                   version_spans=[(0, 0)], reward=float(i % 3 == 0))
        s.rollout_logprobs = (-4.85 + 0.1 * torch.rand(rlen, generator=g)).tolist()
        out.append(s)
    return out


def round_tail_ratios(generate) -> tuple[list[float], int]:
    """Long-tail check shared by the long-tail tasks: rounds of 16 prompts x 4 samples (the preset's sync round)
    over 50 seeds of `generate(num, seed, min_difficulty, max_difficulty)`; returns each round's longest over
    median solution length (+ EOS) and the longest solution seen."""
    import statistics

    ratios, longest = [], 0
    for seed in range(50):
        lengths = [len(p.solution) + 1 for p in generate(96, seed, 1, 48)]  # + EOS
        longest = max(longest, *lengths)
        for r in range(0, 96, 16):
            chunk = lengths[r:r + 16] * 4
            ratios.append(max(chunk) / statistics.median(chunk))
    return ratios, longest


def free_port() -> int:
    """A free TCP port on the loopback interface (for a gloo or NCCL rendezvous)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def rank0_port(rank: int, world: int, ports) -> int:
    """A free port picked by rank 0 just before use and handed to the other ranks through `ports` (a spawn
    context's Queue): the machine is shared, and a port picked earlier may be taken by then."""
    if rank == 0:
        port = free_port()
        for _ in range(world - 1):
            ports.put(port)
        return port
    return ports.get(timeout=300)


def random_train_items(n: int = 6, seed: int = 0) -> list[dict]:
    """Trainer input rows (prompt, response, advantages, rollout log-probs) of random lengths and tokens."""
    import torch

    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        plen, rlen = int(torch.randint(3, 10, (1,), generator=g)), int(torch.randint(2, 16, (1,), generator=g))
        out.append({"prompt": torch.randint(4, 100, (plen,), generator=g).tolist(),
                    "response": torch.randint(4, 100, (rlen,), generator=g).tolist(), "mask": None,
                    "extras": {"advantages": [1.0 - 0.4 * i] * rlen,
                               "rollout_logprobs": (-4.85 + 0.1 * torch.rand(rlen, generator=g)).tolist()}})
    return out


def one_rank_world():
    """A generator for a module fixture: one gloo rank with megatron's TP=PP=1 groups in this process, torn down
    after the module (`yield from one_rank_world()`)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_sortedrl.trainer import cpu_compat

    cpu_compat.activate()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    ps.initialize_model_parallel(1, 1)
    cpu_compat.seed_model_parallel(0)
    yield
    ps.destroy_model_parallel()
    dist.destroy_process_group()
    # megatron's torch_dist writer keeps a spawned multiprocessing Manager for its results queue for the life of
    # the process; end it with the fixture, or the suite's leftover-process check finds it.
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    queue, filesystem_async._results_queue = filesystem_async._results_queue, None
    if queue is not None and getattr(queue, "_manager", None) is not None:
        queue._manager.shutdown()
