"""Two-sample chi-squared test for "these two samplers draw from the same distribution" (no scipy).

    from speculative.chi2 import chi2_two_sample
    stat, dof, p = chi2_two_sample(samples_a, samples_b)     # samples: hashable outcomes (token tuples)

Outcomes are the categories; categories whose expected count is below `min_expected` in either sample
are pooled into one "other" cell (the chi-squared approximation needs expected counts of about 5).
The p-value is the upper tail of the chi-squared distribution, `Q(dof/2, stat/2)`, computed with
`torch.special.gammaincc`. Used by the lossless tests of HistoSpec at temperature 1.

Left out: exact tests for tiny samples (use more samples instead).
"""

from __future__ import annotations

from collections import Counter
from typing import Hashable, Iterable


def chi2_sf(stat: float, dof: int) -> float:
    import torch

    if dof <= 0:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64),
                                         torch.tensor(stat / 2.0, dtype=torch.float64)))


def chi2_two_sample(a: Iterable[Hashable], b: Iterable[Hashable],
                    min_expected: float = 5.0) -> tuple[float, int, float]:
    """Returns (statistic, degrees of freedom, p-value) of the 2 x K contingency test."""
    ca, cb = Counter(a), Counter(b)
    na, nb = sum(ca.values()), sum(cb.values())
    if not na or not nb:
        raise ValueError("both samples must be non-empty")
    cells: list[tuple[int, int]] = []
    other_a = other_b = 0
    for cat in set(ca) | set(cb):
        oa, ob = ca.get(cat, 0), cb.get(cat, 0)
        tot = oa + ob
        if min(tot * na, tot * nb) / (na + nb) < min_expected:
            other_a, other_b = other_a + oa, other_b + ob
        else:
            cells.append((oa, ob))
    if other_a + other_b:
        cells.append((other_a, other_b))
    stat = 0.0
    for oa, ob in cells:
        tot = oa + ob
        ea, eb = tot * na / (na + nb), tot * nb / (na + nb)
        stat += (oa - ea) ** 2 / ea + (ob - eb) ** 2 / eb
    dof = len(cells) - 1
    return stat, dof, chi2_sf(stat, dof)
