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


def import_dotted(key: str, ref: str, allowed: str, missing: str = "") -> Any:
    """The object a dotted path `package.module.attr` names (a user's tool, parser, reward, ...); a path without a
    module, a module that does not import (for any reason: a missing dependency, a syntax error, an exception
    its top level raises), or an attribute it lacks is a `ConfigError` naming `key`, with `allowed` saying what
    fits and the reason in brackets (`missing`, if given, is what to say instead for a missing attribute)."""
    module_name, _, attr = ref.rpartition(".")
    if not module_name:
        raise ConfigError(key, ref, allowed)
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(key, ref, f"{allowed} (import failed: {exc})") from None
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - the user's module failing at import: one line
        raise ConfigError(key, ref, f"{allowed} (import of module '{module_name}' failed: "
                                    f"{exception_line(exc)})") from None
    obj = getattr(module, attr, None)
    if obj is None:
        raise ConfigError(key, ref, missing or f"{allowed} (module '{module_name}' has no '{attr}')")
    return obj


def exception_line(exc: BaseException) -> str:
    """`Type: message (file:line)` of an exception raised in a user's code: where it was raised (a syntax
    error: the offending line of the file), so the one line says what to fix."""
    import traceback

    if isinstance(exc, SyntaxError) and exc.filename:
        where = f"{exc.filename}:{exc.lineno}"
        text = exc.msg
    else:
        frames = traceback.extract_tb(exc.__traceback__)
        where = f"{frames[-1].filename}:{frames[-1].lineno}" if frames else ""
        text = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {text}" + (f" ({where})" if where else "")


def check_signature(fn: Any, key: str, shown: object, params: str, role: str = "a function taking") -> None:
    """`fn` must accept the positional arguments `params` names ("sample, ground_truth"), as the system will
    call it; else a ConfigError naming `key`, the expected signature and the one found. Checked before a run
    starts, not at the first call. Callables without an inspectable signature (some C functions) pass."""
    import inspect

    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return
    names = [p.strip() for p in params.split(",") if p.strip()]
    try:
        sig.bind(*[None] * len(names))
    except TypeError:
        bare = sig.replace(parameters=[p.replace(annotation=p.empty) for p in sig.parameters.values()],
                           return_annotation=sig.empty)  # the names and defaults are what matter here
        raise ConfigError(key, shown, f"{role} ({', '.join(names)}); it takes {bare}") from None
