"""Multi-digit addition with a column-by-column scratchpad: the built-in default task.

    from megatron_sortedrl.data.arithmetic import generate
    prompts = generate(num=256, seed=0, min_difficulty=1, max_difficulty=4)

A prompt of difficulty d adds 2..max(2, d) numbers, the first with exactly d digits and the others with
1..d, so the worked solution grows roughly with d squared: one scratchpad line per column,
`carry+digit+digit...=column_sum`, right to left, then `#### <answer>`. Difficulties are drawn with
weight 1/d, so most prompts are short and a few are long: the long tail the scheduler exists for.
Example for `57+68=`:

    0+7+8=15
    1+5+6=12
    #### 125

Deliberately simple: a character-level model of a few hundred thousand parameters learns the format in
a short supervised warm start, and RL then has room to raise accuracy on the long prompts.
"""

from __future__ import annotations

import random

from megatron_sortedrl.sample import Prompt

ANSWER_MARK = "####"


def make_problem(rng: random.Random, difficulty: int) -> tuple[list[int], str]:
    """Returns (operands, worked solution) for one problem of the given difficulty."""
    n_operands = rng.randint(2, max(2, difficulty))
    digits = [difficulty] + [rng.randint(1, difficulty) for _ in range(n_operands - 1)]
    operands = [rng.randint(10 ** (d - 1), 10**d - 1) for d in digits]
    return operands, scratchpad(operands)


def scratchpad(operands: list[int]) -> str:
    """The worked solution: one line per column (carry first), then the answer after `####`."""
    width = max(len(str(x)) for x in operands)
    lines, carry = [], 0
    for col in range(width):
        column = [int(str(x)[::-1][col]) for x in operands if col < len(str(x))]
        total = carry + sum(column)
        lines.append("+".join(str(v) for v in [carry, *column]) + f"={total}")
        carry = total // 10
    lines.append(f"{ANSWER_MARK} {sum(operands)}")
    return "\n".join(lines)


def generate(num: int, seed: int, min_difficulty: int, max_difficulty: int, id_prefix: str = "arith") -> list[Prompt]:
    """`num` prompts; the same seed always gives the same prompts (ids, text, answers)."""
    rng = random.Random(seed)
    prompts = []
    levels = list(range(min_difficulty, max_difficulty + 1))
    weights = [1.0 / d for d in levels]
    for i in range(num):
        difficulty = rng.choices(levels, weights)[0]
        operands, solution = make_problem(rng, difficulty)
        prompts.append(Prompt(
            prompt_id=f"{id_prefix}-{seed}-{i}",
            text="+".join(map(str, operands)) + "=\n",
            ground_truth=str(sum(operands)),
            source="arithmetic",
            difficulty=difficulty,
            solution=solution,
        ))
    return prompts
