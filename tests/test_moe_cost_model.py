"""The engine cost model and the simulator for Mixture-of-Experts engines: decode reads the shared weights plus
the experts a step touches (bounded by all of them at large batch), memory follows the total weights, and
the committed 128-GPU MoE scenario agrees with the model's shape. CPU only, no engines.

    python -m pytest tests/test_moe_cost_model.py -q
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest

from megatron_sortedrl.errors import ConfigError
from megatron_sortedrl.plan.arch import Arch
from scheduler.cost_model import GIB, EngineCostModel
from scheduler.sim.sim_config import load_sim_config
from scheduler.sim.simulator import simulate
from scheduler.sim.speculation_model import HistoSpecSim

REPO = Path(__file__).resolve().parent.parent
MOE = {"weight_gib": 100.0, "expert_weight_gib": 96.0, "num_experts": 128, "experts_per_token": 8,
       "gpu_mem_gib": 140.0, "hbm_gbs": 4800.0}


def test_dense_step_time_is_unchanged():
    m = EngineCostModel()
    assert m.weight_read_gib(1) == m.weight_read_gib(256) == m.weight_gib
    by_hand = 0.006 + 0.002 * 1 + (61.0 * GIB + 1000 * 262144.0) / (2 * 3350.0 * 1e9) + 0.00004 * 8 / 2
    assert m.decode_step_s(2, 8, 1000) == pytest.approx(by_hand, rel=1e-12)


def test_moe_decode_reads_shared_weights_plus_touched_experts():
    m = EngineCostModel(**MOE)
    assert m.weight_read_gib(1) == pytest.approx(4.0 + 96.0 * 8 / 128)  # one token: its top-8 of 128
    reads = [m.weight_read_gib(b) for b in (1, 2, 4, 16, 64, 256, 1024)]
    assert all(a < b for a, b in zip(reads, reads[1:]))  # more tokens touch more experts
    assert reads[-1] == pytest.approx(100.0, rel=1e-6) and all(r <= 100.0 for r in reads)  # ... at most all
    # expected distinct experts per layer: E (1 - (1 - k/E)^B); B = 16 -> 128 (1 - (15/16)^16)
    assert m.expert_share_read(16) * 128 == pytest.approx(128 * (1 - (120 / 128) ** 16))
    dense = replace(m, expert_weight_gib=0.0)
    assert m.kv_capacity(4) == dense.kv_capacity(4)  # memory follows the total weights
    bare, bare_dense = (replace(x, step_overhead_s=0.0, tp_comm_s=0.0, per_seq_s=0.0) for x in (m, dense))
    assert bare.decode_step_s(4, 1, 0) == pytest.approx(bare_dense.decode_step_s(4, 1, 0) * 10 / 100)  # 10 GiB, not 100
    assert m.decode_step_s(4, 1, 3000) < dense.decode_step_s(4, 1, 3000)
    assert m.decode_step_s(4, 1024, 3e6) == pytest.approx(dense.decode_step_s(4, 1024, 3e6), rel=1e-6)


def test_drafts_pay_less_on_moe_engines():
    """A verify step's extra positions touch more experts, so speculation's gain at small batch is smaller."""
    sim, _ = load_sim_config(REPO / "configs" / "sim_qwen3_235b_128gpu.yaml")
    spec = HistoSpecSim(sim.speculation)
    moe, dense = sim.engine, replace(sim.engine, expert_weight_gib=0.0)

    def gain(engine, b, k=4):  # same accepted tokens either way: step time ratio is the speedup's denominator
        return engine.decode_step_s(4, b, b * 3000.0) / spec.step_s(engine, 4, b, b * (1 + k), b * 3000.0)
    assert gain(moe, 1) < gain(dense, 1)
    assert gain(moe, 512) == pytest.approx(gain(dense, 512), rel=0.01)  # a big batch touches every expert anyway


def test_bad_moe_engine_keys_are_refused():
    with pytest.raises(ConfigError, match="engine.expert_weight_gib"):
        EngineCostModel(weight_gib=10.0, expert_weight_gib=11.0, num_experts=8, experts_per_token=2)
    with pytest.raises(ConfigError, match="engine.experts_per_token"):
        EngineCostModel(weight_gib=10.0, expert_weight_gib=8.0, num_experts=8, experts_per_token=0)


def test_moe_scenario_matches_the_model_shape():
    sim, run = load_sim_config(REPO / "configs" / "sim_qwen3_235b_128gpu.yaml")
    arch = Arch.from_path(REPO / "configs" / "model_shapes" / "qwen3-235b-a22b")
    e = sim.engine
    assert e.weight_gib == pytest.approx(arch.num_params * 2 / GIB, abs=0.05)
    assert e.expert_weight_gib == pytest.approx(arch.routed_expert_params * 2 / GIB, abs=0.05)
    assert (e.num_experts, e.experts_per_token) == (arch.num_experts, arch.experts_per_token)
    assert e.kv_bytes_per_token == arch.kv_bytes_per_token(2)
    assert e.per_seq_s == pytest.approx(2 * arch.active_params / (0.5 * 989e12), rel=0.02)
    # one token reads exactly its active parameters: the shared part and its top-8 experts
    assert e.weight_read_gib(1) * GIB == pytest.approx(arch.active_params * 2, rel=0.01)
    assert e.min_tp() == run.rollout.tensor_parallel_size == 4 and sim.cluster.gpus == 128


def test_simulated_moe_rollout_is_faster_than_its_dense_equivalent():
    """Same workload, same memory: an engine that reads only the routed experts finishes rollout sooner."""
    sim, run = load_sim_config(REPO / "configs" / "sim_tiny_cpu.yaml", ["workload.num_prompts=16", "workload.num_epochs=1"])
    moe = replace(sim, engine=replace(sim.engine, expert_weight_gib=sim.engine.weight_gib * 0.9, num_experts=64,
                                      experts_per_token=4, hbm_gbs=0.05))
    dense = replace(moe, engine=replace(moe.engine, expert_weight_gib=0.0))
    a, b = simulate(moe, run, "sync", record=False), simulate(dense, run, "sync", record=False)
    assert sum(r["samples"] for r in a.rounds) == sum(r["samples"] for r in b.rounds) > 0
    assert a.total_s < b.total_s


def test_committed_moe_benchmark_has_every_policy_over_three_seeds():
    doc = json.loads((REPO / "docs" / "benchmarks" / "simulation_qwen3_235b_128gpu.json").read_text())
    policies = {r["policy"] for r in doc["rows"]}
    assert {p + s for p in ("sync", "sorted", "tail", "twotier") for s in ("", "+histospec")} <= policies
    assert len(doc["seeds"]) >= 3 and (REPO / "docs" / "benchmarks" / "simulation_qwen3_235b_128gpu.png").is_file()
    for r in doc["rows"]:
        assert r["seeds"] == doc["seeds"]
        for stat in r.values():
            if isinstance(stat, dict):
                assert stat["min"] <= stat["median"] <= stat["max"] and not math.isnan(stat["median"])
