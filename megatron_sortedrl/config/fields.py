"""How every config schema of the project declares a field (`help_field`), and what the sections share."""

from __future__ import annotations

from dataclasses import field
from pathlib import Path
from typing import Any

from megatron_sortedrl.schema import RANGE_KEYS


DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "tiny_cpu.yaml"


def help_field(text: str, default: Any = None, factory: Any = None, **checks: Any) -> Any:
    """A dataclass field with its one line of help (what `config --explain` prints) and its range, if any:
    `min`/`max` (inclusive), `gt`/`lt` (exclusive), `choices` (megatron_sortedrl/schema.py checks them for
    every field when a config loads). Every config schema of the project declares its fields with it."""
    unknown = set(checks) - set(RANGE_KEYS)
    if unknown:
        raise TypeError(f"help_field: unknown check {sorted(unknown)}; use {', '.join(RANGE_KEYS)}")
    meta = {"help": text, **checks}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


TASKS = ("arithmetic", "long_addition", "column_addition", "knights_knaves", "code", "tool_multiplication", "file")
# Tasks whose warm-start solutions trainer.warmup_answer_only_share can cut to a `#### <answer>` line.
ANSWER_LINE_TASKS = ("arithmetic", "long_addition", "column_addition", "tool_multiplication")
