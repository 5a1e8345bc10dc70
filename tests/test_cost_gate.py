"""The cost gate of HistoSpec (`speculative/cost_gate.py`): the online fit recovers a known step cost, the
decision is the break-even bound R < (a/b) p/(1-p), a lone row always drafts, and inside the proposer the
gate measures the tokens each engine step processed (drafts included) and switches a full batch to plain
decoding while the tail keeps drafting."""

from __future__ import annotations

import random

import numpy as np
import pytest
from test_histospec_drafter import PROMPT, RESPONSE, _SimEngine

from speculative.cost_gate import StepCostGate
from speculative.drafter import DraftSettings
from speculative.history import HistoryStore
from speculative.proposer import HistoSpecProposer


def test_fit_recovers_a_known_step_cost_under_noise():
    rng = random.Random(0)
    a, b = 3.1e-3, 0.147e-3
    gate = StepCostGate(decay=1.0)
    for _ in range(400):
        t = rng.randint(1, 800)
        gate.observe(t, (a + b * t) * rng.uniform(0.97, 1.03))
    fa, fb = gate.fit()
    assert fa == pytest.approx(a, rel=0.05) and fb == pytest.approx(b, rel=0.02)
    assert gate.ratio == pytest.approx(a / b, rel=0.06)


def test_no_fit_before_enough_steps_or_without_spread():
    gate = StepCostGate(prior_ratio=50.0, min_steps=32)
    for t in range(1, 31):
        gate.observe(t, 1e-3 + 1e-5 * t)
    assert gate.fit() is None and gate.ratio == 50.0  # too few steps: the prior
    same = StepCostGate(prior_ratio=50.0)
    for _ in range(100):
        same.observe(64, 5e-3)
    assert same.fit() is None and same.ratio == 50.0  # every step the same size: no slope to fit


@pytest.mark.parametrize("seed", range(20))
def test_decision_is_the_break_even_bound(seed):
    rng = random.Random(seed)
    a, b = rng.uniform(1e-4, 1e-2), rng.uniform(1e-6, 1e-3)
    p = rng.uniform(0.05, 0.95)
    gate = StepCostGate(decay=1.0, acceptance_decay=1.0)
    for t in range(1, 200, 3):
        gate.observe(t, a + b * t)
    gate.observe_acceptance(verified=1e6, accepted=1e6 * p)  # outweighs the prior
    bound = (a / b) * p / (1 - p)
    assert gate.max_rows() == pytest.approx(bound, rel=1e-3)
    # the cost per generated token with and without drafts, for D draft tokens in the step
    for rows in {1, 2, max(1, int(bound * 0.9)), int(bound * 1.1) + 2, 10_000}:
        d = 4 * rows
        pays = (a + b * (rows + d)) / (rows + p * d) < (a + b * rows) / rows
        assert gate.open(rows) == (pays or rows <= 1)


def test_a_lone_row_always_drafts():
    gate = StepCostGate(decay=1.0)
    for t in range(1, 100):
        gate.observe(t, 1e-4 + 1e-3 * t)  # a tiny fixed part: drafting hardly ever pays
    gate.observe_acceptance(verified=1000, accepted=1)
    assert gate.max_rows() < 1 and gate.open(1) and not gate.open(2)


def _timed(proposer: HistoSpecProposer, a: float, b: float, monkeypatch) -> list[dict]:
    """Each engine step takes a + b * (tokens it processed): rows plus the drafts proposed before it. Returns
    one record per call: rows running, whether the gate had a fit, its bound then, and the drafts' lengths."""
    clock = [0.0]
    last = [0]
    calls: list[dict] = []
    monkeypatch.setattr("speculative.proposer.time.perf_counter", lambda: clock[0])
    inner = proposer.propose

    def propose(sampled, n, rows):
        clock[0] += a + b * last[0]
        rec = {"live": sum(1 for s in sampled if s), "fitted": proposer.gate.fit() is not None,
               "bound": proposer.gate.max_rows()}
        drafts = inner(sampled, n, rows)
        rec["drafted"] = sum(len(d) for d in drafts)
        calls.append(rec)
        last[0] = sum(1 + len(d) for d, s in zip(drafts, sampled) if s)
        return drafts

    proposer.propose = propose
    return calls


def test_proposer_measures_its_engine_and_gates_the_full_batch(monkeypatch):
    a, b = 3e-3, 0.15e-3  # a / b = 20 tokens, as the tiny CPU engine
    store = HistoryStore()
    store.record(PROMPT, [RESPONSE], epoch=1)
    proposer = HistoSpecProposer(settings=DraftSettings(max_draft_tokens=8, sources=("history",)))
    proposer.apply_update(store.snapshot())
    calls = _timed(proposer, a, b, monkeypatch)
    rng = np.random.default_rng(1)
    # Row 0 follows its history but for every 9th token (drafts partly accepted: p well below 1); 47 other
    # rows are unlike any history and end after 8 to 54 tokens, so the batch drains to row 0 alone.
    drifted = [t if k % 9 != 8 else 1 for k, t in enumerate(RESPONSE[:-1])] * 4 + [0]
    targets = [drifted] + [[int(x) for x in rng.integers(100, 200, size=k)] + [0] for k in range(8, 55)]
    _SimEngine([PROMPT] * len(targets), targets, k=8).run(proposer)
    fa, fb = proposer.gate.fit()
    assert fa == pytest.approx(a, rel=1e-6) and fb == pytest.approx(b, rel=1e-6)  # drafts counted as tokens
    assert 0.1 < proposer.gate.acceptance < 0.9
    # every step the fitted gate judged too full decoded plainly, and there were such steps ...
    gated = [c for c in calls if c["fitted"] and c["live"] > 1 and c["live"] >= c["bound"]]
    assert gated and all(c["drafted"] == 0 for c in gated)
    assert proposer.stats.totals["gated_steps"] >= len(gated)
    # ... while the lone tail row drafts
    assert any(c["drafted"] > 0 for c in calls if c["live"] == 1)


def test_primed_gate_turns_a_large_batch_off_and_one_row_on():
    store = HistoryStore()
    store.record(PROMPT, [RESPONSE], epoch=1)
    proposer = HistoSpecProposer(settings=DraftSettings(max_draft_tokens=8, sources=("history",)))
    proposer.apply_update(store.snapshot())
    for t in range(1, 100):
        proposer.gate.observe(t, 3e-3 + 0.15e-3 * t)
    proposer.gate.observe_acceptance(verified=100, accepted=30)  # p ~ 0.3: break-even near 8.6 rows
    assert 6 < proposer.gate.max_rows() < 11
    many = _SimEngine([PROMPT] * 16, [RESPONSE] * 16, k=8).run(proposer)
    assert all(sum(n) == 0 for n in many[:3])  # 16 rows: plain decoding
    off = HistoSpecProposer(settings=DraftSettings(max_draft_tokens=8, sources=("history",), cost_gate=False))
    off.apply_update(store.snapshot())
    assert any(sum(n) > 0 for n in _SimEngine([PROMPT] * 16, [RESPONSE] * 16, k=8).run(off)[:3])  # gate off: drafts
    one = HistoSpecProposer(settings=DraftSettings(max_draft_tokens=8, sources=("history",)))
    one.apply_update(store.snapshot())
    one.gate = proposer.gate
    assert any(n[0] > 0 for n in _SimEngine([PROMPT], [RESPONSE], k=8).run(one))
