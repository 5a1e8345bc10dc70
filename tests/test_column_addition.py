"""Labelled-column binary addition (`data.task=column_addition`): golden worked examples and their reward,
deterministic generation, lengths set by the digit count, rounds whose longest response is at least 10x the
median, and the long-tail preset run with it (task, reward, fresh warm-start problems)."""

from __future__ import annotations

import pytest
from helpers import round_tail_ratios

from megatron_sortedrl.config import load_config
from megatron_sortedrl.data import column_addition as ca
from megatron_sortedrl.data import load_prompts
from megatron_sortedrl.errors import ConfigError
from megatron_sortedrl.rewards import column_addition as ca_reward
from megatron_sortedrl.rewards import reward_path
from megatron_sortedrl.sample import Sample
from megatron_sortedrl.warmup import sft_problems


def _score(text: str, truth: str) -> float:
    return ca_reward.reward(Sample(prompt_id="p", index=0, response_text=text), truth)


def test_golden_example():
    # 101 + 111 = 1100 (5 + 7 = 12): columns least significant first, every carry written out
    assert ca.prompt_text("101", "111") == "a1+1,b0+1,c1+1=\n"
    assert ca.solve("101", "111") == "a1+1+0=10\nb0+1+1=10\nc1+1+1=11\n"
    assert ca.answer_of("a1+1+0=10\nb0+1+1=10\nc1+1+1=11\n") == "1100"
    assert ca.answer_of("a1+0+0=01\n") == "1"
    with pytest.raises(ValueError):
        ca.prompt_text("12", "11")  # not binary


def test_reward_on_golden_and_wrong_responses():
    sol = ca.solve("101", "111")
    assert _score(sol, "1100") == 1.0
    assert _score(sol.rstrip("\n"), "1100") == 1.0  # ended by end-of-text right after its last digit
    assert _score(sol.replace("c1+1+1=11", "c1+1+1=10"), "1100") == 0.0  # a wrong carry out
    assert _score(sol.replace("b0+1+1=10", "b0+1+1=11"), "1100") == 0.0  # a wrong digit
    assert _score("a1+1+0=10\nb0+1+1=10\n", "1100") == 0.0  # a column missing
    assert _score(sol + "#### 1100", "1100") == 0.0  # any other line is malformed
    assert _score("", "1100") == 0.0
    assert _score("a1+1+0=10\nb0+1+1=10\nc1+1+1=1", "1100") == 0.0  # cut mid-line (length limit)


def test_deterministic_correct_and_rewarded():
    prompts = ca.generate(200, 5, 1, 48)
    assert prompts == ca.generate(200, 5, 1, 48)
    assert [p.text for p in prompts] != [p.text for p in ca.generate(200, 6, 1, 48)]
    for p in prompts:
        cols = p.text.strip().rstrip("=").split(",")
        assert len(cols) == p.difficulty and 1 <= p.difficulty <= 48
        assert [c[0] for c in cols] == list(ca.LABELS[:p.difficulty])
        x = "".join(c[1] for c in reversed(cols))
        y = "".join(c[3] for c in reversed(cols))
        assert x[0] == y[0] == "1"  # d binary digits each, no leading zero
        assert p.ground_truth == format(int(x, 2) + int(y, 2), "b")
        # one 10-character line per column: the length is the problem's, not the sampler's
        assert len(p.solution.splitlines()) == p.difficulty and len(p.solution) == 10 * p.difficulty
        assert _score(p.solution, p.ground_truth) == 1.0


def test_rounds_have_a_long_tail():
    """Rounds of 16 prompts x 4 samples (the preset's sync round) over 50 seeds: the longest solution is at
    least 10x the median in at least 80% of rounds, and never over the preset's 512-token response limit."""
    ratios, longest = round_tail_ratios(ca.generate)
    assert sum(x >= 10 for x in ratios) / len(ratios) >= 0.8
    assert 400 <= longest <= 512


PRESET_KEYS: list[str] = []  # the preset's task since it replaced long_addition


def test_preset_with_the_task_loads_its_reward_and_fresh_warm_start_problems():
    cfg = load_config("configs/longtail_cpu.yaml", PRESET_KEYS)
    assert cfg.data.task == "column_addition" and cfg.rollout.max_response_length >= 512
    assert reward_path(cfg.data) == "megatron_sortedrl.rewards.column_addition.reward"
    prompts = load_prompts(cfg.data, "train")
    assert len(prompts) == cfg.data.num_train_prompts and {p.source for p in prompts} == {"column_addition"}
    # the longest prompt is within the prompt limit, and prompt + response fit the tiny model's positions
    assert max(len(p.text) for p in prompts) <= cfg.data.max_prompt_length
    assert cfg.data.max_prompt_length + cfg.rollout.max_response_length <= cfg.model.tiny.max_position_embeddings
    # the warm start trains on fresh problems, none of them an RL or held-out prompt
    pool = sft_problems(cfg, prompts)
    assert len(pool) == cfg.trainer.warmup_sft_problems > len(prompts)
    shared = {p.text for p in pool} & {p.text for p in prompts}
    # only problems of few digits may coincide (21 of 1-3 digits, 64 of 4, 256 of 5): no longer one is seen
    # before RL (a 6-digit problem is one of 1024)
    assert shared and all(p.difficulty <= 5 for p in prompts if p.text in shared)
    assert sft_problems(load_config("configs/longtail_cpu.yaml", ["trainer.warmup_sft_problems=0"]), prompts) == prompts


def test_too_many_columns_is_a_config_error():
    with pytest.raises(ConfigError, match="data.max_difficulty"):
        load_config("configs/longtail_cpu.yaml", ["data.task=column_addition", "data.max_difficulty=53"])
