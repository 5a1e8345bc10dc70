"""Exact-answer reward for labelled-column binary addition (`data.task=column_addition`).

The answer is read from the response's column lines (`megatron_sortedrl.data.column_addition.answer_of`:
the result digits, last column first, after the last carry out) and must equal the ground truth (the binary
sum). A response with any other non-empty line, or none, scores 0 (malformed); so does one cut mid-line by
the length limit. A line with a wrong sum or a wrong copied digit gives a wrong result digit or carry, so the
reward stays exact without re-checking each line against the prompt.
"""

from __future__ import annotations

from megatron_sortedrl.data.column_addition import answer_of


def reward(sample, ground_truth: str) -> float:
    answer = answer_of(sample.response_text)
    return 1.0 if answer is not None and answer == (ground_truth.strip().lstrip("0") or "0") else 0.0
