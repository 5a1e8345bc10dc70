"""The cost gate of HistoSpec (`speculative/cost_gate.py`): on an engine whose step time is flat when small
and steep when large, it settles on whichever arm (drafts or plain) costs less per generated token in each
batch-size bucket, follows a change of acceptance, always drafts with one row, and inside the proposer it
measures each engine step's emitted tokens and time, switching a full batch to plain decoding while the tail
keeps drafting."""

from __future__ import annotations


import pytest
from test_histospec_drafter import PROMPT, RESPONSE, _SimEngine

from speculative.cost_gate import StepCostGate, bucket
from speculative.drafter import DraftSettings
from speculative.history import HistoryStore
from speculative.proposer import HistoSpecProposer


def _engine_cost(rows: int, draft_tokens: int) -> float:
    """A CPU-like engine step: flat while small, steep past 64 tokens (seconds)."""
    t = rows + draft_tokens
    return 3e-3 + 2e-5 * t + 2e-7 * max(0, t - 64) ** 2


def _simulate(gate: StepCostGate, steps: int, rows: int, p: float, k: int = 8) -> list[bool]:
    """`steps` engine steps at a fixed batch: a drafted row emits 1 + (k accepted with probability p)."""
    decisions = []
    for _ in range(steps):
        d = gate.decide(rows)
        tokens = rows * (1 + (p * k if d else 0))
        gate.observe(rows, d, tokens, _engine_cost(rows, rows * k if d else 0))
        decisions.append(d)
    return decisions


@pytest.mark.parametrize("rows,p,pays", [(2, 0.2, True), (8, 0.3, True), (128, 0.15, False), (16, 0.9, True),
                                         (64, 0.05, False)])
def test_gate_settles_on_the_cheaper_arm(rows, p, pays):
    plain = _engine_cost(rows, 0) / rows
    drafted = _engine_cost(rows, rows * 8) / (rows * (1 + p * 8))
    assert (drafted < plain) == pays  # (the cases cover both outcomes)
    gate = StepCostGate(explore_every=16)
    decisions = _simulate(gate, 400, rows, p)
    late = decisions[100:]
    assert gate.preferred(rows) is pays
    # the cheaper arm, but for one exploring step in every 16
    assert sum(d == pays for d in late) >= len(late) * (1 - 1 / 16) - 1


def test_gate_follows_a_change_of_acceptance():
    gate = StepCostGate(explore_every=16)
    _simulate(gate, 200, 32, p=0.95)
    assert gate.preferred(32) is True
    _simulate(gate, 400, 32, p=0.02)  # the policy drifted: drafts are rejected
    assert gate.preferred(32) is False


def test_a_lone_row_always_drafts_and_buckets_are_powers_of_two():
    gate = StepCostGate()
    assert all(gate.decide(1) for _ in range(100))
    assert [bucket(r) for r in (1, 2, 3, 4, 7, 8, 127, 128)] == [0, 1, 1, 2, 2, 3, 6, 7]


def _timed(proposer: HistoSpecProposer, monkeypatch) -> list[dict]:
    """Each engine step takes `_engine_cost(rows, drafts proposed before it)` on a fake clock. Returns one
    record per call: rows running and the draft tokens proposed."""
    clock = [0.0]
    last = [0, 0]
    calls: list[dict] = []
    monkeypatch.setattr("speculative.proposer.time.perf_counter", lambda: clock[0])
    inner = proposer.propose

    def propose(sampled, n, rows):
        clock[0] += _engine_cost(*last) if last[0] else 0.0
        drafts = inner(sampled, n, rows)
        live = sum(1 for s in sampled if s)
        calls.append({"live": live, "drafted": sum(len(d) for d in drafts)})
        last[:] = [live, sum(len(d) for d, s in zip(drafts, sampled) if s)]
        return drafts

    proposer.propose = propose
    return calls


def test_proposer_measures_its_engine_and_gates_the_full_batch(monkeypatch):
    store = HistoryStore()
    store.record(PROMPT, [RESPONSE], epoch=1)
    proposer = HistoSpecProposer(settings=DraftSettings(max_draft_tokens=8, sources=("history",)))
    proposer.apply_update(store.snapshot())
    calls = _timed(proposer, monkeypatch)
    # 47 rows leave their history at every 8th token: a draft is proposed after 7 matching tokens and its first
    # token is wrong (drafting only costs); they end after 237 tokens. Row 0 leaves it at every 9th token
    # (drafts partly accepted) and ends after 473, alone for the second half (the tail).
    wrong = [t if k % 8 != 7 else 1 for k, t in enumerate(RESPONSE[:-1])]
    drifted = [t if k % 9 != 8 else 1 for k, t in enumerate(RESPONSE[:-1])]
    targets = [drifted * 8 + [0]] + [wrong * 4 + [0]] * 47
    _SimEngine([PROMPT] * len(targets), targets, k=8).run(proposer)
    full = [c for c in calls if c["live"] == 48]
    # on this engine a drafted full step costs more per token than a plain one: the gate learns it ...
    assert proposer.gate.preferred(48) is False
    settled = full[4 * proposer.gate.min_samples:]
    assert settled and sum(c["drafted"] == 0 for c in settled) >= len(settled) * (1 - 1 / 16) - 1
    assert proposer.stats.totals["gated_steps"] >= len(settled) - len(settled) // 16 - 1
    # ... and the lone tail row drafts
    alone = [c for c in calls if c["live"] == 1]
    assert alone and sum(c["drafted"] > 0 for c in alone) > len(alone) // 2


def test_gate_off_drafts_a_full_batch_and_on_keeps_it_plain():
    store = HistoryStore()
    store.record(PROMPT, [RESPONSE], epoch=1)
    gate = StepCostGate()
    _simulate(gate, 100, 16, p=0.1)  # a measured engine where drafting 16 rows does not pay
    assert gate.preferred(16) is False
    on = HistoSpecProposer(settings=DraftSettings(max_draft_tokens=8, sources=("history",)))
    on.apply_update(store.snapshot())
    on.gate = gate
    assert all(sum(n) == 0 for n in _SimEngine([PROMPT] * 16, [RESPONSE] * 16, k=8).run(on)[:5])
    off = HistoSpecProposer(settings=DraftSettings(max_draft_tokens=8, sources=("history",), cost_gate=False))
    off.apply_update(store.snapshot())
    assert off.gate is None
    assert any(sum(n) > 0 for n in _SimEngine([PROMPT] * 16, [RESPONSE] * 16, k=8).run(off)[:5])


def test_one_outlier_step_does_not_flip_the_gate():
    gate = StepCostGate()
    _simulate(gate, 100, 64, p=0.1)
    assert gate.preferred(64) is False
    gate.observe(64, False, 64, 5.0)  # a plain step that also waited 5 s on something else
    assert gate.preferred(64) is False  # the median of the recent plain steps is unmoved
