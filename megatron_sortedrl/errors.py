"""User-facing errors: each carries one readable line naming the problem and what to do.

The command line prints `str(error)` for these and exits non-zero without a traceback; anything else is
a bug and keeps its traceback.
"""

from __future__ import annotations

import importlib
from typing import Any


class UserError(Exception):
    """A problem in the user's input (config, data, checkpoint, reward function), not in our code."""


class ConfigError(UserError):
    """A config key has a bad value, is unknown, or contradicts another key."""

    def __init__(self, key: str, value: object, allowed: str) -> None:
        self.key, self.value, self.allowed = key, value, allowed
        super().__init__(f"config error: {key}={value!r} is not allowed; expected {allowed}")

    @classmethod
    def unknown_key(cls, key: str, allowed: str) -> ConfigError:
        err = cls(key, None, allowed)
        err.args = (f"config error: unknown key {key}; allowed here: {allowed}",)
        return err


class DatasetError(UserError):
    """A dataset file is missing or one of its rows is malformed (message names file and row)."""


class CheckpointError(UserError):
    """A checkpoint is missing, truncated or does not fit the model."""


class ClusterError(UserError):
    """The Ray cluster cannot host the layout (too few nodes or GPUs, a group split across nodes, a start-up
    step past `cluster.startup_timeout_s`); the message names what is missing and which nodes are visible."""


def import_dotted(key: str, ref: str, allowed: str) -> Any:
    """The object a dotted path `package.module.attr` names (a user's tool, parser, ...); a path without a
    module, a module that does not import, or an attribute it lacks is a `ConfigError` naming `key`, with
    `allowed` saying what fits and the reason in brackets."""
    module_name, _, attr = ref.rpartition(".")
    if not module_name:
        raise ConfigError(key, ref, allowed)
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(key, ref, f"{allowed} (import failed: {exc})") from None
    obj = getattr(module, attr, None)
    if obj is None:
        raise ConfigError(key, ref, f"{allowed} (module '{module_name}' has no '{attr}')")
    return obj
