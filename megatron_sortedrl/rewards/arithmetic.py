"""Exact-answer reward for the arithmetic task: the integer after the last `####` must equal the truth.

A response without `####`, or with something other than an integer after it, scores 0 (malformed).
"""

from __future__ import annotations

import re

_ANSWER = re.compile(r"####\s*(-?\d+)\s*$")


def extract_answer(text: str) -> str | None:
    """The integer after the last `####` (must end the response, up to whitespace), else None."""
    tail = text.rsplit("####", 1)
    if len(tail) < 2:
        return None
    match = _ANSWER.search("####" + tail[1])
    return match.group(1).lstrip("0") or "0" if match else None


def reward(sample, ground_truth: str) -> float:
    answer = extract_answer(sample.response_text)
    return 1.0 if answer is not None and answer == (ground_truth.strip().lstrip("0") or "0") else 0.0
