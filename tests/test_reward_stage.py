"""Reward stage: timeouts from history, scaling from the backlog, harvest order, the critical path, and the
Ray backend (real local Ray, CPU-only actors). Reward functions sleep instead of computing, so the timing
bounds hold on a loaded machine. About a minute on an idle machine."""

from __future__ import annotations

import time

import pytest

from megatron_sortedrl.config import RewardConfig
from megatron_sortedrl.reward_stage import Autoscaler, RewardStage, TimeoutHistory
from megatron_sortedrl.sample import Sample


def sleepy_reward(sample, ground_truth):
    """Sleeps the seconds written in the response ("0.2"), or 60 for "hang"; correct when it does not hang."""
    if sample.response_text == "hang":
        time.sleep(60)
    time.sleep(float(sample.response_text))
    return 1.0


def batch_reward(samples, truths):
    return [1.0 if s.response_text == t else 0.0 for s, t in zip(samples, truths)]


batch_reward.batched = True


def _s(prompt: str, index: int, text: str, truth: str = "") -> Sample:
    return Sample(prompt_id=prompt, index=index, response_text=text, ground_truth=truth)


def _stage(**kw) -> RewardStage:
    workers = kw.pop("workers", 1)
    fn = kw.pop("fn", sleepy_reward)
    timeout_s = kw.pop("timeout_s", 20.0)
    return RewardStage(fn, RewardConfig(**kw), workers=workers, timeout_s=timeout_s, group_size=2, say=lambda _: None)


def test_timeout_history_is_a_bounded_multiple_of_the_slowest_pass():
    h = TimeoutHistory(multiple=3.0, min_s=0.5, max_s=10.0)
    assert h.timeout_for("p") == 10.0  # nothing known: the configured limit
    for secs, reward in ((0.2, 1.0), (0.4, 1.0), (5.0, 0.0)):  # the slow failing sample does not count
        h.record(Sample("p", 0, reward=reward, meta={"reward_seconds": secs}))
    assert h.timeout_for("p") == pytest.approx(1.2)
    h.record(Sample("q", 0, reward=1.0, meta={"reward_seconds": 0.01}))
    assert h.timeout_for("q") == 0.5
    h.record(Sample("r", 0, reward=1.0, meta={"reward_seconds": 9.0}))
    assert h.timeout_for("r") == 10.0
    assert h.record(Sample("p", 1, reward=0.0, reward_error="timeout")) and h.timeouts == {"p": 1}
    assert h.record(Sample("p", 2, reward=0.0, meta={"reward_reason": "timeout"})) and h.timeouts["p"] == 2


def test_autoscaler_grows_with_backlog_and_shrinks_when_idle():
    a = Autoscaler(min_workers=1, max_workers=4, target_drain_s=1.0, interval_s=0.0, idle_s=2.0)
    a.observe(0.5)
    assert a.decide(0.0, 1, backlog=6) == 3  # 6 x 0.5 s within 1 s needs 3
    assert a.decide(0.1, 3, backlog=100) == 4  # capped
    assert a.decide(0.2, 4, backlog=1) == 4  # never shrinks while work is pending
    assert a.decide(1.0, 4, backlog=0) == 4
    assert a.decide(3.1, 4, backlog=0) == 3  # idle for idle_s: one worker back
    assert a.decide(3.2, 3, backlog=0) == 3
    assert Autoscaler(2, 4, 1.0, 10.0, 1.0).decide(5.0, 2, backlog=0) == 2  # never below min


def test_history_timeout_cuts_a_hang_short_and_counts_it_per_prompt():
    stage = _stage(timeout="history", timeout_multiple=3.0, min_timeout_s=0.5, timeout_s=30.0)
    try:
        first = stage.score([_s("p", 0, "0.1"), _s("p", 1, "0.2")])
        assert all(s.reward == 1.0 for s in first)
        assert 0.5 <= stage.history.timeout_for("p") < 2.0
        t0 = time.monotonic()
        (hung,) = stage.score([_s("p", 2, "hang")])
        took = time.monotonic() - t0
        # history limit (<= 2 s) + the pool's grace (5 s) + a restart; the configured 30 s would fail this
        assert hung.reward == 0.0 and hung.reward_error == "timeout" and took < 16
        m = stage.step_metrics([hung], step_s=10.0)
        assert m["reward/timeouts"] == 1.0 and m["reward/timeouts_by_prompt"] == {"p": 1}
        assert stage.history.timeouts == {"p": 1}
    finally:
        stage.close()


def test_pool_grows_under_backlog_and_reports_workers_and_critical_path():
    stage = _stage(autoscale=True, min_workers=1, max_workers=3, target_drain_s=0.5, scale_interval_s=0.05,
                   max_batch=1)
    try:
        batch = [_s(f"p{i // 2}", i % 2, "0.4") for i in range(16)]
        scored = stage.score(batch)
        assert all(s.reward == 1.0 for s in scored)
        m = stage.step_metrics(batch, step_s=20.0)
        assert m["reward/workers_max"] == 3.0 and m["reward/resizes"] >= 1
        assert 0.0 < m["reward/workers_active"] <= 3.0  # how many overlap depends on the machine's load
        last_gen = max(s.meta["gen_done"] for s in batch)
        assert m["reward/critical_path_s"] == pytest.approx(max(s.meta["reward_done"] for s in batch) - last_gen)
        assert m["reward/critical_path_s"] >= 0.4  # at least the last sample's own scoring
        assert m["reward/scoring_s"] == pytest.approx(0.4, abs=0.3)
        assert m["reward/critical_path_share"] == pytest.approx(m["reward/critical_path_s"] / 20.0)
    finally:
        stage.close()


def test_harvest_order_scores_complete_groups_first():
    stage = _stage(order="harvest", max_batch=1)
    try:
        stage.submit(_s("busy", 0, "1.0"))  # occupies the only worker while the rest queues
        deadline = time.monotonic() + 60
        while stage.pool.busy == 0 and time.monotonic() < deadline:  # the spawned worker has started
            stage.poll()
            time.sleep(0.01)
        lone = [_s(f"lone{i}", 0, "0.01") for i in range(3)]  # groups with 1 of 2 responses
        pair = [_s("pair", 0, "0.01"), _s("pair", 1, "0.01")]  # a complete group, arriving last
        for s in lone + pair:
            stage.submit(s)
        done = stage.drain()
        order = [s.prompt_id for s in sorted(done, key=lambda s: s.meta["reward_done"])]
        assert order[:3] == ["busy", "pair", "pair"], order
    finally:
        stage.close()


def test_ray_backend_scores_times_out_and_takes_batches(local_ray):
    import sys

    from ray import cloudpickle

    # pytest imports this file as a top-level module the actors cannot import: ship its functions by value
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    stage = _stage(backend="ray", ray_num_cpus=0.25, timeout="history", min_timeout_s=0.5, timeout_s=30.0)
    try:
        assert all(s.reward == 1.0 for s in stage.score([_s("p", 0, "0.05"), _s("p", 1, "0.05")]))
        t0 = time.monotonic()
        (hung,) = stage.score([_s("p", 2, "hang")])
        assert hung.reward_error == "timeout" and time.monotonic() - t0 < 15
        assert stage.score([_s("p", 3, "0.01")])[0].reward == 1.0  # the replaced actor scores
    finally:
        stage.close()
    stage = _stage(backend="ray", ray_num_cpus=0.25, fn=batch_reward, max_batch=8)
    try:
        assert stage.pool.max_batch == 8
        out = stage.score([_s("q", i, str(i), truth="3") for i in range(6)])
        assert {s.index: s.reward for s in out} == {i: float(i == 3) for i in range(6)}
    finally:
        stage.close()


def test_rewards_left_after_a_harvest_reach_the_policy_later_and_none_is_lost():
    """The driver does not wait after a harvest for rewards it did not take: an evaluation's `score` returns
    only its own samples and keeps the round's for the next poll; a checkpoint's hand-over waits for all."""
    from types import SimpleNamespace

    from megatron_sortedrl.round_stream import compose_round, hand_over_rewards

    class Policy:
        def __init__(self):
            self.finished, self.composed = [], 0

        def on_sample_finished(self, s, clock):
            self.finished.append(s.sample_id)
            return []

        def compose_round(self, clock):  # nothing to generate until every sample has come back
            self.composed += 1
            return "round" if len(self.finished) == 4 else None

    stage = _stage(workers=2)
    try:
        left = [_s("p", i, "0.4") for i in range(3)]  # the round's samples the harvest did not take
        for s in left:
            stage.submit(s)
        ev = [_s("eval", 0, "0.0")]
        assert stage.score(ev) == ev  # the evaluation gets its own sample only, at once
        d = SimpleNamespace(rewards=stage, policy=Policy(), clock=None)
        stage.submit(_s("q", 0, "1.0"))
        n = hand_over_rewards(d)  # non-blocking: whatever is done
        assert n == len(d.policy.finished) <= 3
        # the policy has nothing to generate while rewards are on their way: compose waits for them
        assert compose_round(d) == "round" and d.policy.composed >= 2
        assert sorted(d.policy.finished) == sorted([s.sample_id for s in left] + [_s("q", 0, "").sample_id])
        assert len(stage) == 0 and hand_over_rewards(d, wait=True) == 0
    finally:
        stage.close()


def test_timeout_history_is_restored_exactly_from_a_checkpoint(tmp_path):
    """A resumed run gives every prompt the limit it had: the stage's state goes through the real checkpoint
    file (torch.save, read back with weights_only) and comes back equal."""
    import torch

    from megatron_sortedrl.trainer.checkpoint import MARKER, STATE_FILE, read_state

    kw = {"timeout": "history", "timeout_multiple": 3.0, "min_timeout_s": 0.3, "autoscale": True, "min_workers": 1,
          "max_workers": 2, "timeout_s": 5.0}
    stage = _stage(**kw)
    try:
        stage.score([_s("p", 0, "0.25"), _s("p", 1, "0.05"), _s("q", 0, "0.0"), _s("r", 0, "hang")])
    finally:
        stage.close()
    assert stage.history.timeouts == {"r": 1}
    ckpt = tmp_path / "iter_0000001"
    ckpt.mkdir()
    torch.save({"step": 1, "extra": {"reward_stage": stage.state_dict()}}, ckpt / STATE_FILE)
    (ckpt / MARKER).write_text("{}")
    restored = _stage(**kw)
    try:
        before = {p: restored.history.timeout_for(p) for p in "pqrs"}
        assert set(before.values()) == {5.0}  # a fresh stage knows nothing yet
        restored.load_state_dict(read_state(ckpt)["extra"]["reward_stage"])
        for p in "pqrs":
            assert restored.history.timeout_for(p) == stage.history.timeout_for(p), p
        assert restored.history.slowest_pass == stage.history.slowest_pass
        assert restored.history.timeouts == stage.history.timeouts == {"r": 1}
        assert restored.scaler.mean_s == stage.scaler.mean_s > 0
        assert 0.3 <= stage.history.timeout_for("p") < 5.0  # learned, not the default
    finally:
        restored.close()
