"""Dynamic sampling, reward-history skip and overlong shaping (scheduler/selective.py), driven by the simulator.

Hardware: CPU only. Run: .venv/bin/python -m pytest tests/test_selective.py -q
"""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_sortedrl.algorithms import overlong_penalty
from megatron_sortedrl.config import load_config
from megatron_sortedrl.errors import ConfigError
from megatron_sortedrl.sample import Sample
from megatron_sortedrl.shaping import shape_batch
from scheduler.config import SamplingConfig
from scheduler.history import LengthHistory
from scheduler.selective import SelectivePolicy, SkipGate, informative
from scheduler.sim.simulator import Simulator, build_policy, simulate
from test_scheduler_policies import scenario

FAST = settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def with_sampling(sim, run, **kw):
    return sim, replace(run, sampling=SamplingConfig(dynamic=True, **kw))


class Recorder:
    """Wraps `SelectivePolicy.account` to see every outcome with the group's rewards."""

    def __init__(self, policy: SelectivePolicy) -> None:
        self.outcomes: dict[str, tuple[str, list[float] | None]] = {}
        inner = policy.account

        def account(key, outcome, rewards=None):
            assert key not in self.outcomes, f"{key} accounted twice"
            self.outcomes[key] = (outcome, rewards)
            inner(key, outcome, rewards)

        policy.account = account  # type: ignore[method-assign]


def run_recorded(sim, run, policy_name):
    policy, workload = build_policy(sim, run, policy_name)
    rec = Recorder(policy)
    result = Simulator(sim, run, policy, workload).run_all()
    return result, rec, policy


@pytest.mark.parametrize("policy", ["sync", "sorted", "tail", "twotier"])
@pytest.mark.parametrize("mode", ["on_policy", "partial"])
@FAST
@given(seed=st.integers(0, 10_000), n=st.sampled_from([2, 4]), prompts=st.integers(3, 12), skip=st.booleans(),
       extra=st.integers(0, 3), target=st.integers(0, 4))
def test_every_prompt_is_trained_filtered_or_skipped_and_the_filter_is_exact(policy, mode, seed, n, prompts, skip, extra, target):
    sim, run = scenario(n=n, update=2 * n, rollout_batch=3, group=5, mode=mode, prompts=prompts, seed=seed, epochs=3)
    sim = replace(sim, workload=replace(sim.workload, seed=seed))
    sim, run = with_sampling(sim, run, history_skip=skip, max_extra_rounds=extra, min_informative_groups=target,
                             skip_adapt_step=0.3)
    result, rec, pol = run_recorded(sim, run, policy)
    keys = {f"p{i}/e{e}" for i in range(prompts) for e in range(3)}
    assert set(rec.outcomes) == keys  # never silently lost, never counted twice
    for key, (outcome, rewards) in rec.outcomes.items():
        if outcome == "skipped":
            assert skip and rewards is None
        else:  # exact: unequal rewards are always trained, equal rewards never
            assert outcome == ("trained" if informative(rewards) else "filtered"), (key, outcome, rewards)
    trained = {k for k, (o, _) in rec.outcomes.items() if o == "trained"}
    assert result.trained == {k: n for k in trained}  # whole groups of exactly n reach the trainer
    for row in result.rounds:
        if not row["update"]:
            assert row["samples"] == 0  # a round asking for more trains nothing
        assert row["response_lengths"] == sorted(row["response_lengths"])
        assert row["informative_groups"] == len(set(row["trained"]))  # every trained group is informative
    limit = 0 if mode == "on_policy" or policy in ("sync", "tail") else run.scheduler.max_staleness
    assert all(0 <= s <= limit for row in result.rounds for s in row["staleness"])
    counts = {e: dict(c) for e, c in pol.consumed.items()}
    assert {e: sum(c.values()) for e, c in counts.items()} == {e: prompts for e in range(3)}


def test_updates_hold_the_target_unless_capped_or_out_of_data():
    sim, run = with_sampling(*scenario(n=4, rollout_batch=4, update=8, group=6, prompts=40, epochs=2), max_extra_rounds=10)
    result = simulate(sim, run, "sync")
    updates = [r for r in result.rounds if r["update"]]
    # rollout_batch_size informative groups, or the cap was hit (one warning, the update trains what it has)
    assert all(r["informative_groups"] >= 4 or r["sampling"]["sampling/cap_hit"] for r in updates[:-1])
    assert sum(r["informative_groups"] >= 4 for r in updates) >= 2
    assert sum(not r["update"] for r in result.rounds) > 0  # the filter did ask for extra rounds
    capped = with_sampling(*scenario(n=4, rollout_batch=4, update=8, group=6, prompts=40, epochs=2), max_extra_rounds=0)
    rows = simulate(*capped, "sync").rounds  # cap 0: one round per update, unless it had no informative group
    assert all(r["update"] == (r["informative_groups"] > 0) for r in rows[:-1]) and sum(r["update"] for r in rows) >= 3


def test_group_rule_holds_with_dynamic_sampling():
    sim, run = with_sampling(*scenario(n=2, update=2, group=4, mode="partial", prompts=11, epochs=2), history_skip=True)
    result, rec, _ = run_recorded(sim, run, "sorted")
    seen, done = set(), set()
    for row in result.rounds:
        new = (set(row["round_prompts"]) | set(row.get("deferred", []))) - seen
        finished = done | {k for k, (o, _) in rec.outcomes.items() if o != "trained"}
        if new and seen:  # a new group loads only once every earlier prompt was trained or filtered
            assert seen <= finished
        seen |= new
        done |= set(row["trained"])


# -- reward history and skip ------------------------------------------------------------------------------


def test_reward_streak_counts_consecutive_uninformative_epochs_and_is_bounded():
    h = LengthHistory(max_prompts=2)
    h.record_rewards("a", 0, [1.0, 1.0])
    h.record_rewards("a", 1, [0.0, 0.0])
    assert h.reward_streak("a") == 2
    h.record_rewards("a", 1, [0.0, 0.0])  # the same epoch again does not lengthen the streak
    assert h.reward_streak("a") == 2
    h.record_rewards("a", 2, [0.0, 1.0])
    assert h.reward_streak("a") == 0 and h.last_rewards("a") == [0.0, 1.0]
    h.record_rewards("b", 0, [1.0, 1.0])
    h.record_rewards("c", 0, [1.0, 1.0])
    assert h.reward_streak("a") == 0 and h.reward_streak("c") == 1 and len(h.state_dict()["rewards"]) == 2


def test_a_skipped_prompt_comes_back_at_the_floor_rate():
    cfg = SamplingConfig(dynamic=True, history_skip=True, skip_floor=0.1, skip_initial_probability=0.9)
    h = LengthHistory()
    for pid in range(4000):
        for e in range(3):
            h.record_rewards(f"q{pid}", e, [0.0] * 4)  # never solved, three epochs running
    gate = SkipGate(cfg, h, seed=7)
    assert gate.try_probability("q0") == pytest.approx(0.1)  # (1 - 0.9)^3 < floor: the floor decides
    trials = [(f"q{i}", e) for i in range(4000) for e in range(3, 8)]
    tried = sum(gate.tried(pid, e) for pid, e in trials)
    n, p = len(trials), 0.1
    assert abs(tried - n * p) < 5 * math.sqrt(n * p * (1 - p))  # binomial, 5 sigma: about 1 in 2 million
    assert gate.tried("unseen", 0) and gate.try_probability("unseen") == 1.0
    assert [gate.tried(pid, e) for pid, e in trials[:200]] == [SkipGate(cfg, h, 7).tried(pid, e) for pid, e in trials[:200]]


def test_skip_probability_adapts_towards_the_target_and_keeps_the_floor():
    cfg = SamplingConfig(dynamic=True, history_skip=True, skip_floor=0.2, skip_target_uninformative=0.25,
                         skip_adapt_step=0.04, skip_initial_probability=0.5)
    gate = SkipGate(cfg, LengthHistory(), 0)
    gate.adapt(uninformative=3, generated=4)
    assert gate.p == pytest.approx(0.5 + 0.04 * (3 - 0.25 * 4))  # a step per group, net of the target share
    gate.adapt(uninformative=90, generated=100)
    assert gate.p == pytest.approx(0.8)  # capped at 1 - floor
    gate.adapt(uninformative=10, generated=40)
    assert gate.p == pytest.approx(0.8)  # at the target share the feedback is in balance
    gate.adapt(uninformative=0, generated=10)
    assert gate.p == pytest.approx(0.8 - 0.04 * 0.25 * 10)
    gate.adapt(uninformative=0, generated=1000)
    assert gate.p == 0.0
    gate.adapt(uninformative=0, generated=0)
    assert gate.p == 0.0


def test_skip_saves_generation_and_is_deterministic_under_the_seed():
    base = scenario(n=4, rollout_batch=4, update=8, group=8, prompts=48, epochs=4, mode="partial")
    ds = simulate(*with_sampling(*base), "twotier", record=False)
    skip_a = simulate(*with_sampling(*base, history_skip=True), "twotier", record=False)
    skip_b = simulate(*with_sampling(*base, history_skip=True), "twotier", record=False)
    assert [r["trained"] for r in skip_a.rounds] == [r["trained"] for r in skip_b.rounds]
    a, d = skip_a.policy_stats["sampling"], ds.policy_stats["sampling"]
    assert a["skipped"] > 0
    assert a["generated_tokens"] / a["trained_tokens"] < d["generated_tokens"] / d["trained_tokens"]


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("skip", [False, True])
def test_generated_tokens_count_what_the_engines_generated(seed, skip):
    """tail restarts every aborted response from scratch, so the engines generated exactly the tokens of every
    finish and every abort event. The count may only lack what was aborted after the last update (nothing trains
    after it to carry the count): a filtered group's surplus responses, handed back after their prompt left the
    live set, are counted too."""
    sim, run = with_sampling(*scenario(n=4, rollout_batch=4, update=16, group=8, prompts=16, epochs=3, mode="partial",
                                       seed=seed), history_skip=skip)
    sim = replace(sim, workload=replace(sim.workload, seed=seed))
    result = simulate(sim, run, "tail")
    req = [e for e in result.events if e.kind == "request" and e.event in ("finish", "abort")]
    engines = sum(e.tokens or 0 for e in req)
    last = max(e.t for e in result.events if e.kind == "phase" and e.event == "start" and e.phase == "rollout")
    late = sum(e.tokens or 0 for e in req if e.event == "abort" and e.t >= last)
    assert engines - late <= result.policy_stats["sampling"]["generated_tokens"] <= engines
    assert any(e.event == "abort" for e in req)  # (the case this is about: oversubscribed groups abort surplus)


def test_a_late_skip_follows_the_streak_the_previous_group_just_extended():
    """The whole dataset fits one twotier window and the lookahead starts the next epoch's instances while the
    previous ones run, so their first decision reads no or older history. When a group completes uninformative,
    a later live instance of its prompt with no finished response is decided again with the same seeded draw:
    it leaves exactly when the gate, reading the extended streak, says skip."""
    sim, run = with_sampling(*scenario(n=4, rollout_batch=4, update=16, group=12, prompts=12, epochs=5, mode="partial"),
                             history_skip=True, skip_initial_probability=0.9, skip_floor=0.1)
    run = replace(run, scheduler=replace(run.scheduler, lookahead=True))
    policy, workload = build_policy(sim, run, "twotier")
    rec = Recorder(policy)
    checked = []
    decide_again = policy._decide_again

    def spy(prompt_id, epoch):
        later = {st.key: st for st in policy.inner.live.values() if st.prompt_id == prompt_id and st.epoch > epoch}
        expect = {k for k, st in later.items() if not st.n_finished and not policy.gate.tried(prompt_id, st.epoch)}
        before = set(rec.outcomes)
        abort = decide_again(prompt_id, epoch)
        assert informative(rec.outcomes[f"{prompt_id}/e{epoch}"][1]) is False  # only an uninformative group extends it
        assert set(rec.outcomes) - before == expect  # exactly the instances the fresher streak skips
        assert all(rec.outcomes[k] == ("skipped", None) and k not in policy.inner.live for k in expect)
        assert set(abort) <= {s.sample_id for k in expect for s in later[k].samples}
        checked.extend(expect)
        return abort

    policy._decide_again = spy  # type: ignore[method-assign]
    Simulator(sim, run, policy, workload).run_all()
    assert checked and policy.totals["skipped_late"] == len(checked)
    assert set(rec.outcomes) == {f"p{i}/e{e}" for i in range(12) for e in range(5)}  # nothing lost or counted twice


@pytest.mark.parametrize("policy", ["sync", "twotier"])
def test_resume_restores_reward_history_and_decisions_exactly(policy):
    sim, run = with_sampling(*scenario(n=8, rollout_batch=3, update=8, group=6, prompts=30, epochs=3, mode="partial"),
                             history_skip=True)
    full, rec_full, _ = run_recorded(sim, run, policy)
    pol, workload = build_policy(sim, run, policy)
    rec_a = Recorder(pol)
    sim_a = Simulator(sim, run, pol, workload)
    updates = 0
    while updates < 4:  # stop at an update boundary, past the first epoch (the skip is active)
        updates += sim_a.run_round(pol.compose_round(sim_a.clock))["update"]
    state = json.loads(json.dumps(pol.state_dict()))
    assert state["history"]["rewards"]  # the reward history travels in the scheduler's state
    resumed, _ = build_policy(sim, run, policy, workload)
    resumed.load_state_dict(state)
    assert json.loads(json.dumps(resumed.state_dict())) == state
    assert resumed.history.state_dict() == pol.history.state_dict() and resumed.gate.p == pol.gate.p
    rec_b = Recorder(resumed)
    sim_b = Simulator(sim, run, resumed, workload)
    sim_b.clock.t = sim_a.clock.t
    sim_b.run_all()
    assert {**rec_a.outcomes, **rec_b.outcomes} == rec_full.outcomes  # same skips, filters and trainings


# -- overlong shaping -------------------------------------------------------------------------------------


def dapo_reference(length: int, max_len: int, cache: int, factor: float) -> float:
    """DAPO eq. 13: 0 if |y| <= L_max - L_cache; ((L_max - L_cache) - |y|) / L_cache if within; -1 beyond."""
    if length <= max_len - cache:
        return 0.0
    if length <= max_len:
        return ((max_len - cache) - length) / cache * factor
    return -1.0 * factor


@pytest.mark.parametrize("max_len,buffer,factor", [(256, 64, 1.0), (32768, 4096, 1.0), (100, 1, 0.5)])
def test_overlong_penalty_matches_dapo_at_the_buffer_edges(max_len, buffer, factor):
    edges = [0, max_len - buffer - 1, max_len - buffer, max_len - buffer + 1, max_len - buffer // 2, max_len - 1,
             max_len, max_len + 1]
    for length in edges:
        assert overlong_penalty(length, max_len, buffer, factor) == pytest.approx(dapo_reference(length, max_len, buffer, factor))
    assert overlong_penalty(max_len - buffer, max_len, buffer, factor) == 0.0
    assert overlong_penalty(max_len, max_len, buffer, factor) == pytest.approx(-factor)
    assert overlong_penalty(max_len, max_len, 0, factor) == 0.0  # buffer 0: off


def test_shape_batch_penalises_and_masks_copies_only():
    def sample(i, length, reason):
        return Sample(prompt_id="p", index=i, response_tokens=[1] * length, finish_reason=reason, reward=1.0)

    batch = [sample(0, 10, "stop"), sample(1, 56, "stop"), sample(2, 64, "length")]
    cfg = SamplingConfig(overlong_buffer=16, overlong_penalty=1.0, overlong_filter=True)
    shaped, stats = shape_batch(batch, cfg, 64)
    assert [s.reward for s in shaped] == pytest.approx([1.0, 0.5, 0.0])
    assert [bool(s.meta.get("loss_masked")) for s in shaped] == [False, False, True]
    assert [s.reward for s in batch] == [1.0, 1.0, 1.0] and not batch[2].meta  # task rewards kept for logs
    assert stats["overlong/masked"] == 1 and stats["overlong/penalized_share"] == pytest.approx(2 / 3)
    assert shape_batch(batch, SamplingConfig(), 64) == (batch, {})


def test_sampling_config_errors_name_the_key():
    with pytest.raises(ConfigError, match="sampling.history_skip"):
        load_config(None, ["sampling.history_skip=true"])
    with pytest.raises(ConfigError, match="sampling.overlong_buffer"):
        load_config(None, ["sampling.overlong_buffer=256", "rollout.max_response_length=256"])
    with pytest.raises(ConfigError, match="sampling.skip_floor"):
        load_config(None, ["sampling.skip_floor=0"])


def test_run_report_draws_the_sampling_panel(tmp_path):
    from megatron_sortedrl.telemetry.run_report import write_run_report

    rows = [{"step": s, "t": float(s), "reward/mean": 0.5, "sampling/trained_groups": 8, "sampling/filtered_groups": 10 - s,
             "sampling/skipped_prompts": s, "sampling/predicted_informative": 9, "sampling/actual_informative": 8,
             "sampling/generated_per_trained_token": 2.0 - 0.1 * s} for s in range(1, 6)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    page = write_run_report(tmp_path).read_text()
    assert "Dynamic sampling and history skip" in page and (tmp_path / "report" / "selective_rollout.png").is_file()


def test_driver_generates_more_rounds_before_training_and_ends_on_an_empty_harvest():
    """The driver's hook lines (megatron_sortedrl/driver.py `sync_step`) with stub phases around them."""
    from types import SimpleNamespace

    from megatron_sortedrl.driver import Driver
    from scheduler.protocol import Harvest

    def stub(harvests):
        calls = []
        d = SimpleNamespace(events=[], step=1, calls=calls, agentic=None, colo=SimpleNamespace(step_row=lambda: {}),
                            cfg=SimpleNamespace(trainer=SimpleNamespace(total_steps=10)),
                            minibatch=SimpleNamespace(pending=[]))
        d.compose_round = lambda: calls.append("compose") or SimpleNamespace(kind="short")
        d.generate = lambda rnd: calls.append("generate") or harvests.pop(0)
        d.train = lambda batch, flush=False: calls.append(("train", len(batch))) or {"optimizer_steps": 1.0}
        d.sync_weights = d.update_history = lambda *a: {}
        d.log = lambda *a: {}
        d.rewards = SimpleNamespace(step_metrics=lambda *a: {})
        return d

    batch = [Sample(prompt_id="p", index=i, reward=float(i)) for i in range(2)]
    d = stub([Harvest([], [], {"more": True}), Harvest([], [], {"more": True}), Harvest(batch, [], {"sampling": {}})])
    assert Driver.sync_step(d) is not None
    assert d.calls == ["compose", "generate", "compose", "generate", "compose", "generate", ("train", 2)]
    d = stub([Harvest([], [], {"more": True}), Harvest([], [], {"sampling": {}})])  # the data ran out mid-update
    assert Driver.sync_step(d) is None and ("train", 0) not in d.calls


def test_overlong_filter_masks_the_truncated_response_out_of_the_trainer_items():
    from types import SimpleNamespace

    from megatron_sortedrl.trainer.group import TrainerGroup

    cfg = load_config(None, ["algorithm.tis_cap=0"])
    fake = SimpleNamespace(cfg=cfg, _item=TrainerGroup._item)
    samples = [Sample(prompt_id="p", index=i, prompt_tokens=[1, 2], response_tokens=[3] * (i + 2), reward=1.0)
               for i in range(2)]
    samples[1].meta["loss_masked"] = True
    items = TrainerGroup._rl_items(fake, samples, [0.5, -0.5], None)
    assert items[0]["mask"] is None and items[1]["mask"] == [0.0, 0.0, 0.0]


# -- twotier's harvest counts filtered groups as complete -----------------------------------------------------


def _finish(pol, clock, key, rewards):
    """Finishes the samples of prompt `key` with the given rewards (one per sample, in order)."""
    for s, r in zip(list(pol.live[key].samples), rewards):
        clock.t += 1.0
        s.append([1, 2, 3, 4], [0.0] * 4, pol.version)
        s.reward = r
        pol.on_sample_finished(s, clock)


def test_twotier_harvest_counts_filtered_groups_towards_half_the_window():
    """A dropped (uninformative) group is complete: twotier harvests once half the window is complete counting it,
    instead of waiting for the tail, trains at most target - filtered prompts and carries the rest."""
    from scheduler.protocol import ManualClock

    sim, run = with_sampling(*scenario(n=2, rollout_batch=2, update=4, group=8, prompts=8, epochs=1, mode="partial"),
                             min_informative_groups=2)
    pol, _ = build_policy(sim, run, "twotier")
    clock = ManualClock()
    keys = list(pol.compose_round(clock).prompts)
    assert len(keys) == 8 and pol.inner.target == 4  # half the window
    _finish(pol, clock, keys[0], [1.0, 1.0])
    _finish(pol, clock, keys[1], [0.0, 1.0])
    _finish(pol, clock, keys[2], [0.0, 0.0])
    assert pol.harvest(clock) is None  # 2 filtered + 1 informative: 3 of the 4 needed
    _finish(pol, clock, keys[3], [1.0, 1.0])
    h = pol.harvest(clock)  # 3 filtered + 1 informative = half the window, the other four still running
    assert h is not None and h.stats["more"] and h.batch == []  # one informative group pending, two needed
    running = {s.sample_id for k in keys[4:] for s in pol.live[k].samples}
    assert set(h.abort) == running and pol.inner.carry == keys[4:]
    d = pol.inner.stats["decisions"][-1]
    assert d["trained"] + d["filtered"] == d["target"] and d["due"] == 0
    for k in keys[4:]:
        for s in pol.live[k].samples:
            pol.on_sample_aborted(s, clock)
    assert list(pol.compose_round(clock).prompts) == keys[4:]  # carried, not due: no update since they first ran
    _finish(pol, clock, keys[4], [0.0, 1.0])
    _finish(pol, clock, keys[5], [1.0, 1.0])
    h = pol.harvest(clock)  # 1 informative + 1 filtered = half of this round's 4; keys[6:] still running
    assert h is not None and not h.stats.get("more")
    assert sorted({s.prompt_id + "/e0" for s in h.batch}) == sorted([keys[1], keys[4]])
    assert pol.inner.carry == keys[6:] and set(h.abort) == {s.sample_id for k in keys[6:] for s in pol.live[k].samples}
    pol.on_update(1, clock)
    for k in keys[6:]:
        for s in pol.live[k].samples:
            pol.on_sample_aborted(s, clock)
    assert list(pol.compose_round(clock).prompts) == keys[6:]  # now due: they first ran before the update
    _finish(pol, clock, keys[6], [1.0, 0.0])
    assert pol.harvest(clock) is None  # half of the round is complete, but a due prompt is still running
    _finish(pol, clock, keys[7], [0.0, 0.0])
    h = pol.harvest(clock)
    assert h is not None and {s.prompt_id + "/e0" for s in h.batch} == {keys[6]}
    assert max(h.stats["staleness"]) <= 1
    assert {e: dict(c) for e, c in pol.consumed.items()} == {0: {"trained": 3, "filtered": 5}}


def test_twotier_ds_rounds_consume_half_the_window():
    """Property over simulated runs: every twotier round with dynamic sampling was harvested with at least
    min(target, its prompts) of them complete (trained or filtered), trained every carried (due) prompt and no
    more than ran; staleness stays within the bound (the version-based due rule). (The target decides when to
    cut, not how much is trained: every prompt complete at the cut is trained.)"""
    for seed in range(4):
        sim, run = with_sampling(*scenario(n=4, rollout_batch=2, update=8, group=8, prompts=20, epochs=3,
                                           mode="partial", seed=seed), history_skip=seed % 2 == 1)
        sim = replace(sim, workload=replace(sim.workload, seed=seed))
        result = simulate(sim, run, "twotier")
        decisions = result.policy_stats["decisions"]
        assert decisions and any(d["filtered"] for d in decisions)
        assert all(0 <= x <= run.scheduler.max_staleness for row in result.rounds for x in row["staleness"])
        for d in decisions:
            prompts = d["carried"] + d["fresh"]
            assert d["trained"] + d["filtered"] >= min(d["target"], prompts)
            assert d["due"] <= d["carried"] and d["due"] <= d["trained"] + d["filtered"] and d["trained"] + d["filtered"] <= prompts
        plain = simulate(*scenario(n=4, rollout_batch=2, update=8, group=8, prompts=20, epochs=3, mode="partial",
                                   seed=seed), "twotier")
        assert all(d["filtered"] == 0 for d in plain.policy_stats["decisions"])  # no filter: the rule is unchanged
