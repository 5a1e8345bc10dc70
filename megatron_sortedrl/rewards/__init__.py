"""Reward functions: `def reward(sample, ground_truth) -> float`, referenced by dotted path.

    data.reward_fn=megatron_sortedrl.rewards.arithmetic.reward        # or your_pkg.module.function

The signature is the whole extension point: `sample` is a `megatron_sortedrl.sample.Sample` whose
`response_text` holds the decoded response (tokens, prompt id and metadata are there too), `ground_truth`
is the dataset's answer string; the function returns a float (1.0 correct, 0.0 wrong is the convention of
the built-ins). It runs in a reward worker process; an exception or a timeout gives reward 0 and is
counted and logged with the sample id by the driver, so a buggy reward never stops a run.
"""

from __future__ import annotations

import importlib
from typing import Callable

from megatron_sortedrl.errors import ConfigError

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
    """Imports `package.module.function`; a bad path is a config error naming data.reward_fn."""
    module_name, _, attr = dotted.rpartition(".")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError("data.reward_fn", dotted, f"an importable module path (import failed: {exc})") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ConfigError("data.reward_fn", dotted, f"a function named '{attr}' in module '{module_name}'")
    check_signature(fn, "data.reward_fn", dotted)
    return fn


def check_signature(fn: RewardFn, key: str, shown: object) -> None:
    """A reward must accept `(sample, ground_truth)`; checked when the run starts, not when the first sample
    is scored. Callables without an inspectable signature (some C functions) are let through."""
    import inspect

    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return
    try:
        sig.bind(None, None)
    except TypeError:
        raise ConfigError(key, shown, f"a function taking (sample, ground_truth); it takes {sig}") from None
