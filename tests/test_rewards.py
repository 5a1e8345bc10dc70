"""Reward functions on right, wrong and malformed answers, and loading them by dotted path."""

from __future__ import annotations

import pytest

from megatron_sortedrl.config import load_config
from megatron_sortedrl.errors import ConfigError
from megatron_sortedrl.rewards import arithmetic, knights_knaves, load_reward_fn, math, reward_path
from megatron_sortedrl.sample import Sample


def _s(text: str) -> Sample:
    return Sample(prompt_id="p", index=0, response_text=text)


@pytest.mark.parametrize(
    "text, truth, expected",
    [
        ("0+7+8=15\n1+5+6=12\n#### 125", "125", 1.0),
        ("#### 0125", "125", 1.0),  # leading zeros are the same integer
        ("#### -3", "-3", 1.0),
        ("#### 124", "125", 0.0),  # wrong
        ("0+7+8=15\n125", "125", 0.0),  # malformed: no answer mark
        ("#### 125 apples", "125", 0.0),  # malformed: trailing text
        ("#### 12 then #### 125", "125", 1.0),  # the last mark counts
        ("", "125", 0.0),
    ],
)
def test_arithmetic(text, truth, expected):
    assert arithmetic.reward(_s(text), truth) == expected


TRUTH = "(1) Zoey is a knight\n(2) Oliver is a knave"


@pytest.mark.parametrize(
    "text, expected",
    [
        ("reasoning...\n<answer>(1) Zoey is a knight\n(2) Oliver is a knave</answer>", 1.0),
        ("<answer>Oliver is a knave, Zoey is a knight</answer>", 1.0),  # order and layout do not matter
        ("<answer>(1) Zoey is a knave\n(2) Oliver is a knave</answer>", 0.0),  # wrong
        ("<answer>(1) Zoey is a knight</answer>", 0.0),  # incomplete
        ("<answer>Zoey is a knight, Zoey is a knave, Oliver is a knave</answer>", 0.0),  # contradictory
        ("(1) Zoey is a knight\n(2) Oliver is a knave", 0.0),  # malformed: no answer block
        ("<answer>(1) Zoey is a knight (2) Oliver is a knave (3) Mia is a knight</answer>", 0.0),  # extra person
    ],
)
def test_knights_knaves(text, expected):
    assert knights_knaves.reward(_s(text), TRUTH) == expected


@pytest.mark.parametrize(
    "text, truth, expected",
    [
        ("The answer is $\\boxed{\\frac{1}{2}}$", "0.5", 1.0),
        ("so we get \\boxed{42}", "42", 1.0),
        ("\\boxed{41}", "42", 0.0),
        ("I do not know", "42", 0.0),
        ("\\boxed{x^2+2x+1}", "(x+1)^2", 1.0),
    ],
)
def test_math_verify(text, truth, expected):
    assert math.reward(_s(text), truth) == expected


def test_reward_path_defaults_and_loading():
    cfg = load_config()
    assert reward_path(cfg.data) == "megatron_sortedrl.rewards.arithmetic.reward"
    assert load_reward_fn(reward_path(cfg.data)) is arithmetic.reward
    with pytest.raises(ConfigError, match="data.reward_fn.*import failed"):
        load_reward_fn("no_such_package.rewards.score")
    with pytest.raises(ConfigError, match="a function named 'nope'"):
        load_reward_fn("megatron_sortedrl.rewards.arithmetic.nope")
    with pytest.raises(ConfigError, match="data.reward_fn"):
        load_config(None, ["data.reward_fn=not a path"])
