"""Length statistics of a prompt set: how widely worked-solution lengths vary (the long tail we schedule).

    python -m megatron_sortedrl data configs/tiny_cpu.yaml data.max_difficulty=8
"""

from __future__ import annotations

from collections import Counter

from megatron_sortedrl.sample import Prompt


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]) of a non-empty list."""
    ordered = sorted(values)
    rank = max(1, min(len(ordered), round(q / 100 * len(ordered) + 0.5)))
    return float(ordered[rank - 1])


def length_summary(prompts: list[Prompt], tokenize=len) -> dict:
    """Prompt and solution length percentiles (in tokens of `tokenize`, characters by default) and difficulties."""
    sol = [tokenize(p.solution) for p in prompts if p.solution]
    prm = [tokenize(p.text) for p in prompts]
    out = {
        "num_prompts": len(prompts),
        "difficulty_counts": dict(sorted(Counter(p.difficulty for p in prompts).items())),
        "prompt_length": {q: percentile(prm, q) for q in (0, 50, 100)} if prm else {},
    }
    if sol:
        out["solution_length"] = {q: percentile(sol, q) for q in (0, 10, 50, 90, 99, 100)}
        out["solution_max_over_median"] = out["solution_length"][100] / max(1.0, out["solution_length"][50])
    return out
