"""Math reward with `math-verify`: the response's final answer (e.g. `\\boxed{...}`) must equal the truth.

`math_verify.parse` extracts LaTeX or plain expressions; `verify` compares them symbolically, so `1/2`,
`0.5` and `\\frac{1}{2}` match. A response it cannot parse scores 0.
"""

from __future__ import annotations


def reward(sample, ground_truth: str) -> float:
    from math_verify import parse, verify

    gold = parse(ground_truth if "$" in ground_truth or "\\" in ground_truth else f"${ground_truth}$")
    answer = parse(sample.response_text)
    if not gold or not answer:
        return 0.0
    return 1.0 if verify(gold, answer) else 0.0
