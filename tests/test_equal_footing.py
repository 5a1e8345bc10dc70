"""Equal footing in the simulator: the same optimizer steps for every policy on the same data, the cost of each
step, and `x_best_sync` against the better of two sync batches (scheduler/sim/equal_footing.py).

    pytest tests/test_equal_footing.py -q

Hardware: CPU only (the discrete-event simulator; no engines).
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler.sim.equal_footing import add_best_sync, compare, mean_harvest_prompts, pooled_labels
from scheduler.sim.limit import physical_limit
from scheduler.sim.report import summarize
from scheduler.sim.sim_config import load_sim_config
from scheduler.sim.simulator import simulate

POLICIES = ("sync", "sorted", "tail", "twotier")


def _tiny(*overrides: str):
    return load_sim_config("configs/sim_tiny_cpu.yaml", ["workload.num_prompts=16", "workload.num_epochs=2",
                                                         *overrides])


@settings(max_examples=8, deadline=None)
@given(st.sampled_from([4, 8, 12, 20, 32]), st.integers(0, 3), st.integers(1, 2))
def test_every_policy_makes_the_same_optimizer_steps_on_the_same_data(size, seed, epochs):
    sim, run = _tiny(f"workload.seed={seed}", f"run.algorithm.ppo_mini_batch_size={size}",
                     f"run.algorithm.ppo_epochs={epochs}")
    samples = 16 * 2 * run.rollout.n_samples_per_prompt
    for policy in POLICIES:
        result = simulate(sim, run, policy, record=False)
        assert sum(r["samples"] for r in result.rounds) == samples
        assert result.optimizer_steps == math.ceil(samples / size) * epochs, policy
        assert all(r["optimizer_steps"] % epochs == 0 for r in result.rounds)


def test_without_minibatches_the_steps_follow_the_harvests():
    sim, run = _tiny("run.algorithm.ppo_mini_batch_size=0")
    steps = {p: simulate(sim, run, p, record=False).optimizer_steps for p in ("sync", "sorted")}
    assert steps["sync"] != steps["sorted"]  # the old footing: one step per harvest


def test_each_optimizer_step_costs_its_fixed_seconds_and_the_sync_is_paid_once_per_harvest():
    sim, run = _tiny("run.algorithm.ppo_mini_batch_size=16", "cluster.optimizer_step_s=0.25")
    assert sim.cluster.optimizer_step_s == 0.25
    base = simulate(replace(sim, cluster=replace(sim.cluster, optimizer_step_s=0.0)), run, "sync")
    paid = simulate(sim, run, "sync")
    assert paid.optimizer_steps == base.optimizer_steps == 8  # 128 samples / 16
    # the rollouts are the same: the run is longer by exactly the steps' fixed cost
    assert paid.total_s - base.total_s == pytest.approx(0.25 * paid.optimizer_steps)
    syncs = [e for e in paid.events if e.kind == "phase" and e.phase == "sync" and e.event == "start"]
    assert len(syncs) == len(paid.rounds) == 2  # one weight sync per harvest, not per step


def test_a_remainder_waits_and_trains_after_the_last_round():
    sim, run = _tiny("run.algorithm.ppo_mini_batch_size=24")  # 128 samples: 5 full mini-batches and 8 left
    result = simulate(sim, run, "twotier")
    assert result.optimizer_steps == 6
    assert sum(r["optimizer_steps"] for r in result.rounds) == 5  # the sixth is the flush after the last round
    assert result.total_s > result.rounds[-1]["rollout_s"]


def test_compare_adds_sync_at_the_default_harvest_and_the_ratio_to_the_better_sync():
    sim, run = load_sim_config("configs/sim_tiny_cpu.yaml", ["run.algorithm.ppo_mini_batch_size=16"])
    rows, results = compare(sim, run, ["sync", "twotier"])
    names = [r["policy"] for r in rows]
    b = mean_harvest_prompts(results[1], run.rollout.n_samples_per_prompt)
    assert names == ["sync", "twotier", f"sync@b{b}"] and b != run.scheduler.rollout_batch_size
    best = max((r for r in rows if r["policy"].startswith("sync")), key=lambda r: r["samples_per_s"])
    assert best["x_best_sync"] == pytest.approx(1.0)
    for r in rows:
        assert r["x_best_sync"] == pytest.approx(r["samples_per_s"] / best["samples_per_s"])
        assert r["updates"] == rows[0]["updates"]  # equal footing


def test_histospec_rows_get_both_ratios():
    rows = add_best_sync([{"policy": "sync", "samples_per_s": 2.0}, {"policy": "sync@b8", "samples_per_s": 4.0},
                          {"policy": "sync+histospec@b8", "samples_per_s": 5.0},
                          {"policy": "twotier+histospec", "samples_per_s": 10.0},
                          {"policy": "sync@system", "samples_per_s": 8.0}])  # a mechanism variant, not a batch
    assert rows[3]["x_best_sync"] == 2.5 and rows[3]["x_best_sync_histospec"] == 2.0
    assert rows[3]["best_sync"] == "sync@b8" and "x_best_sync_histospec" not in rows[1]


def test_sync_batch_rows_pool_across_seeds_under_one_label():
    same = pooled_labels(["sync", "sync@b48", "twotier", "sync@b48", "twotier@tokens_only"])
    assert same == {"sync": "sync", "sync@b48": "sync@b48", "twotier": "twotier",
                    "twotier@tokens_only": "twotier@tokens_only"}
    spread = pooled_labels(["sync@b12", "sync@b14", "sync+histospec@b13", "sync@system"])
    assert spread == {"sync@b12": "sync@b12-14", "sync@b14": "sync@b12-14", "sync+histospec@b13": "sync+histospec@b13",
                      "sync@system": "sync@system"}


def test_the_limit_stays_below_every_policy_with_minibatches():
    sim, run = _tiny("run.algorithm.ppo_mini_batch_size=8", "run.algorithm.ppo_epochs=2", "cluster.optimizer_step_s=0.2")
    lim = physical_limit(sim, run)
    assert lim["optimizer_steps"] == 32
    for p in POLICIES:
        row = summarize(simulate(sim, run, p))
        assert row["total_s"] / row["samples"] >= lim["s_per_sample"]
