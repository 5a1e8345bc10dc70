"""Tier-2 placement: LPT load bound (against brute-force optimum), KV capacity, work stealing.

Hardware: CPU only. Run: .venv/bin/python -m pytest tests/test_placement.py -q
"""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_sortedrl.sample import Sample
from scheduler.placement import WorkerQueues, cost, place
from scheduler.protocol import Request


def reqs(lengths):
    return [Request(sample=Sample(prompt_id=f"p{i}", index=0), worker=0, predicted_length=float(x), max_tokens=10**6)
            for i, x in enumerate(lengths)]


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(1, 100), min_size=1, max_size=8), workers=st.integers(1, 3))
def test_lpt_within_graham_bound_of_optimum(lengths, workers):
    rs = reqs(lengths)
    loads = place(rs, workers, "lpt")
    costs = [cost(r) for r in rs]
    opt = min(max(sum(c for c, w in zip(costs, assign) if w == k) for k in range(workers))
              for assign in itertools.product(range(workers), repeat=len(costs)))
    assert max(loads) <= (4 / 3 - 1 / (3 * workers)) * opt + 1e-9
    assert sorted(loads) == sorted(sum(cost(r) for r in rs if r.worker == k) for k in range(workers))


@settings(max_examples=40, deadline=None)
@given(lengths=st.lists(st.integers(1, 40_000), min_size=1, max_size=300), workers=st.integers(1, 64))
def test_lpt_list_scheduling_bound_at_scale(lengths, workers):
    rs = reqs(lengths)
    loads = place(rs, workers, "lpt")
    costs = [cost(r) for r in rs]
    assert max(loads) <= sum(costs) / workers + max(costs) * (1 - 1 / workers) + 1e-6


def test_kv_capacity_keeps_big_requests_on_engines_that_hold_them():
    rs = reqs([5000, 10, 10, 10])
    place(rs, 2, "lpt", kv_capacity=[1000, 100_000])
    assert rs[0].worker == 1


def test_round_robin_ignores_predictions():
    rs = reqs([100, 1, 1, 1])
    place(rs, 2, "round_robin")
    assert [r.worker for r in rs] == [0, 1, 0, 1]


def test_idle_worker_steals_longest_queued_request_of_most_loaded_worker():
    rs = reqs([50, 40, 30, 5])
    for r, w in zip(rs, [0, 0, 0, 1]):
        r.worker = w
    q = WorkerQueues(2)
    q.add(rs)
    assert q.pop(1).sample.prompt_id == "p3"  # its own first
    stolen = q.pop(1)
    assert stolen.sample.prompt_id == "p0" and stolen.worker == 1 and q.moves == 1
    assert q.pop(1, steal=False) is None
    assert q.queued_load(0) == cost(rs[1]) + cost(rs[2])
    assert q.remove(rs[2].sample.sample_id) is rs[2] and len(q) == 1
