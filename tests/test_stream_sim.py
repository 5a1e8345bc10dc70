"""Stream training in the simulator, colocated (scheduler/sim/stream_sim.py): the idle-GPU sweep against hand-computed
values, and on a small scenario: less time in the train phase, the same samples trained, and still above the
physical limit.

Hardware: CPU only. Run: .venv/bin/python -m pytest tests/test_stream_sim.py -q
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from megatron_sortedrl.errors import ConfigError
from scheduler.sim.limit import physical_limit
from scheduler.sim.sim_config import load_sim_config
from scheduler.sim.simulator import simulate
from scheduler.sim.stream_sim import streamed_tokens


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


def _small(**cluster):
    sim, run = load_sim_config("configs/sim_tiny_cpu.yaml", [
        "workload.num_prompts=16", "workload.num_epochs=2", "workload.sigma=1.4", "run.scheduler.rollout_batch_size=4",
        "run.scheduler.update_batch_size=8", "run.scheduler.group_size=8", "cluster.gpus=4",
        "cluster.gpus_per_node=2"])
    return replace(sim, cluster=replace(sim.cluster, **cluster)), run


@pytest.mark.parametrize("policy", ["sync", "twotier+histospec"])
def test_disaggregated_stream_trains_only_finished_samples_and_stays_above_the_limit(policy):
    sim, run = _small(trainer_gpus=2, stream_training=True)
    plain_sim, _ = _small(trainer_gpus=2)
    stream, plain = simulate(sim, run, policy), simulate(plain_sim, run, policy)
    assert sorted(stream.trained.items()) == sorted(plain.trained.items())
    assert stream.total_s < plain.total_s
    c = sim.cluster
    assert sum(row["streamed_tokens"] for row in stream.rounds) > 0
    for row in stream.rounds:
        # The trainer's 2 of 4 GPUs run at half the cluster's rate from the round's start, never ahead of the samples
        # finished (reward in) by then: at most the update's tokens, and at most rate x rollout time.
        assert 0 <= row["streamed_tokens"] <= row["tokens"]
        assert row["streamed_tokens"] <= c.train_tokens_per_s * 2 / 4 * row["rollout_s"] + 1e-6
    limit = physical_limit(sim, run)
    samples = sum(r["samples"] for r in stream.rounds)
    assert limit["any_placement_total_s"] <= limit["total_s"] + 1e-9
    assert stream.total_s / samples >= limit["any_placement_s_per_sample"]


def test_disaggregated_stream_never_trains_a_sample_before_it_finished():
    # One trainer of 2 GPUs out of 4, 100 tokens/s cluster (50/s for the trainer), from t0 = 0. 300 tokens ready at 4,
    # 300 at 10: [4, 10] trains 300 (all that is ready), [10, 12] trains 100 more; nothing before 4.
    assert streamed_tokens([(0.0, 2)], [(4.0, 300), (10.0, 300)], 12.0, 4, 100.0) == pytest.approx(400.0)
    assert streamed_tokens([(0.0, 2)], [(4.0, 300), (10.0, 300)], 4.0, 4, 100.0) == 0.0
    for t_end in (1.0, 5.0, 9.0, 11.0, 30.0):
        ready = sum(n for t, n in [(4.0, 300), (10.0, 300)] if t < t_end)
        assert streamed_tokens([(0.0, 2)], [(4.0, 300), (10.0, 300)], t_end, 4, 100.0) <= ready


def test_disaggregated_stream_with_free_training_equals_the_unstreamed_run():
    # With training free (no fixed cost, a trainer of unbounded rate) streaming has nothing to hide: same timeline.
    sim, run = _small(trainer_gpus=2, stream_training=True, train_fixed_s=0.0, train_tokens_per_s=1e15)
    plain_sim, _ = _small(trainer_gpus=2, train_fixed_s=0.0, train_tokens_per_s=1e15)
    stream, plain = simulate(sim, run, "twotier", record=False), simulate(plain_sim, run, "twotier", record=False)
    assert stream.total_s == pytest.approx(plain.total_s, rel=1e-9, abs=1e-6)
    assert [r["samples"] for r in stream.rounds] == [r["samples"] for r in plain.rounds]


def test_disaggregated_engines_get_the_other_gpus_and_bad_trainer_gpus_is_refused():
    sim, run = _small(trainer_gpus=2)
    result = simulate(sim, run, "sync", record=False)
    assert all(r["engines"] * r["tp"] == 2 for r in result.rounds)
    with pytest.raises(ConfigError, match="trainer_gpus"):
        _small(trainer_gpus=4)
