"""HistoSpec model of the simulator and the physical limit: reduction to no speculation, the draft-length
chain against hand-computed values, where speculation pays, calibration round trip, and the limit as a
lower bound of every policy's simulated time (hypothesis over random workloads).

Hardware: CPU only. Run: .venv/bin/python -m pytest tests/test_speculation_model.py -q   (~40 s)
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_sortedrl.errors import ConfigError
from scheduler.sim.limit import physical_limit
from scheduler.sim.sim_config import load_sim_config
from scheduler.sim.simulator import simulate
from scheduler.sim.speculation_model import (HistoSpecSim, SpeculationConfig, alpha_for_rate, calibrate, chain, emitted,
                                         split_policy)

SMALL = ["workload.num_prompts=12", "workload.num_epochs=2", "run.scheduler.rollout_batch_size=4",
         "run.scheduler.update_batch_size=8", "run.scheduler.group_size=8"]


def test_chain_matches_hand_computation():
    # One state (min = max = 4): every forward drafts 4, emits 1 + a + a^2 + a^3 + a^4 in expectation.
    a = 0.6
    rate, drafted, acc = chain(a, 4, 4)
    assert rate == pytest.approx(1 + a + a**2 + a**3 + a**4)
    assert drafted == 4 and acc == pytest.approx((rate - 1) / 4)
    # Two states {2, 4}: from 2, full accept (a^2) -> 4; from 4, anything short of full (1 - a^4) -> 2.
    p4 = a**2 / (a**2 + 1 - a**4)
    rate, drafted, _ = chain(a, 2, 4)
    assert drafted == pytest.approx(2 * (1 - p4) + 4 * p4)
    assert rate == pytest.approx((1 - p4) * emitted(a, 2) + p4 * emitted(a, 4))
    assert chain(0.0, 2, 16) == (1.0, 2.0, 0.0)
    assert alpha_for_rate(chain(0.7, 2, 16)[0], 2, 16) == pytest.approx(0.7, abs=1e-3)


def test_zero_acceptance_reduces_to_no_speculation():
    sim, run = load_sim_config("configs/sim_tiny_cpu.yaml", SMALL)
    zero = replace(sim, speculation=SpeculationConfig(alpha_0=0.0, alpha_inf=0.0))
    for policy in ("sync", "twotier"):
        plain, spec = simulate(zero, run, policy), simulate(zero, run, policy + "+histospec")
        assert spec.policy == policy + "+histospec"
        assert spec.total_s == pytest.approx(plain.total_s, rel=1e-12)
        assert [r["rollout_s"] for r in spec.rounds] == pytest.approx([r["rollout_s"] for r in plain.rounds], rel=1e-12)
        assert spec.policy_stats["speculation"]["drafting_share"] == 0.0


def test_histospec_speeds_up_rollout_and_drafts_only_from_shipped_history_or_siblings():
    sim, run = load_sim_config("configs/sim_tiny_cpu.yaml", SMALL)
    plain, spec = simulate(sim, run, "twotier"), simulate(sim, run, "twotier+histospec")
    no_siblings = simulate(replace(sim, speculation=replace(sim.speculation, sibling_drafts=False)), run,
                           "twotier+histospec")
    # The first round has no history from earlier rounds: without sibling drafts it runs exactly as without
    # speculation; with them its tail drafts from the siblings that finished first, and is faster.
    assert no_siblings.rounds[0]["rollout_s"] == pytest.approx(plain.rounds[0]["rollout_s"], rel=1e-12)
    assert spec.rounds[0]["rollout_s"] < plain.rounds[0]["rollout_s"]
    assert spec.total_s < no_siblings.total_s < plain.total_s
    stats = spec.policy_stats["speculation"]
    assert 0.0 < stats["drafting_share"] < 1.0 and stats["mean_tokens_per_forward_drafting"] > 1.0
    # Every trained sample keeps its full drawn length (speculation changes time, not outputs).
    assert sorted(x for r in spec.rounds for x in r["response_lengths"]) == \
        sorted(x for r in plain.rounds for x in r["response_lengths"])


def test_speculation_pays_most_with_few_sequences():
    sim, _ = load_sim_config("configs/sim_qwen32b_128gpu.yaml")
    spec, c, model = HistoSpecSim(sim.speculation), sim.speculation, sim.engine
    rate, drafted, _ = chain(round(c.alpha(1.0), 3), c.min_draft_tokens, c.max_draft_tokens)

    def speedup(b):
        ctx = b * 3000.0
        return (b * rate / spec.step_s(model, 8, b, b * (1 + drafted), ctx)) / (b / model.decode_step_s(8, b, ctx))

    ups = [speedup(b) for b in (1, 4, 16, 64, 256)]
    assert ups == sorted(ups, reverse=True)  # monotone: the fuller the batch, the less a draft is worth
    assert ups[0] > 0.9 * rate and ups[-1] < 0.6 * ups[0]


def test_acceptance_decays_with_history_age_and_config_is_checked():
    c = SpeculationConfig(alpha_0=0.9, alpha_inf=0.5, tau_versions=4.0, shape=1.0)
    assert c.alpha(0) == pytest.approx(0.9) and c.alpha(4) == pytest.approx(0.5 + 0.4 / 2.718281828, rel=1e-6)
    assert c.alpha(0) > c.alpha(1) > c.alpha(8) > 0.5
    assert split_policy("twotier+histospec") == ("twotier", True) and split_policy("sync") == ("sync", False)
    with pytest.raises(ConfigError):
        SpeculationConfig(alpha_0=1.2)
    with pytest.raises(ConfigError):
        SpeculationConfig(min_draft_tokens=8, max_draft_tokens=4)


def test_calibration_recovers_a_known_curve():
    truth = SpeculationConfig(alpha_0=0.9, alpha_inf=0.55, tau_versions=5.0, shape=1.0)
    points = [{"source": f"a{a}", "age_versions": a, "acceptance": 0.0,
               "tokens_per_forward": chain(round(truth.alpha(a), 6), 2, 16)[0]} for a in (0, 2, 4, 8, 16)]
    fitted = calibrate(points)["fitted"]
    assert fitted["alpha_0"] == pytest.approx(0.9, abs=0.01) and fitted["alpha_inf"] == pytest.approx(0.55, abs=0.02)
    assert fitted["tau_versions"] == pytest.approx(5.0, abs=0.75) and fitted["shape"] == 1.0


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), sigma=st.floats(0.3, 1.6), prompts=st.integers(4, 12),
       share=st.floats(0.0, 1.0), alpha=st.floats(0.0, 0.95))
def test_limit_is_never_above_any_policy(seed, sigma, prompts, share, alpha):
    sim, run = load_sim_config("configs/sim_tiny_cpu.yaml", [
        f"workload.seed={seed}", f"workload.sigma={sigma}", f"workload.num_prompts={prompts}", "workload.num_epochs=2",
        f"workload.prompt_share={share}", "run.scheduler.rollout_batch_size=4", "run.scheduler.update_batch_size=8",
        "run.scheduler.group_size=8"])
    sim = replace(sim, speculation=SpeculationConfig(alpha_0=alpha, alpha_inf=alpha / 2, alpha_cap=0.97))
    limit = physical_limit(sim, run)
    plain_limit = physical_limit(sim, run, speculation=False)
    assert limit["total_s"] <= plain_limit["total_s"] + 1e-9
    for policy in ("sync", "sorted", "tail", "twotier", "sync+histospec", "twotier+histospec"):
        result = simulate(sim, run, policy, record=False)
        samples = sum(r["samples"] for r in result.rounds)
        assert samples == limit["samples"]
        assert result.total_s / samples >= limit["s_per_sample"]
        if "+" not in policy:
            assert result.total_s / samples >= plain_limit["s_per_sample"]
    # The round-tail changes (lookahead, colocated stream training, tail migration) stay above it too.
    _, ahead_run = load_sim_config("configs/sim_tiny_cpu.yaml", [
        f"workload.seed={seed}", f"workload.sigma={sigma}", f"workload.num_prompts={prompts}", "workload.num_epochs=2",
        f"workload.prompt_share={share}", "run.scheduler.rollout_batch_size=4", "run.scheduler.update_batch_size=8",
        "run.scheduler.group_size=8", "run.scheduler.lookahead=true"])
    streamed = replace(sim, cluster=replace(sim.cluster, stream_training=True, tail_migration=True))
    for policy in ("twotier", "twotier+histospec"):
        result = simulate(streamed, ahead_run, policy, record=False)
        assert result.total_s / sum(r["samples"] for r in result.rounds) >= limit["s_per_sample"]
    # Disaggregated stream training (half the GPUs train) against the any-placement form of the bound.
    dsim, drun = load_sim_config("configs/sim_tiny_cpu.yaml", [
        f"workload.seed={seed}", f"workload.sigma={sigma}", f"workload.num_prompts={prompts}", "workload.num_epochs=2",
        f"workload.prompt_share={share}", "run.scheduler.rollout_batch_size=4", "run.scheduler.update_batch_size=8",
        "run.scheduler.group_size=8", "run.scheduler.lookahead=true", "cluster.gpus=4", "cluster.gpus_per_node=2",
        "cluster.trainer_gpus=2", "cluster.stream_training=true", "cluster.tail_migration=true"])
    dsim = replace(dsim, speculation=sim.speculation)
    dlimit = physical_limit(dsim, drun)
    assert dlimit["any_placement_total_s"] <= dlimit["total_s"] + 1e-9
    for policy in ("sync", "twotier+histospec"):
        result = simulate(dsim, drun, policy, record=False)
        assert result.total_s / sum(r["samples"] for r in result.rounds) >= dlimit["any_placement_s_per_sample"]


def test_simulate_command_takes_histospec_variants(tmp_path, capsys):
    from megatron_sortedrl.cli import main

    rc = main(["simulate", "configs/sim_tiny_cpu.yaml", "workload.num_prompts=8", "workload.num_epochs=2",
               "--policies", "sync,twotier+histospec", "--out", str(tmp_path)])
    assert rc == 0
    out = capsys.readouterr().out
    assert "twotier+histospec" in out and "x limit" in out and "physical limit" in out
    assert main(["simulate", "configs/sim_tiny_cpu.yaml", "--policies", "twotier+magic"]) == 2
