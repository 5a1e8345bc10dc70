"""Reward functions: `def reward(sample, ground_truth) -> float`, referenced by dotted path.

    data.reward_fn=megatron_sortedrl.rewards.arithmetic.reward        # or your_pkg.module.function

The signature is the whole extension point: `sample` is a `megatron_sortedrl.sample.Sample` whose
`response_text` holds the decoded response (tokens, prompt id and metadata are there too), `ground_truth`
is the dataset's answer string; the function returns a float (1.0 correct, 0.0 wrong is the convention of
the built-ins). It runs in a reward worker process; an exception or a timeout gives reward 0 and is
counted and logged with the sample id by the driver, so a buggy reward never stops a run.
"""

from __future__ import annotations

from typing import Callable

from megatron_sortedrl.errors import ConfigError, import_dotted
from megatron_sortedrl.errors import check_signature as check_args

RewardFn = Callable[..., float]

DEFAULT_REWARD = {
    "arithmetic": "megatron_sortedrl.rewards.arithmetic.reward",
    "long_addition": "megatron_sortedrl.rewards.arithmetic.reward",
    "column_addition": "megatron_sortedrl.rewards.column_addition.reward",
    "knights_knaves": "megatron_sortedrl.rewards.knights_knaves.reward",
    "code": "megatron_sortedrl.rewards.code.reward",
    "tool_multiplication": "megatron_sortedrl.rewards.tool_answer.reward",
    "file": "megatron_sortedrl.rewards.math.reward",
}


def reward_path(data_cfg) -> str:
    """The configured reward function's dotted path, or the task's default."""
    return data_cfg.reward_fn or DEFAULT_REWARD[data_cfg.task]


def load_reward_fn(dotted: str) -> RewardFn:
    """Imports `package.module.function`; a bad path (one that does not import, names nothing callable, or a
    function with another signature) is a config error naming data.reward_fn."""
    module_name, _, attr = dotted.rpartition(".")
    named = f"a function named '{attr}' in module '{module_name}'"
    fn = import_dotted("data.reward_fn", dotted, "an importable module path", missing=named)
    if not callable(fn):
        raise ConfigError("data.reward_fn", dotted, named)
    check_signature(fn, "data.reward_fn", dotted)
    return fn


def check_signature(fn: RewardFn, key: str, shown: object) -> None:
    """A reward must accept `(sample, ground_truth)`; checked when the run starts, not when the first sample
    is scored."""
    check_args(fn, key, shown, "sample, ground_truth")
