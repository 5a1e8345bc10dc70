"""Simulator: timing against hand-computed values, bubble ratios of its timeline, preemption, CLI.

Hardware: CPU only. Run: .venv/bin/python -m pytest tests/test_simulator.py -q
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from megatron_sortedrl.errors import ConfigError
from scheduler.cost_model import EngineCostModel
from scheduler.sim.report import bubble_ratios
from scheduler.sim.sim_config import ClusterCosts, SimConfig, WorkloadConfig, load_sim_config
from scheduler.sim.simulator import Simulator, build_policy
from tests.test_scheduler_policies import BASE_RUN


class FixedLengths:
    """One prompt, response i has lengths[i] tokens."""

    def __init__(self, lengths):
        self.lengths, self.prompt_ids = lengths, ["p0"]

    def length(self, prompt_id, epoch, index, attempt=0):
        return self.lengths[index]

    def prompt_tokens(self, prompt_id):
        return 1


def flat_engine(max_num_seqs=1, gpu_mem_gib=1.0):
    # Every decode step costs exactly 10 ms whatever the batch; prefill is free.
    return EngineCostModel(hbm_gbs=1e12, gpu_mem_gib=gpu_mem_gib, mem_utilization=1.0, weight_gib=0.0,
                           kv_bytes_per_token=1.0, step_overhead_s=0.01, tp_comm_s=0.0, per_seq_s=0.0,
                           prefill_tokens_per_s=1e15, max_num_seqs=max_num_seqs)


def run_sync(lengths, max_num_seqs=1, gpu_mem_gib=1.0):
    sched = replace(BASE_RUN.scheduler, policy="sync", rollout_batch_size=1, update_batch_size=len(lengths))
    run = replace(BASE_RUN, scheduler=sched,
                  rollout=replace(BASE_RUN.rollout, n_samples_per_prompt=len(lengths), max_response_length=1000))
    sim = SimConfig(cluster=ClusterCosts(gpus=2, gpus_per_node=2, reward_latency_s=0.0, train_fixed_s=1.0,
                                         train_tokens_per_s=1e9, weight_sync_s=0.5),
                    engine=flat_engine(max_num_seqs, gpu_mem_gib), workload=WorkloadConfig(num_prompts=1, num_epochs=1))
    policy, workload = build_policy(sim, run, "sync", FixedLengths(lengths))
    return Simulator(sim, run, policy, workload).run_all()


def test_sync_round_times_and_bubble_match_hand_computation():
    # Two workers, one 10-token and one 30-token response: finishes at 0.1 s and 0.3 s.
    result = run_sync([10, 30])
    assert result.rounds[0]["rollout_s"] == pytest.approx(0.3)
    assert result.total_s == pytest.approx(0.3 + 1.0 + 0.5)  # + train + weight sync
    # worker bubble: (0.3 - 0.1) / (2 * 0.3); slot bubble (1 slot each): 1 - (0.1 + 0.3) / (2 * 0.3)
    ratios = bubble_ratios(result.events, max_batch=1)
    assert ratios["worker_bubble"] == pytest.approx(1 / 3)
    assert ratios["slot_bubble"] == pytest.approx(1 / 3)
    assert bubble_ratios(result.events, max_batch=4)["slot_bubble"] == pytest.approx(1 - 0.4 / 2.4)


def test_continuous_batching_admits_queued_requests_when_slots_free():
    # One slot per engine, four responses on two engines: 10+30 tokens on one, 20+20 on the other (LPT
    # sees no predictions, so placement is by order); the round ends when the busier engine finishes.
    result = run_sync([10, 20, 30, 20])
    finishes = sorted(e.t for e in result.events if e.kind == "request" and e.event == "finish")
    assert finishes[-1] == pytest.approx(result.rounds[0]["rollout_s"])
    assert result.rounds[0]["rollout_s"] == pytest.approx(0.4)


def test_round_start_fills_every_engine_from_its_own_queue_before_stealing():
    # As the driver's fill: with batch room for the whole round on one engine, each engine still starts its own
    # queue (two requests each), and the round lasts as long as the longer engine's own work.
    result = run_sync([10, 20, 30, 20], max_num_seqs=4)
    submits = [e.worker for e in result.events if e.kind == "request" and e.event == "submit"]
    assert sorted(submits) == [0, 0, 1, 1]
    assert result.rounds[0]["rollout_s"] == pytest.approx(0.3)


def test_kv_overflow_preempts_and_still_finishes():
    # KV room for ~60 tokens: two 50-token responses on one engine (placed by order, alternating) cannot
    # both stay resident.
    result = run_sync([50, 1, 50, 1], max_num_seqs=4, gpu_mem_gib=60 / 1024**3)
    assert result.rounds[0]["preemptions"] > 0
    assert sorted(result.rounds[0]["response_lengths"]) == [1, 1, 50, 50]


def test_sim_configs_load_and_reject_bad_keys():
    sim, run = load_sim_config("configs/sim_tiny_cpu.yaml", ["workload.persistence=0.5", "run.scheduler.max_staleness=2"])
    assert sim.workload.persistence == 0.5 and run.scheduler.max_staleness == 2
    sim, run = load_sim_config("configs/sim_qwen32b_128gpu.yaml")
    assert sim.cluster.gpus == 128 and run.rollout.max_response_length == 32768
    assert sim.engine.kv_capacity(4) > 500_000 and sim.engine.kv_capacity(1) < 50_000  # one 32k context at TP=1
    with pytest.raises(ConfigError):
        load_sim_config("configs/sim_tiny_cpu.yaml", ["workload.persistence=2.0"])
    with pytest.raises(ConfigError):
        load_sim_config("configs/sim_tiny_cpu.yaml", ["workload.nope=1"])


def test_simulate_command_prints_table_and_writes_plot(tmp_path, capsys):
    from megatron_sortedrl.cli import main

    rc = main(["simulate", "configs/sim_tiny_cpu.yaml", "workload.num_prompts=8", "workload.num_epochs=1",
               "--policies", "sync,twotier", "--out", str(tmp_path)])
    assert rc == 0
    out = capsys.readouterr().out
    assert "worker bubble" in out and "twotier" in out
    assert (tmp_path / "simulation.png").stat().st_size > 0 and (tmp_path / "simulation.json").is_file()
    assert main(["simulate", "configs/sim_tiny_cpu.yaml", "--policies", "fifo"]) == 2
