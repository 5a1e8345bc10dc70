"""Simulator reward cost: heavy-tailed scoring on a few workers puts reward on the critical path, more
workers take it off, and with the section off the simulation is unchanged. Pure Python, a few seconds."""

from __future__ import annotations

import pytest

from scheduler.sim.reward_cost import RewardCostConfig, RewardQueue
from scheduler.sim.sim_config import load_sim_config
from scheduler.sim.simulator import simulate

BASE = ["workload.num_epochs=1", "workload.num_prompts=32", "reward.median_s=0.05", "reward.sigma=1.5",
        "reward.timeout_s=2"]


def _run(workers: int):
    sim, run = load_sim_config("configs/sim_tiny_cpu.yaml", BASE + [f"reward.workers={workers}"])
    return simulate(sim, run, "twotier", record=False)


def test_queue_is_first_come_first_served_on_k_workers():
    q = RewardQueue(RewardCostConfig(workers=2, median_s=1.0, sigma=0.0), latency_s=0.0)
    assert [q.arrival(0.0, f"s{i}") for i in range(4)] == [1.0, 1.0, 2.0, 2.0]
    assert q.arrival(10.0, "late") == 11.0
    q = RewardQueue(RewardCostConfig(workers=1, median_s=5.0, sigma=0.0, timeout_s=3.0), latency_s=0.5)
    assert q.arrival(0.0, "x") == 3.5 and q.timeouts == 1
    off = RewardQueue(RewardCostConfig(workers=0), latency_s=0.25)
    assert off.arrival(2.0, "x") == 2.25


def test_more_reward_workers_shorten_the_reward_critical_path():
    share = {}
    for w in (1, 8):
        r = _run(w)
        share[w] = sum(x["reward_critical_s"] for x in r.rounds) / r.total_s
        assert all(0 <= x["reward_critical_s"] <= x["rollout_s"] + 1e-9 for x in r.rounds)
    assert share[1] > 0.3 and share[8] < share[1] / 2


def test_reward_section_off_keeps_the_old_model():
    off = _run(0)
    sim, run = load_sim_config("configs/sim_tiny_cpu.yaml", BASE[:2])
    again = simulate(sim, run, "twotier", record=False)
    assert off.total_s == pytest.approx(again.total_s)
    assert sum(x["reward_critical_s"] for x in off.rounds) / off.total_s < 0.01


def test_autoscaled_workers_start_under_backlog_and_are_given_back_when_idle():
    cfg = RewardCostConfig(workers=1, max_workers=3, median_s=1.0, sigma=0.0, target_drain_s=0.5, start_s=0.25,
                           idle_s=5.0)
    q = RewardQueue(cfg, latency_s=0.0)
    # s0 takes the one worker; s1 would wait 1 s > 0.5: a second worker starts (free at 0.25) and takes it;
    # s2 would wait 1 s again: a third; s3 finds all three busy and none may start: it queues.
    assert [q.arrival(0.0, f"s{i}") for i in range(4)] == [1.0, 1.25, 1.25, 2.0]
    assert q.size == q.size_max == 3
    assert q.arrival(20.0, "late") == 21.0 and q.size == 1  # idle for 18 s: two given back
    # the two extra workers left 5 s after their last sample (t = 1.25 + 5), not when the next one came
    assert q.worker_seconds(21.0) == pytest.approx(21.0 + 2 * 6.25 - 0.0)


# Steps that train for 3 s between rounds: the reward workers' idle time that autoscaling gives back.
LONG = ["workload.num_epochs=2", "workload.num_prompts=64", "reward.median_s=0.05", "reward.sigma=1.5",
        "reward.timeout_s=2", "cluster.train_fixed_s=3"]


def _run_long(lo: int, hi: int = 0):
    sim, run = load_sim_config("configs/sim_tiny_cpu.yaml", LONG + [f"reward.workers={lo}", f"reward.max_workers={hi}",
                                                                    "reward.target_drain_s=0.2", "reward.start_s=0.5",
                                                                    "reward.idle_s=1"])
    return simulate(sim, run, "twotier", record=False)


def test_autoscaling_buys_most_of_a_large_pool_for_fewer_worker_seconds():
    fixed1, fixed8, scaled = _run_long(1), _run_long(8), _run_long(1, 8)

    def share(r):
        return sum(x["reward_critical_s"] for x in r.rounds) / r.total_s

    assert share(scaled) < share(fixed1) / 2 and scaled.total_s < 0.6 * fixed1.total_s  # off the critical path...
    assert scaled.rounds[-1]["reward_workers_max"] > 1
    assert scaled.rounds[-1]["reward_worker_s"] < fixed8.rounds[-1]["reward_worker_s"]  # ...for less than 8 always on
