"""Knights-and-Knaves reward: parse `<answer>(1) Name is a knight ...</answer>` and compare to the truth.

Correct means every inhabitant of the ground truth is named with the right kind and nobody is named
twice with different kinds. No `<answer>` block, or an inhabitant missing, scores 0.
"""

from __future__ import annotations

import re

_LINE = re.compile(r"\b([A-Z][a-z]+) is an? (knight|knave)\b")


def parse_assignment(text: str) -> dict[str, str] | None:
    """{name: kind} from the last <answer> block, or None when there is no block or it is contradictory."""
    blocks = re.findall(r"<answer>(.*?)</answer>", text, flags=re.S)
    if not blocks:
        return None
    out: dict[str, str] = {}
    for name, kind in _LINE.findall(blocks[-1]):
        if out.setdefault(name, kind) != kind:
            return None
    return out


def reward(sample, ground_truth: str) -> float:
    truth = dict(_LINE.findall(ground_truth))
    answer = parse_assignment(sample.response_text)
    return 1.0 if answer is not None and truth and answer == truth else 0.0
