"""Labelled-column binary addition: a long-tail task (`data.task=column_addition`) a tiny model learns.

    from megatron_sortedrl.data.column_addition import generate, solve, answer_of
    prompts = generate(num=96, seed=0, min_difficulty=1, max_difficulty=48)

Two binary numbers of d digits each are added column by column. The prompt lists the columns, least
significant first, each under its own letter label (`a`, `b`, ..., `z`, `A`, ..., `Z`, so d <= 52), and the
response writes one 10-character line per column, `{label}{x}+{y}+{carry in}={carry out}{digit}`:

    prompt   "a1+1,b0+1,c1+1=\\n"                          (x = 101, y = 111, least significant first)
    response "a1+1+0=10\\nb0+1+1=10\\nc1+1+1=11\\n"           (x + y = 1100)

The answer is read from the lines (`answer_of`): the result digits, last column first, after the last carry
out; `megatron_sortedrl.rewards.column_addition` scores it against the ground truth (the sum, in binary).
A response of difficulty d is 10 d tokens for the built-in character-level model, plus the end-of-text
token: its length is decided by the problem, not by padding or a length cap.

Why this format (`long_addition`, the numbers written out in decimal with a right-to-left scratchpad, is still
the long-tail preset's task, but a 2-layer model does not learn it in a CPU warm start): every token of a line is a local
function of text the model finds by content or at a fixed offset. The label is the successor of the label
one line up; the two operand digits are copied from the prompt's column under that label (an induction-head
lookup by a unique key, instead of counting positions in a long number); the carry in is the carry out one
line up; and the sum of three binary digits is an 8-entry table (a decimal column is a 200-entry one: in
the measured warm starts the decimal sums were what the model learned last). Errors still compound over
columns, so long problems are solved less often than short ones, which leaves RL something to learn.

The digit count is drawn as in `long_addition`, with a wider short range: with probability `SHORT_SHARE` d is
uniform in min..min+2 (`SHORT_SPAN`; one to three digits: one or two binary digits leave only 5 distinct
problems, three give 21; four would give 85 but put the round median at 31 tokens and the longest response
under 10x it in a quarter of the rounds), otherwise uniform in min+3..max. With difficulties 1..48, rounds of
16 prompts x 4 samples have a median response of 21-31 tokens and a longest one about 15x that (10x or more
in 88% of rounds; `tests/test_column_addition.py`), up to 481 tokens.

Left out: other bases as an option (binary is the learnable one; decimal is `long_addition`) and any
curriculum (the distribution is fixed; the scheduler, not the data, must cope with the tail).
"""

from __future__ import annotations

import random
import re

from megatron_sortedrl.data.long_addition import SHORT_SHARE, draw_digits
from megatron_sortedrl.sample import Prompt

__all__ = ["LABELS", "MAX_DIGITS", "SHORT_SHARE", "SHORT_SPAN", "answer_of", "generate", "prompt_text", "solve"]

SHORT_SPAN = 3  # short problems have min..min+2 digits: 21 distinct binary problems of 1-3 digits, not 5 of 1-2
LABELS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"  # one per column: at most 52 digits
MAX_DIGITS = len(LABELS)
_LINE = re.compile(r"[A-Za-z]([01])\+([01])\+([01])=([01])([01])")


def _columns(x: str, y: str) -> list[tuple[str, str]]:
    """(x digit, y digit) per column, least significant first, of two equally long binary strings."""
    if len(x) != len(y) or len(x) > MAX_DIGITS or set(x + y) - {"0", "1"}:
        raise ValueError(f"need two binary numbers of equal length <= {MAX_DIGITS} digits, got {x!r}, {y!r}")
    return list(zip(reversed(x), reversed(y)))


def prompt_text(x: str, y: str) -> str:
    """The prompt of x + y (binary strings of equal length): labelled columns, least significant first."""
    return ",".join(f"{LABELS[k]}{a}+{b}" for k, (a, b) in enumerate(_columns(x, y))) + "=\n"


def solve(x: str, y: str) -> str:
    """The worked solution of x + y: one line per column, least significant first, every carry written out."""
    carry, lines = 0, []
    for k, (a, b) in enumerate(_columns(x, y)):
        s = int(a) + int(b) + carry
        lines.append(f"{LABELS[k]}{a}+{b}+{carry}={s // 2}{s % 2}\n")
        carry = s // 2
    return "".join(lines)


def answer_of(response: str) -> str | None:
    """The binary sum a response states: its lines' result digits, last column first, after the last carry
    out, without leading zeros. None when a non-empty line is not a column line, or there is none."""
    digits, carry = [], ""
    for line in response.split("\n"):
        if not line.strip():
            continue
        m = _LINE.fullmatch(line.strip())
        if m is None:
            return None
        digits.append(m.group(5))
        carry = m.group(4)
    if not digits:
        return None
    return (carry + "".join(reversed(digits))).lstrip("0") or "0"


def generate(num: int, seed: int, min_difficulty: int, max_difficulty: int,
             id_prefix: str = "column_addition") -> list[Prompt]:
    """`num` prompts; the same seed always gives the same prompts (ids, text, answers)."""
    if max_difficulty > MAX_DIGITS:
        raise ValueError(f"column_addition labels at most {MAX_DIGITS} columns; got max_difficulty={max_difficulty}")
    rng = random.Random(seed)
    prompts = []
    for i in range(num):
        d = draw_digits(rng, min_difficulty, max_difficulty, short_span=SHORT_SPAN)
        # d binary digits each, the leading one 1 (no leading zero)
        x, y = ("1" + "".join(rng.choice("01") for _ in range(d - 1)) for _ in range(2))
        prompts.append(Prompt(
            prompt_id=f"{id_prefix}-{seed}-{i}",
            text=prompt_text(x, y),
            ground_truth=format(int(x, 2) + int(y, 2), "b"),
            source="column_addition",
            difficulty=d,
            solution=solve(x, y),
        ))
    return prompts
