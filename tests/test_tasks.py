"""Procedural tasks: determinism per seed, correct worked solutions, K&K uniqueness, wide length spread."""

from __future__ import annotations

import itertools
import random

from megatron_sortedrl.data import arithmetic, knights_knaves
from megatron_sortedrl.data.stats import length_summary, percentile
from megatron_sortedrl.rewards import arithmetic as arith_reward
from megatron_sortedrl.rewards import knights_knaves as kk_reward
from megatron_sortedrl.sample import Sample


def _sample(text: str) -> Sample:
    return Sample(prompt_id="p", index=0, response_text=text)


def test_generators_are_deterministic_per_seed():
    for gen, lo, hi in ((arithmetic.generate, 1, 6), (knights_knaves.generate, 2, 7)):
        assert gen(40, 7, lo, hi) == gen(40, 7, lo, hi)
        assert [p.text for p in gen(40, 7, lo, hi)] != [p.text for p in gen(40, 8, lo, hi)]


def test_arithmetic_solutions_are_correct_and_rewarded():
    for p in arithmetic.generate(300, 3, 1, 8):
        operands = [int(x) for x in p.text.strip().rstrip("=").split("+")]
        assert int(p.ground_truth) == sum(operands)
        assert len(str(operands[0])) == p.difficulty
        # the scratchpad's column sums reproduce the answer digit by digit
        lines = p.solution.splitlines()
        digits = [int(line.split("=")[1]) % 10 for line in lines[:-1]]
        carry = int(lines[-2].split("=")[1]) // 10
        assert int((str(carry) if carry else "") + "".join(map(str, reversed(digits)))) == sum(operands)
        assert arith_reward.reward(_sample(p.solution), p.ground_truth) == 1.0


def test_arithmetic_length_spread_grows_with_difficulty():
    prompts = arithmetic.generate(2000, 0, 1, 8)
    summary = length_summary(prompts)
    assert summary["solution_max_over_median"] >= 4
    by_level = {d: [len(p.solution) for p in prompts if p.difficulty == d] for d in range(1, 9)}
    medians = [percentile(v, 50) for v in by_level.values()]
    assert medians == sorted(medians) and medians[-1] >= 6 * medians[0]
    # weight 1/d: easy prompts are the majority, hard ones the tail
    assert len(by_level[1]) > 3 * len(by_level[8])


def test_knights_knaves_unique_solution_by_brute_force():
    rng = random.Random(0)
    for n in range(2, 8):
        for _ in range(5):
            names, statements, truth = knights_knaves.make_puzzle(rng, n)
            consistent = [
                a for a in itertools.product((False, True), repeat=n)
                if all(a[i] == s.holds(a) for i, s in enumerate(statements))
            ]
            assert consistent == [truth]


def test_knights_knaves_solutions_rewarded_and_length_grows():
    prompts = knights_knaves.generate(120, 5, 2, 7)
    assert {p.difficulty for p in prompts} == set(range(2, 8))
    for p in prompts:
        assert kk_reward.reward(_sample(p.solution), p.ground_truth) == 1.0
        assert p.text.count(" says: ") == p.difficulty
    short = [len(p.solution) for p in prompts if p.difficulty == 2]
    long = [len(p.solution) for p in prompts if p.difficulty == 7]
    assert percentile(long, 50) > 2.5 * percentile(short, 50)
