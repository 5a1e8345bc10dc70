"""Multi-turn trajectories in the simulator and the per-trajectory history (scheduler/sim/trajectory_sim.py).

Hardware: CPU only. Run: .venv/bin/python -m pytest tests/test_trajectory_sim.py -q

- single-turn runs reproduce main's figures exactly (event digests recorded from main before trajectories landed);
- a simulated trajectory takes at least the sum of its turns' decode times and its tool latencies (property);
- carry-over never loses a completed turn (property), and the agent scenario does carry samples waiting on a tool;
- the history predicts trajectory cost (tokens + tool seconds) and the policies' requests carry it;
- bad multi-turn keys fail at load time naming the key.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_sortedrl.errors import ConfigError
from scheduler.history import LengthHistory
from scheduler.sim.sim_config import ToolKind, load_sim_config
from scheduler.sim.simulator import build_policy, simulate
from scheduler.sim.trajectory_sim import Trajectory, ToolCall, tokens_per_tool_s

ROOT = Path(__file__).resolve().parent.parent
AGENT = ROOT / "configs" / "sim_agentic_7b_8gpu.yaml"
SMALL = ["workload.num_prompts=10", "workload.num_epochs=2", "run.rollout.n_samples_per_prompt=4",
         "run.scheduler.rollout_batch_size=4", "run.scheduler.update_batch_size=16", "run.scheduler.group_size=8",
         "run.rollout.max_response_length=4096", "workload.median_response=150", "cluster.gpus=2", "cluster.gpus_per_node=2",
         "run.rollout.long_round_tensor_parallel_size=1", "run.algorithm.ppo_mini_batch_size=16"]


def digest(result) -> str:
    return hashlib.sha256(json.dumps([(round(e.t, 6), e.kind, e.event, e.worker, e.sample_id, e.tokens, e.phase, e.step)
                                      for e in result.events]).encode()).hexdigest()[:16]


# Recorded on main (39da9a2) before trajectories existed: total seconds, rounds and a digest of every event. The
# scenarios have since moved to mini-batches (one optimizer step per mini-batch, its own fixed cost): with one step
# per harvest and the step's cost in train_fixed_s again (ONE_STEP) the events are still byte-identical.
ONE_STEP = ["run.algorithm.ppo_mini_batch_size=0", "cluster.optimizer_step_s=0"]
TINY_ONE_STEP = ONE_STEP + ["cluster.train_fixed_s=0.5"]
REGIME_SMALL = ["workload.num_prompts=32", "workload.num_epochs=2", "run.scheduler.rollout_batch_size=8",
                "run.scheduler.update_batch_size=64", "run.scheduler.group_size=32", *ONE_STEP, "cluster.train_fixed_s=5"]
GOLDEN = [
    ("configs/sim_tiny_cpu.yaml", TINY_ONE_STEP, "sync", 35.26512055672322, 12, "ed0b65c9ba7d1cae"),
    ("configs/sim_tiny_cpu.yaml", TINY_ONE_STEP, "sorted", 45.755123368601595, 24, "75ffdf3cd24e14c3"),
    ("configs/sim_tiny_cpu.yaml", TINY_ONE_STEP, "tail", 34.64432794900483, 13, "e9e728057e7fec78"),
    ("configs/sim_tiny_cpu.yaml", TINY_ONE_STEP, "twotier", 28.861686256332817, 9, "7a5cc0a659f281b4"),
    ("configs/sim_tiny_cpu.yaml", TINY_ONE_STEP, "twotier+histospec", 27.967436347820332, 9, "b20238750abf9095"),
    ("configs/sim_regime_base.yaml", REGIME_SMALL, "sync", 981.6757793323616, 8, "fbd22f28b02a8dcb"),
    ("configs/sim_regime_base.yaml", REGIME_SMALL, "tail", 703.2887935166029, 8, "306a37144494d81d"),
    ("configs/sim_regime_base.yaml", REGIME_SMALL, "twotier", 303.56395770494646, 3, "df35d76f627643ad"),
    ("configs/sim_regime_base.yaml", REGIME_SMALL, "twotier+histospec", 178.33504121789542, 3, "95b7bfb3e9eada23"),
]


@pytest.mark.parametrize("path,over,policy,total,rounds,sha", GOLDEN)
def test_single_turn_reproduces_main_exactly(path, over, policy, total, rounds, sha):
    sim, run = load_sim_config(ROOT / path, over)
    result = simulate(sim, run, policy)
    assert (result.total_s, len(result.rounds), digest(result)) == (total, rounds, sha)
    assert result.trajectories == {} and "trajectory" not in result.policy_stats


def test_one_turn_with_tools_configured_is_single_turn():
    """turns_max=1 switches trajectories off even when tool kinds are listed: the agent scenario then runs its
    sessions as single-turn samples, the same events as with no tool section at all."""
    sim, run = load_sim_config(AGENT, SMALL + ["workload.turns_max=1"])
    plain = replace(sim, workload=replace(sim.workload, tool_kinds=[]))
    assert digest(simulate(sim, run, "twotier")) == digest(simulate(plain, run, "twotier"))


def _finish_times(result) -> dict[str, float]:
    return {e.sample_id: e.t for e in result.events if e.kind == "request" and e.event == "finish"}


def _finish_tokens(result) -> dict[str, int]:
    return {e.sample_id: e.tokens for e in result.events if e.kind == "request" and e.event == "finish"}


def _scenario(seed: int, turns_max: int, tool_median: float, tool_sigma: float, sigma: float):
    return load_sim_config(AGENT, SMALL + [f"workload.seed={seed}", f"workload.turns_max={turns_max}",
                                           f"workload.sigma={sigma}",
                                           f"workload.tool_kinds=[{{name: a, median_s: {tool_median}, sigma: {tool_sigma}, "
                                           f"tokens: 40}}, {{name: b, median_s: 0.1, sigma: 0.5, tokens: 8}}]"])


cases = st.fixed_dictionaries({"seed": st.integers(0, 10_000), "turns_max": st.integers(2, 8),
                               "tool_median": st.floats(0.05, 30.0), "tool_sigma": st.floats(0.0, 1.5),
                               "sigma": st.floats(0.2, 1.2), "policy": st.sampled_from(["sync", "sorted", "tail", "twotier"])})
FAST = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FAST
@given(cases)
def test_trajectory_time_covers_its_turns_and_tools(c):
    """Finish - start of a trajectory's last attempt >= its decode steps at the fastest possible step (one sequence,
    no context, the largest TP) + every tool latency: turns and tool calls lie on its critical path."""
    sim, run = _scenario(c["seed"], c["turns_max"], c["tool_median"], c["tool_sigma"], c["sigma"])
    result = simulate(sim, run, c["policy"])
    finish = _finish_times(result)
    tp = max(run.rollout.tensor_parallel_size, run.rollout.long_round_tensor_parallel_size)
    fastest = sim.engine.decode_step_s(tp, 1, 0)
    trained = {sid for r in result.rounds for sid in r["sample_ids"]}
    assert trained and trained <= set(result.trajectories)
    for sid in trained:
        rec = result.trajectories[sid]
        starts = [t for ev, t, attempt, r in rec["log"] if ev == "start" and attempt == rec["attempt"]]
        assert rec["log"][0][3] == 0 or rec["attempt"] > 0
        bound = sum(rec["turns"]) * fastest + sum(call[1] for call in rec["tools"])
        assert finish[sid] - min(starts) >= bound - 1e-6, (sid, rec)


def _check_no_turn_lost(result, partial: bool) -> None:
    finish = _finish_tokens(result)
    for sid, rec in result.trajectories.items():
        traj = Trajectory(tuple(rec["turns"]), tuple(ToolCall(*c) for c in rec["tools"]))
        by_attempt: dict[int, list] = {}
        for ev, t, attempt, r in rec["log"]:
            by_attempt.setdefault(attempt, []).append((ev, r))
        for attempt, entries in by_attempt.items():
            kept = [r for _, r in entries]
            assert kept == sorted(kept), (sid, attempt, entries)  # within an attempt tokens never go back
        last = by_attempt.get(rec["attempt"], [])
        if sid in finish:  # a finished sample holds every turn (and tool message) of its trajectory
            assert finish[sid] == traj.total and traj.completed_turns(finish[sid]) == len(rec["turns"])
        if partial:  # an abort keeps the tokens: the next start of the same sample resumes exactly there
            for (ev, r), (ev2, r2) in zip(last, last[1:]):
                if ev == "abort" and ev2 == "start":
                    assert r2 >= r and traj.completed_turns(r2) >= traj.completed_turns(r), (sid, last)


@FAST
@given(cases)
def test_carry_over_never_loses_a_completed_turn(c):
    sim, run = _scenario(c["seed"], c["turns_max"], c["tool_median"], c["tool_sigma"], c["sigma"])
    result = simulate(sim, run, "twotier")
    _check_no_turn_lost(result, partial=True)
    trained = {sid for r in result.rounds for sid in r["sample_ids"]}
    finish = _finish_times(result)
    for sid in trained:  # partial mode never restarts a trajectory that had generated anything
        rec = result.trajectories[sid]
        assert finish[sid] >= 0 and all(r == 0 for ev, t, a, r in rec["log"] if a < rec["attempt"])


def test_agent_scenario_carries_samples_waiting_on_a_tool_and_resumes_them():
    sim, run = load_sim_config(AGENT, SMALL)
    result = simulate(sim, run, "twotier")
    _check_no_turn_lost(result, partial=True)
    carried = 0
    for rec in result.trajectories.values():
        log = rec["log"]
        for a, b, c in zip(log, log[1:], log[2:]):
            if a[0] == "tool_call" and b[0] == "abort":  # aborted while its tool ran, at a turn boundary
                carried += 1
                assert b[3] == a[3] and c[0] in ("tool_done", "start") and c[2] == a[2]
    assert carried > 0
    assert result.policy_stats["trajectory"]["tool_calls"] > 0


def test_history_predicts_trajectory_cost():
    h = LengthHistory("prev_max")
    h.record("p", 0, 100)
    assert h.predict_cost("p", 50.0) == h.predict("p") == 100.0  # single-turn: unchanged
    h.record("p", 1, 100, turns=3, tool_s=4.0)
    h.record("p", 1, 300, turns=1, tool_s=0.0)
    assert h.predict_cost("p", 50.0) == 300.0  # 100 + 50 * 4 = 300 ties the long-winded one
    assert h.predict_cost("p", 100.0) == 500.0  # the slow tool now dominates
    assert h.predict_trajectory("p") == {"tokens": 300.0, "turns": 3.0, "tool_s": 4.0}
    assert h.predict_cost("unseen", 100.0) == 500.0  # fallback over recent trajectories
    g = LengthHistory("prev_max")
    g.load_state_dict(json.loads(json.dumps(h.state_dict())))
    assert g.state_dict() == h.state_dict() and g.predict_cost("p", 100.0) == 500.0
    assert "trajectories" not in LengthHistory().state_dict()  # single-turn checkpoints keep their format


def test_requests_and_placement_use_predicted_trajectory_cost():
    """After an epoch, a request's predicted length is its prompt's trajectory cost, tool seconds included."""
    sim, run = load_sim_config(AGENT, SMALL + ["run.scheduler.policy=sync"])
    policy, _ = build_policy(sim, run, "sync")
    rate = tokens_per_tool_s(sim, run.rollout.tensor_parallel_size)
    assert 10 < rate < 1000
    policy.trajectory_info = lambda s: (4, 20.0)
    policy.tokens_per_tool_s = rate

    class Clock:
        def now(self):
            return 0.0

    rnd = policy.compose_round(Clock())
    for r in rnd.requests:
        r.sample.append([0] * 100, [0.0] * 100, 0)
        policy.on_sample_finished(r.sample, Clock())
    policy.harvest(Clock())
    policy.on_update(1, Clock())
    while (rnd := policy.compose_round(Clock())) and rnd.requests[0].sample.epoch == 0:
        for r in rnd.requests:
            r.sample.append([0] * 100, [0.0] * 100, 1)
            policy.on_sample_finished(r.sample, Clock())
        policy.harvest(Clock())
    assert rnd is not None and rnd.requests[0].sample.epoch == 1
    assert all(r.predicted_length == pytest.approx(100 + rate * 20.0) for r in rnd.requests)


@pytest.mark.parametrize("override,key", [
    ("workload.turns_max=0", "workload.turns_max"),
    ("workload.tool_kinds=[]", "workload.tool_kinds"),
    ("workload.tool_kinds=[{name: x, median_s: -1}]", "workload.tool_kinds.0"),
])
def test_bad_multi_turn_keys_are_refused_by_name(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_sim_config(AGENT, [override])


def test_bad_key_on_the_command_line_is_one_line_exit_2():
    proc = subprocess.run([sys.executable, "-m", "megatron_sortedrl", "simulate", str(AGENT), "workload.turns_max=0",
                           "--policies", "sync"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 2 and "workload.turns_max" in proc.stderr and "Traceback" not in proc.stderr


def test_tool_kind_defaults_are_valid():
    assert ToolKind().median_s > 0


def test_physical_limit_counts_tool_time_and_every_policy_respects_it():
    """The limit's latency term is the longest critical path (turns decoded alone + tool latencies); no policy
    finishes the agent scenario faster than the bound."""
    from scheduler.sim.limit import physical_limit

    sim, run = load_sim_config(AGENT, SMALL)
    lim = physical_limit(sim, run, speculation=True)
    assert lim["latency_engine"]["tool_s"] > 0 and lim["latency_s"] > lim["latency_engine"]["tool_s"]
    for policy in ("sync", "tail", "twotier", "twotier+histospec"):
        assert simulate(sim, run, policy, record=False).total_s >= lim["total_s"]
