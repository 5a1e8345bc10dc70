"""How every config schema of the project declares a field (`help_field`), and what the sections share."""

from __future__ import annotations

from pathlib import Path

from megatron_sortedrl.schema import help_field  # noqa: F401  (declared beside the checks; handed on here)


DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "tiny_cpu.yaml"


TASKS = ("arithmetic", "long_addition", "column_addition", "knights_knaves", "code", "tool_multiplication", "file")
# Tasks whose warm-start solutions trainer.warmup_answer_only_share can cut to a `#### <answer>` line.
ANSWER_LINE_TASKS = ("arithmetic", "long_addition", "column_addition", "tool_multiplication")
