"""Tail migration in the simulator (scheduler/sim/tail_migration.py): an engine that ran dry takes a running request of
the busiest engine. On a hand-built round and on a small scenario: the same samples with the same lengths are
trained, the moved request's timeline is abort-then-submit with its tokens kept, the worker bubble does not grow,
and the physical limit stays below.

Hardware: CPU only. Run: .venv/bin/python -m pytest tests/test_tail_migration.py -q
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from scheduler.cost_model import EngineCostModel
from scheduler.sim.limit import physical_limit
from scheduler.sim.report import bubble_ratios
from scheduler.sim.sim_config import ClusterCosts, SimConfig, WorkloadConfig, load_sim_config
from scheduler.sim.simulator import Simulator, build_policy, simulate
from tests.test_scheduler_policies import BASE_RUN
from tests.test_simulator import FixedLengths


def run_sync(lengths, migrate):
    # Step time grows with the batch (1 ms + 10 ms per sequence), prefill is free: two engines of 4 slots each.
    engine = EngineCostModel(hbm_gbs=1e12, gpu_mem_gib=1.0, mem_utilization=1.0, weight_gib=0.0, kv_bytes_per_token=1.0,
                             step_overhead_s=0.001, tp_comm_s=0.0, per_seq_s=0.01, prefill_tokens_per_s=1e15, max_num_seqs=4)
    sched = replace(BASE_RUN.scheduler, policy="sync", rollout_batch_size=1, update_batch_size=len(lengths))
    run = replace(BASE_RUN, scheduler=sched,
                  rollout=replace(BASE_RUN.rollout, n_samples_per_prompt=len(lengths), max_response_length=1000))
    sim = SimConfig(cluster=ClusterCosts(gpus=2, gpus_per_node=2, reward_latency_s=0.0, train_fixed_s=1.0,
                                         train_tokens_per_s=1e9, weight_sync_s=0.5, tail_migration=migrate),
                    engine=engine, workload=WorkloadConfig(num_prompts=1, num_epochs=1))
    policy, workload = build_policy(sim, run, "sync", FixedLengths(lengths))
    simulator = Simulator(sim, run, policy, workload)
    return simulator.run_all(), simulator


def test_a_dry_engine_takes_the_busiest_engines_longest_request_and_finishes_sooner():
    lengths = [100, 5, 100, 5, 5, 5]  # dealt round-robin: engine 0 gets both long ones, engine 1 runs dry
    plain, _ = run_sync(lengths, migrate=False)
    moved, sim = run_sync(lengths, migrate=True)
    assert plain.rounds[0]["migrations"] == 0 and moved.rounds[0]["migrations"] >= 1
    # Same samples, same lengths: a moved request keeps its tokens and ends where it would have.
    assert moved.rounds[0]["response_lengths"] == plain.rounds[0]["response_lengths"]
    # Every abort of a moved request is followed by a submit of the same sample on another worker, with its tokens.
    evs = [e for e in moved.events if e.kind == "request"]
    for i, e in enumerate(evs):
        if e.event == "abort":
            nxt = next(x for x in evs[i + 1:] if x.sample_id == e.sample_id)
            assert nxt.event == "submit" and nxt.worker != e.worker and nxt.tokens == e.tokens > 0
            assert nxt.t >= e.t
    # Two 100-token sequences on one engine (2 x 10 ms per step) against one each (1 x 10 ms): the round is shorter
    # and the other engine is not left idle.
    assert moved.rounds[0]["rollout_s"] < plain.rounds[0]["rollout_s"]
    assert bubble_ratios(moved.events, 4)["worker_bubble"] <= bubble_ratios(plain.events, 4)["worker_bubble"]


def test_a_lone_sequence_is_never_moved():
    moved, _ = run_sync([100, 5, 5, 5], migrate=True)  # engine 0: 100, 5; engine 1: 5, 5
    assert moved.rounds[0]["migrations"] == 0


@pytest.mark.parametrize("policy", ["sync", "twotier+histospec"])
def test_migration_trains_the_same_samples_and_stays_above_the_limit(policy):
    sim, run = load_sim_config("configs/sim_tiny_cpu.yaml", [
        "workload.num_prompts=16", "workload.num_epochs=2", "workload.sigma=1.4", "run.scheduler.rollout_batch_size=4",
        "run.scheduler.update_batch_size=8", "run.scheduler.group_size=8"])
    on = replace(sim, cluster=replace(sim.cluster, tail_migration=True))
    plain, moved = simulate(sim, run, policy), simulate(on, run, policy)
    assert sum(r["migrations"] for r in moved.rounds) > 0
    assert sorted(moved.trained.items()) == sorted(plain.trained.items())
    samples = sum(r["samples"] for r in moved.rounds)
    assert moved.total_s / samples >= physical_limit(sim, run)["s_per_sample"]
    assert bubble_ratios(moved.events, sim.engine.max_num_seqs)["worker_bubble"] <= \
        bubble_ratios(plain.events, sim.engine.max_num_seqs)["worker_bubble"] + 1e-9
