"""Reward pool: scoring in spawned workers; a raising or hanging reward function gives 0, is counted and
logged with the sample id, and the other samples are still scored. CPU, a few seconds."""

from __future__ import annotations

import time

import pytest

from megatron_sortedrl.reward_pool import RewardPool
from megatron_sortedrl.sample import Sample


def flaky_reward(sample, ground_truth):
    """Raises on every third response index, hangs on "hang", else exact match."""
    if sample.response_text == "hang":
        time.sleep(60)
    if sample.index % 3 == 2:
        raise RuntimeError(f"bad sample {sample.sample_id}")
    return 1.0 if sample.response_text.strip() == ground_truth else 0.0


def _sample(i: int, text: str, truth: str = "42") -> Sample:
    return Sample(prompt_id=f"p{i // 3}", index=i % 3, response_text=text, ground_truth=truth)


@pytest.fixture(scope="module")
def pool():
    with RewardPool(flaky_reward, num_workers=2, timeout_s=3.0) as p:
        yield p


def test_raising_samples_get_zero_and_are_counted(pool):
    samples = [_sample(i, "42" if i % 2 == 0 else "41") for i in range(12)]
    before = dict(pool.stats)
    scored = pool.score(samples)
    assert sorted(s.sample_id for s in scored) == sorted(s.sample_id for s in samples)
    for s in scored:
        if s.index == 2:
            assert s.reward == 0.0 and "bad sample" in s.reward_error
        else:
            assert s.reward == (1.0 if s.response_text == "42" else 0.0) and s.reward_error == ""
    assert pool.stats["errors"] - before["errors"] == 4
    assert pool.stats["scored"] - before["scored"] == 12
    failed_ids = {sid for sid, _ in pool.failures}
    assert failed_ids >= {s.sample_id for s in samples if s.index == 2}


def test_timeout_kills_worker_and_run_goes_on(pool):
    before = dict(pool.stats)
    samples = [_sample(0, "hang"), _sample(1, "42"), _sample(3, "42"), _sample(4, "7")]
    t0 = time.monotonic()
    scored = {s.sample_id: s for s in pool.score(samples)}
    assert time.monotonic() - t0 < 30
    hung = scored[samples[0].sample_id]
    assert hung.reward == 0.0 and hung.reward_error == "timeout"
    assert pool.stats["timeouts"] - before["timeouts"] == 1
    assert [scored[s.sample_id].reward for s in samples[1:]] == [1.0, 1.0, 0.0]
    # the restarted worker still scores
    assert pool.score([_sample(6, "42")])[0].reward == 1.0


def test_builtin_reward_by_dotted_path():
    from megatron_sortedrl.data import load_prompts
    from megatron_sortedrl.config import load_config

    cfg = load_config(None, [])
    prompt = load_prompts(cfg.data, "eval")[0]
    good = Sample(prompt_id=prompt.prompt_id, index=0, response_text=prompt.solution or prompt.ground_truth,
                  ground_truth=prompt.ground_truth)
    bad = Sample(prompt_id=prompt.prompt_id, index=1, response_text="no idea", ground_truth=prompt.ground_truth)
    with RewardPool("megatron_sortedrl.rewards.arithmetic.reward", num_workers=1) as p:
        out = {s.index: s.reward for s in p.score([good, bad])}
    assert out == {0: 1.0, 1: 0.0}


def exit_on_seven(sample, ground_truth):
    """Kills its own process on "exit", hangs on "hang", else exact match."""
    import os

    if sample.response_text == "exit":
        os._exit(3)
    if sample.response_text == "hang":
        time.sleep(60)
    return 1.0 if sample.response_text == ground_truth else 0.0


def test_a_burst_goes_out_in_one_message_per_idle_worker():
    with RewardPool(exit_on_seven, num_workers=1, timeout_s=5.0, max_batch=64) as p:
        while not p.workers[0].check_ready():
            time.sleep(0.01)
        samples = [_sample(i, "42") for i in range(40)]
        for s in samples:
            p.pending.append(s)
        p._dispatch()
        assert not p.pending and len(p.workers[0].tasks) == 40  # one message holds the whole burst
        assert [s.reward for s in p.drain()] == [1.0] * 40


@pytest.mark.parametrize("bad", ["hang", "exit"])
def test_a_failure_inside_a_batch_loses_only_its_own_sample(bad):
    """The bad sample sits in the middle of one batch: it scores 0 with its error, the samples before it keep
    their results, the ones after it are scored again by the restarted worker; none is lost or doubled."""
    with RewardPool(exit_on_seven, num_workers=1, timeout_s=2.0, max_batch=64) as p:
        while not p.workers[0].check_ready():
            time.sleep(0.01)
        samples = [_sample(i, "42" if i % 2 else "41") for i in range(9)]
        samples[4].response_text = bad
        scored = p.score(samples)
    assert sorted(s.sample_id for s in scored) == sorted(s.sample_id for s in samples)
    assert len(scored) == len(samples)
    by_id = {s.sample_id: s for s in scored}
    assert by_id[samples[4].sample_id].reward_error == ("timeout" if bad == "hang" else "reward worker died")
    for i, s in enumerate(samples):
        if i != 4:
            assert by_id[s.sample_id].reward == (1.0 if i % 2 else 0.0) and by_id[s.sample_id].reward_error == ""
    assert p.stats["scored"] == 9 and p.stats["timeouts" if bad == "hang" else "errors"] == 1
