"""The long-tail preset's task: deterministic, correct and rewarded solutions, length set by the digit count,
and rounds whose longest response is at least 10x the median (the property the preset promises)."""

from __future__ import annotations

from helpers import round_tail_ratios

from megatron_sortedrl.config import load_config
from megatron_sortedrl.data import load_prompts, long_addition
from megatron_sortedrl.rewards import arithmetic as arith_reward
from megatron_sortedrl.rewards import reward_path
from megatron_sortedrl.sample import Sample


def test_deterministic_correct_and_rewarded():
    prompts = long_addition.generate(200, 5, 1, 48)
    assert prompts == long_addition.generate(200, 5, 1, 48)
    assert [p.text for p in prompts] != [p.text for p in long_addition.generate(200, 6, 1, 48)]
    for p in prompts:
        a, b = (int(x) for x in p.text.strip().rstrip("=").split("+"))
        assert len(str(a)) == len(str(b)) == p.difficulty and 1 <= p.difficulty <= 48
        assert int(p.ground_truth) == a + b
        # one scratchpad line per column plus the answer: the length is the problem's, not the sampler's
        assert len(p.solution.splitlines()) == p.difficulty + 1
        assert arith_reward.reward(Sample(prompt_id="p", index=0, response_text=p.solution), p.ground_truth) == 1.0


def test_rounds_have_a_long_tail():
    """Rounds of 16 prompts x 4 samples (the preset's sync round) over 50 seeds: the longest solution is at
    least 10x the median in at least 80% of rounds and never over the preset's 512-token response limit."""
    ratios, longest = round_tail_ratios(long_addition.generate)
    assert sum(x >= 10 for x in ratios) / len(ratios) >= 0.8
    assert 400 <= longest <= 512


def test_preset_config_loads_the_task_and_its_reward():
    cfg = load_config("configs/longtail_cpu.yaml", ["data.task=long_addition"])  # (the preset's former task)
    assert cfg.data.task == "long_addition" and cfg.rollout.max_response_length >= 512
    assert reward_path(cfg.data) == "megatron_sortedrl.rewards.arithmetic.reward"
    prompts = load_prompts(cfg.data, "train")
    assert len(prompts) == cfg.data.num_train_prompts and {p.source for p in prompts} == {"long_addition"}
    # prompt + longest response fit the tiny model's positions
    assert max(len(p.text) for p in prompts) + cfg.rollout.max_response_length <= cfg.model.tiny.max_position_embeddings
