"""Long-tail column addition: the task of the long-tail preset (`configs/longtail_cpu.yaml`).

    from megatron_sortedrl.data.long_addition import generate
    prompts = generate(num=96, seed=0, min_difficulty=1, max_difficulty=48)

Two numbers of d digits each are added column by column with the carry written out, in the scratchpad
format of `arithmetic.py` (one line `carry+digit+digit=column_sum` per column, right to left, then
`#### <answer>`), so a response of difficulty d is about 9.5 d + 6 characters (= tokens for the built-in
character-level model) and its length is decided by the problem, not by padding or a length cap.

The digit count is drawn so that most problems are short and a few are very long, like long chain-of-thought
RL, where the longest response of a batch is tens of times the median: with probability `SHORT_SHARE` d is
uniform in min..min+1 (one or two digits), otherwise uniform in min+2..`max_difficulty`. With difficulties
1..48, rounds of 16 prompts x 4 have a median response of about 20 tokens and a longest one 10-25x that
(10x or more in nine rounds out of ten; the mean response is about 90 tokens).

Left out: more than two operands (the arithmetic task has them; here the length should follow d alone) and
any curriculum (the distribution is fixed; the scheduler, not the data, must cope with the tail).
"""

from __future__ import annotations

import random

from megatron_sortedrl.data.arithmetic import scratchpad
from megatron_sortedrl.sample import Prompt

SHORT_SHARE = 0.7  # share of one- or two-digit problems: they set the median


def draw_digits(rng: random.Random, min_difficulty: int, max_difficulty: int, short_span: int = 2) -> int:
    """The digit count of one problem: with probability SHORT_SHARE uniform over the `short_span` shortest
    counts, else uniform over the rest up to the max."""
    short_top = min(max_difficulty, min_difficulty + short_span - 1)
    if rng.random() < SHORT_SHARE or short_top == max_difficulty:
        return rng.randint(min_difficulty, short_top)
    return rng.randint(short_top + 1, max_difficulty)


def generate(num: int, seed: int, min_difficulty: int, max_difficulty: int,
             id_prefix: str = "long_addition") -> list[Prompt]:
    """`num` prompts; the same seed always gives the same prompts (ids, text, answers)."""
    rng = random.Random(seed)
    prompts = []
    for i in range(num):
        d = draw_digits(rng, min_difficulty, max_difficulty)
        operands = [rng.randint(10 ** (d - 1), 10**d - 1) for _ in range(2)]
        prompts.append(Prompt(
            prompt_id=f"{id_prefix}-{seed}-{i}",
            text="+".join(map(str, operands)) + "=\n",
            ground_truth=str(sum(operands)),
            source="long_addition",
            difficulty=d,
            solution=scratchpad(operands),
        ))
    return prompts
