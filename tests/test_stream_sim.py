"""Stream training in the simulator, colocated (scheduler/stream_sim.py): the idle-GPU sweep against hand-computed
values, and on a small scenario: less time in the train phase, the same samples trained, and still above the
physical limit.

Hardware: CPU only. Run: .venv/bin/python -m pytest tests/test_stream_sim.py -q
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from scheduler.limit import physical_limit
from scheduler.sim_config import load_sim_config
from scheduler.simulator import simulate
from scheduler.stream_sim import streamed_tokens


def test_sweep_trains_only_on_idle_gpus_and_only_what_has_finished():
    # 4 GPUs, 100 tokens/s whole cluster (25 per GPU). Engine A (2 GPUs) idle from t=2, engine B (2) from t=6.
    # 1000 tokens ready at t=0: A trains 50/s over [2, 6] = 200, both 100/s over [6, 8] = 200.
    assert streamed_tokens([(2.0, 2), (6.0, 2)], [(0.0, 1000)], 8.0, 4, 100.0) == pytest.approx(400.0)
    # Only 150 tokens ever finish: never more than that.
    assert streamed_tokens([(2.0, 2), (6.0, 2)], [(0.0, 150)], 8.0, 4, 100.0) == pytest.approx(150.0)
    # Tokens that finish at t=5 wait for it: [5, 6] at 50/s, [6, 8] at 100/s = 250.
    assert streamed_tokens([(2.0, 2), (6.0, 2)], [(5.0, 1000)], 8.0, 4, 100.0) == pytest.approx(250.0)
    # No idle engine, or nothing before the harvest: nothing trained.
    assert streamed_tokens([], [(0.0, 1000)], 8.0, 4, 100.0) == 0.0
    assert streamed_tokens([(9.0, 4)], [(0.0, 1000)], 8.0, 4, 100.0) == 0.0


def test_stream_training_shortens_the_step_and_stays_above_the_limit():
    sim, run = load_sim_config("configs/sim_tiny_cpu.yaml", [
        "workload.num_prompts=16", "workload.num_epochs=2", "workload.sigma=1.4", "run.scheduler.rollout_batch_size=4",
        "run.scheduler.update_batch_size=8", "run.scheduler.group_size=8"])
    streamed = replace(sim, cluster=replace(sim.cluster, stream_training=True))
    limit = physical_limit(sim, run)
    for policy in ("sync", "twotier+histospec"):
        plain, stream = simulate(sim, run, policy, record=False), simulate(streamed, run, policy, record=False)
        assert sum(r["streamed_tokens"] for r in stream.rounds) > 0
        assert sorted(stream.trained.items()) == sorted(plain.trained.items())
        assert stream.total_s < plain.total_s
        samples = sum(r["samples"] for r in stream.rounds)
        assert stream.total_s / samples >= limit["s_per_sample"]
