"""Invariants of every tier-1 policy, driven by the simulator over random length workloads (hypothesis).

Hardware: CPU only. Run: .venv/bin/python -m pytest tests/test_scheduler_policies.py -q
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_sortedrl.config import load_config
from scheduler.cost_model import EngineCostModel
from scheduler.sim.sim_config import ClusterCosts, SimConfig, WorkloadConfig
from scheduler.sim.simulator import build_policy, simulate, Simulator

BASE_RUN = load_config(None, ["model.path=/nonexistent/tiny", "rollout.long_round_tensor_parallel_size=2"])


def scenario(n=2, rollout_batch=4, update=4, group=6, mode="on_policy", staleness=1, prompts=10, epochs=2,
             sigma=1.0, share=0.6, persistence=0.8, seed=0, threshold=0.5, max_len=64, eta=1.25):
    sched = replace(BASE_RUN.scheduler, rollout_batch_size=rollout_batch, update_batch_size=update, group_size=group,
                    mode=mode, max_staleness=staleness, long_round_threshold=threshold, oversubscription=eta)
    rollout = replace(BASE_RUN.rollout, n_samples_per_prompt=n, max_response_length=max_len, num_workers=2)
    run = replace(BASE_RUN, scheduler=sched, rollout=rollout)
    engine = EngineCostModel(hbm_gbs=10.0, gpu_mem_gib=1.0, mem_utilization=0.5, weight_gib=0.001, kv_bytes_per_token=4096.0,
                             step_overhead_s=0.01, tp_comm_s=0.001, per_seq_s=0.0001, prefill_tokens_per_s=1e5, max_num_seqs=4)
    sim = SimConfig(cluster=ClusterCosts(gpus=2, gpus_per_node=2, train_tokens_per_s=1e4, relayout_s=0.5),
                    engine=engine, workload=WorkloadConfig(num_prompts=prompts, num_epochs=epochs, prompt_tokens=8,
                                                           median_response=max_len / 6, sigma=sigma, prompt_share=share,
                                                           persistence=persistence, seed=seed))
    return sim, run


workloads = st.fixed_dictionaries({
    "sigma": st.floats(0.0, 1.8), "share": st.floats(0.0, 1.0), "persistence": st.floats(0.0, 1.0),
    "seed": st.integers(0, 10_000), "n": st.sampled_from([2, 4]), "prompts": st.integers(3, 12),
})
FAST = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def check_common(result, sim, run):
    n, epochs = run.rollout.n_samples_per_prompt, sim.workload.num_epochs
    expected = {f"p{i}/e{e}": n for i in range(sim.workload.num_prompts) for e in range(epochs)}
    assert result.trained == expected  # every prompt of every epoch trained exactly n times
    limit = 0 if run.scheduler.mode == "on_policy" or result.policy in ("sync", "tail") else run.scheduler.max_staleness
    assert all(0 <= s <= limit for row in result.rounds for s in row["staleness"])
    for row in result.rounds:  # update batches are sorted short-first
        assert row["response_lengths"] == sorted(row["response_lengths"])


@pytest.mark.parametrize("policy", ["sync", "sorted", "tail", "twotier"])
@pytest.mark.parametrize("mode", ["on_policy", "partial"])
@FAST
@given(w=workloads)
def test_every_prompt_trained_n_times_and_staleness_bounded(policy, mode, w):
    n = w["n"]
    sim, run = scenario(n=n, update=2 * n, rollout_batch=3, group=5, mode=mode, prompts=w["prompts"], sigma=w["sigma"],
                        share=w["share"], persistence=w["persistence"], seed=w["seed"])
    check_common(simulate(sim, run, policy), sim, run)


@pytest.mark.parametrize("policy", ["sorted"])
@FAST
@given(w=workloads, group=st.integers(2, 7))
def test_grouped_policies_load_no_prompt_before_group_consumed(policy, w, group):
    n = w["n"]
    sim, run = scenario(n=n, update=n, group=group, mode="partial", prompts=w["prompts"], sigma=w["sigma"], seed=w["seed"])
    result = simulate(sim, run, policy)
    seen, trained = set(), {}
    for row in result.rounds:
        # A prompt is loaded when it enters a round or is routed to the long-tail queue at composition.
        new = (set(row["round_prompts"]) | set(row.get("deferred", []))) - seen
        if new and seen:  # a new group: everything loaded before must have been fully trained
            assert all(trained.get(k, 0) == n for k in seen)
        assert len(new) <= group
        seen |= new
        for k in row["trained"]:
            trained[k] = trained.get(k, 0) + 1
    check_common(result, sim, run)


@FAST
@given(w=workloads, p0=st.integers(1, 4))
def test_tail_long_rounds_hold_exactly_the_deferred_prompts(w, p0):
    sim, run = scenario(n=w["n"], rollout_batch=p0, update=w["n"], prompts=w["prompts"], sigma=w["sigma"] + 0.5,
                        seed=w["seed"], threshold=0.3)
    result = simulate(sim, run, "tail")
    queue: list[str] = []
    for row in result.rounds:
        queue.extend(row["deferred"])  # deferred while composing (history said long)
        if row["kind"] == "long":
            assert row["round_prompts"] == queue[: len(row["round_prompts"])]  # FIFO, nothing else
            assert len(row["round_prompts"]) <= p0
            queue = queue[len(row["round_prompts"]):]
            assert sorted(row["trained"]) == sorted(k for k in row["round_prompts"] for _ in range(w["n"]))
        else:
            assert not set(row["round_prompts"]) & set(queue)  # a deferred prompt never runs in a short round
        queue.extend(row["deferred_at_harvest"])  # aborted: first P0 prompts had completed
    assert not queue  # every deferred prompt ran in a long round
    check_common(result, sim, run)


@FAST
@given(w=workloads, group=st.integers(2, 9), p0=st.integers(1, 4), staleness=st.integers(1, 3))
def test_twotier_trains_every_prompt_by_the_next_round_and_wastes_nothing(w, group, p0, staleness):
    n = w["n"]
    sim, run = scenario(n=n, rollout_batch=p0, update=n, group=group, mode="partial", staleness=staleness, prompts=w["prompts"],
                        sigma=w["sigma"], share=w["share"], persistence=w["persistence"], seed=w["seed"])
    result = simulate(sim, run, "twotier")
    first_round: dict[str, int] = {}
    trained_in: dict[str, set[int]] = {}
    window = max(group, p0)
    for i, row in enumerate(result.rounds):
        assert len(row["round_prompts"]) <= window  # never more than the window in flight
        for k in row["round_prompts"]:
            first_round.setdefault(k, i)
        for k in row["trained"]:
            trained_in.setdefault(k, set()).add(i)
        remaining = len(set(first_round) - {k for k in trained_in if trained_in[k] <= set(range(i))})
        assert row["samples"] >= n * min(p0, remaining)  # an update holds at least a rollout batch (or what is left)
    for k, i in first_round.items():
        assert len(trained_in[k]) == 1 and trained_in[k] <= {i, i + 1}  # whole, in its round or the next
    # Only unfinished prompts are carried: every complete prompt is trained at the cut (a complete prompt carried
    # would only go one version stale). The cut comes when the last prompt it trains completes, so a carried
    # prompt finishes at that instant (a tie) or later, never before.
    last_finish: dict[str, float] = {}
    for e in result.events:
        if e.kind == "request" and e.event == "finish":
            key = e.sample_id.rsplit("/", 1)[0]
            last_finish[key] = max(last_finish.get(key, 0.0), e.t)
    for row in result.rounds:
        cut = max(last_finish[k] for k in row["trained"])
        for k in set(row["round_prompts"]) - set(row["trained"]):
            assert last_finish[k] >= cut
    assert result.policy_stats["wasted_tokens"] == 0  # nothing over-provisioned, restarted or reset
    assert max(result.staleness) <= 1
    check_common(result, sim, run)


def test_twotier_decisions_are_logged_per_round_and_deterministic():
    sim, run = scenario(n=4, rollout_batch=2, group=6, mode="partial", prompts=12, epochs=2, sigma=1.4)
    first, second = simulate(sim, run, "twotier"), simulate(sim, run, "twotier")
    decisions = first.policy_stats["decisions"]
    assert len(decisions) == len(first.rounds)
    assert decisions == second.policy_stats["decisions"]
    assert [d["trained"] * 4 for d in decisions] == [r["samples"] for r in first.rounds]
    assert any(d["carried"] for d in decisions)  # the heavy tail did get carried across a round
    # The same decisions after a checkpoint: stop after two rounds, resume from the state dict.
    pol, workload = build_policy(sim, run, "twotier")
    sim_a = Simulator(sim, run, pol, workload)
    for _ in range(2):
        sim_a.run_round(pol.compose_round(sim_a.clock))
    resumed, _ = build_policy(sim, run, "twotier", workload)
    resumed.load_state_dict(json.loads(json.dumps(pol.state_dict())))
    sim_b = Simulator(sim, run, resumed, workload)
    sim_b.clock.t = sim_a.clock.t
    sim_b.run_all()
    assert resumed.stats["decisions"] == decisions[2:]


@pytest.mark.parametrize("policy", ["sync", "sorted", "tail", "twotier"])
def test_waste_per_trained_token_does_not_grow_over_epochs(policy):
    # Waste is per round (surplus, aborts, stale resets), so its share of the trained tokens must level off:
    # six epochs waste no larger a share than two (the first epoch, with cold history, is the worst case).
    ratios = []
    for epochs in (2, 6):
        sim, run = scenario(n=4, rollout_batch=3, update=8, group=6, mode="partial", prompts=12, epochs=epochs, sigma=1.2)
        result = simulate(sim, run, policy, record=False)
        trained = sum(sum(r["response_lengths"]) for r in result.rounds)
        ratios.append(result.policy_stats["wasted_tokens"] / trained)
    assert ratios[1] <= 1.25 * ratios[0] + 0.02, ratios
    if policy in ("sync", "twotier"):
        assert ratios == [0.0, 0.0]


@pytest.mark.parametrize("policy", ["sync", "sorted", "tail", "twotier"])
def test_state_dict_is_json_and_resumes(policy):
    sim, run = scenario(prompts=10, mode="partial")
    pol, workload = build_policy(sim, run, policy)
    first = Simulator(sim, run, pol, workload)
    done = 0
    for _ in range(3):
        done += first.run_round(pol.compose_round(first.clock))["samples"]
    state = json.loads(json.dumps(pol.state_dict()))
    fresh, _ = build_policy(sim, run, policy, workload)
    fresh.load_state_dict(state)
    assert json.loads(json.dumps(fresh.state_dict())) == state
    second = Simulator(sim, run, fresh, workload)
    second.clock.t = first.clock.t
    result = second.run_all()
    assert done + sum(r["samples"] for r in result.rounds) == 10 * 2 * 2  # prompts x epochs x n, none lost


def test_tail_ignores_a_stale_attempt_of_a_restarted_prompt():
    """tail reopens a deferred prompt for its long round under the same sample ids; a response of its short
    round that is still being scored (the driver no longer waits for those) must not count for the restarted
    sample. The driver stamps each attempt's first submission (`submit_time`); a copy keeps it."""
    import copy

    from scheduler.layout import FixedPlanner
    from scheduler.policies import make_policy
    from scheduler.protocol import ManualClock

    sched = replace(BASE_RUN.scheduler, policy="tail", rollout_batch_size=1, update_batch_size=2, mode="on_policy")
    policy = make_policy(sched, ["a", "b"], n_samples=2, max_response_length=16,
                         planner=FixedPlanner(gpus=2, gpus_per_node=2, tp_short=1, tp_long=1))
    clock = ManualClock()
    short = policy.compose_round(clock)
    assert short.kind == "short" and len(short.prompts) == 2  # ceil(1.25 * 1) prompts x ceil(1.25 * 2) responses
    for i, r in enumerate(short.requests):
        r.sample.submit_time = 1.0 + i
    won = {r.sample.prompt_id for r in short.requests[:3]}.pop()
    late = next(r.sample for r in short.requests if r.sample.prompt_id != won)  # finished, reward still pending
    for r in short.requests:
        if r.sample.prompt_id == won:
            r.sample.append([1, 2], [0.0, 0.0], 0)
            r.sample.finish_reason = "stop"
            policy.on_sample_finished(r.sample, clock)
    harvest = policy.harvest(clock)
    assert harvest is not None and {s.prompt_id for s in harvest.batch} == {won}
    for sid in harvest.abort:
        s = next(r.sample for r in short.requests if r.sample.sample_id == sid)
        if s is not late:
            policy.on_sample_aborted(s, clock)
    long = policy.compose_round(clock)
    assert long.kind == "long" and {r.sample.sample_id for r in long.requests} >= {late.sample_id}
    stale = copy.deepcopy(late)  # what the reward stage hands back during the long round
    stale.append([3], [0.0], 0)
    stale.finish_reason = "stop"
    policy.on_sample_finished(stale, clock)
    st = policy.live[next(iter(policy.live))]
    assert st.status[late.sample_id] == "running" and policy.harvest(clock) is None
