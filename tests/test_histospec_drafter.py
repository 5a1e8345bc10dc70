"""HistoSpec drafter and proposer logic without an engine (CPU, pure): every draft source, epoch
weighting, per-prompt start length, the batch-size switch, and the driver-side history feed.

The proposer is driven by a small simulation of vLLM's contract: a persistent batch of token rows, one
`propose` call per step, and a verifier that accepts the draft's longest prefix agreeing with the target
sequence and then emits one more target token (what greedy rejection sampling does).
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from speculative.drafter import AdaptiveDraftLength, DraftSettings, FallbackDrafter, HistoryDrafter
from speculative.history import HistoryStore, prompt_key
from speculative.proposer import HistoSpecProposer, vllm_speculative_config
from speculative.config import SpeculativeConfig

PROMPT = np.array([40, 41, 42, 43, 44, 45, 46, 47, 48, 49], dtype=np.int32)
RESPONSE = [int(x) for x in np.random.default_rng(0).integers(4, 100, size=60)] + [0]


def test_exact_continuation_when_response_retraces_history():
    d = HistoryDrafter(DraftSettings(max_draft_tokens=16))
    key = d.set_prompt(PROMPT, [RESPONSE])
    for pos in (1, 5, 30):
        tokens = np.concatenate([PROMPT, RESPONSE[:pos]]).astype(np.int32)
        draft = d.draft(key, tokens, max_tokens=8)
        assert draft.token_ids == RESPONSE[pos:pos + 8]
        assert draft.match_len == 7 and all(p == 1.0 for p in draft.probs)
    # At the end of the history response the draft ends with it (EOS included).
    tokens = np.concatenate([PROMPT, RESPONSE[:-3]]).astype(np.int32)
    assert d.draft(key, tokens, max_tokens=16).token_ids == RESPONSE[-3:]


def test_no_draft_without_history_or_match():
    d = HistoryDrafter()
    row = np.concatenate([PROMPT, RESPONSE[:5], np.zeros(20)]).astype(np.int32)
    assert d.resolve(row, 15) is None
    assert d.draft(prompt_key(PROMPT), row[:15], 8).token_ids == []
    key = d.set_prompt(PROMPT, [RESPONSE])
    assert d.resolve(row, 15) == (key, len(PROMPT))
    off = np.concatenate([PROMPT, [200, 201, 202, 203, 204, 205, 206, 207]]).astype(np.int32)  # diverged
    assert d.draft(key, off, 8).token_ids == []
    d.remove(key)
    assert d.resolve(row, 15) is None and d.draft(key, row[:15], 8).token_ids == []


def test_confidence_floor_and_majority_branch():
    branch_a = RESPONSE[:20] + [1, 2, 3, 4]
    branch_b = RESPONSE[:20] + [9, 9, 9, 9]
    tokens = np.concatenate([PROMPT, RESPONSE[:20]]).astype(np.int32)
    d = HistoryDrafter(DraftSettings(min_confidence=0.5))
    key = d.set_prompt(PROMPT, [branch_a, branch_a, branch_b])
    assert d.draft(key, tokens, 4).token_ids == [1, 2, 3, 4]  # 2/3 >= 0.5: majority branch
    d = HistoryDrafter(DraftSettings(min_confidence=0.7))
    key = d.set_prompt(PROMPT, [branch_a, branch_a, branch_b])
    assert d.draft(key, tokens, 4).token_ids == []  # 2/3 < 0.7: nothing confident enough


def test_prompt_resolution_prefers_longest_known_prompt():
    d = HistoryDrafter()
    short = PROMPT[:6]
    k_short = d.set_prompt(short, [[7, 7, 7]])
    k_long = d.set_prompt(PROMPT, [[8, 8, 8]])
    row = np.concatenate([PROMPT, [8], np.zeros(5)]).astype(np.int32)
    assert d.resolve(row, 11) == (k_long, 10)
    row2 = np.concatenate([short, [7, 7], np.zeros(5)]).astype(np.int32)
    assert d.resolve(row2, 8) == (k_short, 6)


def test_adaptive_length_rule():
    a = AdaptiveDraftLength(2, 16)
    assert a.value == 2
    assert [a.update(a.value, a.value) for _ in range(4)] == [4, 8, 16, 16]  # all accepted: double, cap 16
    assert a.update(16, 15) == 8 and a.update(8, 0) == 4 and a.update(4, 3) == 2 and a.update(2, 0) == 2
    assert a.update(0, 0) == 2  # no draft: no change


def test_drafter_cost_is_microseconds():
    d = HistoryDrafter()
    rng = np.random.default_rng(1)
    key = d.set_prompt(PROMPT, [rng.integers(4, 100, 2000) for _ in range(16)])
    tokens = np.concatenate([PROMPT, rng.integers(4, 100, 500)]).astype(np.int32)
    t = time.perf_counter()
    for _ in range(2000):
        d.draft(key, tokens, 16)
    per_call = (time.perf_counter() - t) / 2000
    assert per_call < 200e-6, per_call  # a decode step of even the tiny CPU model is milliseconds


# The proposers below run with cost_gate=False: the gate (tests/test_cost_gate.py) alternates drafting on and
# off while it learns a batch size, which these tests of the drafting itself do not want.
class _SimEngine:
    """vLLM's persistent batch as the proposer sees it, with a greedy verifier."""

    def __init__(self, prompts, targets, k):
        self.rows = np.zeros((len(prompts), 512), dtype=np.int32)
        self.n = np.array([len(p) for p in prompts], dtype=np.int32)
        for i, p in enumerate(prompts):
            self.rows[i, :len(p)] = p
        self.plen = [len(p) for p in prompts]
        self.targets = targets
        self.k = k
        self.forwards = 0

    def run(self, proposer):
        sampled = [[t[0]] for t in self.targets]  # prefill emits the first token
        self._append(sampled)
        self.forwards += 1
        lengths = []
        while True:
            drafts = proposer.propose(sampled, self.n.copy(), self.rows)
            lengths.append([len(d) for d in drafts])
            live = [i for i in range(len(self.targets)) if self.n[i] - self.plen[i] < len(self.targets[i])]
            if not live:
                proposer.propose([[] for _ in self.targets], self.n.copy(), self.rows)  # rows leave the batch
                return lengths
            sampled = [[] for _ in self.targets]
            for i in live:
                done = int(self.n[i] - self.plen[i])
                target = list(self.targets[i]) + [0] * (self.k + 1)  # vLLM emits past EOS, then truncates
                acc = 0
                for tok in drafts[i][:self.k]:
                    if tok == target[done + acc]:
                        acc += 1
                    else:
                        break
                sampled[i] = target[done:done + acc + 1]
            self.forwards += 1
            self._append(sampled)

    def _append(self, sampled):
        for i, s in enumerate(sampled):
            self.rows[i, self.n[i]:self.n[i] + len(s)] = s
            self.n[i] += len(s)


def test_proposer_adapts_length_and_cuts_forwards():
    store = HistoryStore()
    store.record(PROMPT, [RESPONSE], epoch=1)
    proposer = HistoSpecProposer(settings=DraftSettings(cost_gate=False, min_draft_tokens=2, max_draft_tokens=16, sources=("history",),
                                                        adaptive_length=True))
    assert proposer.apply_update(store.updates_since(0).to_bytes())["prompts"] == 1
    other = np.array([7, 7, 7, 7, 7, 7], dtype=np.int32)  # no history: never drafted
    engine = _SimEngine([PROMPT, other], [RESPONSE, RESPONSE[:30]], k=16)
    lengths = engine.run(proposer)
    assert [step[0] for step in lengths[:5]] == [2, 4, 8, 16, 16]  # all accepted: 2, 4, 8, 16 (cap)
    assert all(step[1] == 0 for step in lengths)
    s = proposer.stats.summary()
    assert s["spec/acceptance_rate"] == 1.0
    # 61 tokens of a retraced response in 1 prefill + ceil-ish steps: far fewer forwards than tokens.
    rec = {r.prompt_key: r for r in proposer.stats.requests}
    assert len(RESPONSE) <= rec[prompt_key(PROMPT)].tokens <= len(RESPONSE) + 1  # the bonus token past EOS
    assert rec[prompt_key(PROMPT)].tokens_per_forward >= 5.0
    assert rec[""].tokens_per_forward == 1.0


def test_without_adaptive_length_drafts_reach_the_cap_at_once():
    store = HistoryStore()
    store.record(PROMPT, [RESPONSE], epoch=1)
    proposer = HistoSpecProposer(settings=DraftSettings(cost_gate=False, min_draft_tokens=2, max_draft_tokens=16, sources=("history",)))
    proposer.apply_update(store.snapshot())
    lengths = [n[0] for n in _SimEngine([PROMPT], [RESPONSE], k=16).run(proposer) if n[0]]
    assert lengths[:2] == [16, 16]  # no ramp from the floor: the history's confidence alone ends a draft
    adaptive = HistoSpecProposer(settings=DraftSettings(cost_gate=False, min_draft_tokens=2, max_draft_tokens=16, sources=("history",),
                                                        adaptive_length=True))
    adaptive.apply_update(store.snapshot())
    ramp = _SimEngine([PROMPT], [RESPONSE], k=16).run(adaptive)
    assert adaptive.stats.summary()["spec/tokens_per_forward"] < proposer.stats.summary()["spec/tokens_per_forward"]
    assert ramp[0][0] == 2


def test_proposer_halves_after_rejection_and_recovers():
    history = RESPONSE[:30] + [1] * 40
    target = RESPONSE[:30] + [2] + [1] * 39  # one divergence in the middle
    store = HistoryStore()
    store.record(PROMPT, [history], epoch=0)
    proposer = HistoSpecProposer(settings=DraftSettings(cost_gate=False, min_draft_tokens=2, max_draft_tokens=8, sources=("history",),
                                                        adaptive_length=True))
    proposer.apply_update(store.snapshot())
    lengths = [s[0] for s in _SimEngine([PROMPT], [target], k=8).run(proposer)]
    # Right after the divergence the context matches nothing (no draft); the next draft is halved.
    drafted = [n for n in lengths if n]
    assert drafted[:3] == [2, 4, 8]
    first_drop = next(i for i in range(1, len(drafted)) if drafted[i] < drafted[i - 1])
    assert drafted[first_drop] == drafted[first_drop - 1] // 2 and 8 in drafted[first_drop:]
    assert proposer.stats.summary()["spec/acceptance_rate"] < 1.0


def test_vllm_speculative_config_switch():
    assert vllm_speculative_config(SpeculativeConfig(enabled=False)) is None
    hs = vllm_speculative_config(SpeculativeConfig())
    assert hs == {"method": "custom_class", "model": "speculative.proposer.HistoSpecProposer",
                  "num_speculative_tokens": 16}
    assert vllm_speculative_config(SpeculativeConfig(method="ngram"))["method"] == "ngram"
    assert vllm_speculative_config(SpeculativeConfig(method="suffix"))["method"] == "suffix"


@pytest.mark.parametrize("bad", [dict(min_draft_tokens=0), dict(min_draft_tokens=4, max_draft_tokens=2),
                                 dict(min_confidence=1.5), dict(sources=("history", "guess")),
                                 dict(epoch_weight=0.5), dict(max_batch_rows=-1)])
def test_draft_settings_validation(bad):
    with pytest.raises(ValueError):
        DraftSettings(**bad)


# ---------------------------------------------------------------------------------------------- sources

def test_newer_epochs_outweigh_older_ones():
    branch_a = RESPONSE[:20] + [1, 2, 3, 4]  # two responses of epoch 1
    branch_b = RESPONSE[:20] + [9, 9, 9, 9]  # one response of epoch 2 (the policy moved)
    tokens = np.concatenate([PROMPT, RESPONSE[:20]]).astype(np.int32)
    for weight, want in ((1.0, [1, 2, 3, 4]), (3.0, [9, 9, 9, 9])):
        d = HistoryDrafter(DraftSettings(min_confidence=0.5, epoch_weight=weight))
        key = d.set_prompt(PROMPT, [branch_a, branch_a, branch_b], epochs=[1, 1, 2])
        assert d.draft(key, tokens, 4).token_ids == want, weight  # 2:1 unweighted, 2:3 weighted


def test_own_text_drafts_a_repeating_response_without_history():
    unit = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]
    target = unit * 6 + [0]
    proposer = HistoSpecProposer(settings=DraftSettings(cost_gate=False, max_draft_tokens=8, sources=("own",)))
    engine = _SimEngine([PROMPT], [target], k=8)
    engine.run(proposer)
    rec = proposer.stats.requests[-1]
    assert rec.prompt_key == "" and rec.accepted_tokens >= 30  # every repeat after the first is drafted
    assert proposer.stats.totals["accepted_own"] == rec.accepted_tokens
    assert engine.forwards < len(target) / 2


def test_cross_source_drafts_from_other_requests_responses():
    proposer = HistoSpecProposer(settings=DraftSettings(cost_gate=False, max_draft_tokens=8, sources=("cross",)))
    _SimEngine([PROMPT], [RESPONSE], k=8).run(proposer)  # an earlier request on this engine
    other = np.array([90, 91, 92, 93, 94, 95, 96, 97], dtype=np.int32)  # another prompt, no history
    engine = _SimEngine([other], [RESPONSE], k=8)
    engine.run(proposer)
    assert proposer.stats.totals["accepted_cross"] >= len(RESPONSE) - 10
    assert engine.forwards <= len(RESPONSE) / 3
    # Without the cross source the same second request gets no draft at all.
    alone = HistoSpecProposer(settings=DraftSettings(cost_gate=False, max_draft_tokens=8, sources=("history",)))
    assert _SimEngine([other], [RESPONSE], k=8).run(alone) and alone.stats.totals["draft_tokens"] == 0


def test_fallback_trees_grow_with_the_response():
    fb = FallbackDrafter(DraftSettings(sources=("own", "cross")))
    fb.start("a", np.array([5, 6, 7, 8, 5, 6], dtype=np.int32), prompt_len=6)
    assert fb.draft("a", np.array([5, 6], dtype=np.int32), 2).token_ids == [7, 8]
    fb.extend("a", np.array([7, 8, 9, 10, 11], dtype=np.int32))
    fb.stop("a")  # its own tree goes, its response stays in the cross tree
    d = fb.draft("b", np.array([3, 9], dtype=np.int32), 4)
    assert d.source == "cross" and d.token_ids == [10, 11]
    assert fb.draft("a", np.array([5, 6], dtype=np.int32), 2).source == "cross"  # no own tree any more


def test_new_request_starts_at_its_prompts_last_draft_length():
    store = HistoryStore()
    store.record(PROMPT, [RESPONSE], epoch=1)
    proposer = HistoSpecProposer(settings=DraftSettings(cost_gate=False, min_draft_tokens=2, max_draft_tokens=16, sources=("history",),
                                                        adaptive_length=True))
    proposer.apply_update(store.snapshot())
    _SimEngine([PROMPT], [RESPONSE], k=16).run(proposer)
    again = _SimEngine([PROMPT], [RESPONSE], k=16).run(proposer)  # a sibling of the same prompt
    assert [n[0] for n in again[:2]] == [16, 16]  # starts long: this prompt's drafts were accepted


def test_batch_size_switch_turns_drafts_off_and_back_on():
    store = HistoryStore()
    store.record(PROMPT, [RESPONSE], epoch=1)
    short = RESPONSE[:12]
    proposer = HistoSpecProposer(settings=DraftSettings(cost_gate=False, min_draft_tokens=4, max_draft_tokens=8, sources=("history",),
                                                        max_batch_rows=1))
    proposer.apply_update(store.snapshot())
    lengths = _SimEngine([PROMPT, PROMPT], [RESPONSE, short], k=8).run(proposer)
    both = [n for n in lengths if len(n) == 2]
    first_alone = next(i for i, n in enumerate(lengths) if n[1] == 0 and i > 12)
    assert all(n == [0, 0] for n in lengths[:12])  # two rows running > max_batch_rows: plain decoding
    assert any(n[0] > 0 for n in lengths[first_alone:]) and both  # one row left: drafting again
    budgeted = HistoSpecProposer(settings=DraftSettings(cost_gate=False, min_draft_tokens=8, max_draft_tokens=8, sources=("history",),
                                                        step_draft_budget=6))
    budgeted.apply_update(store.snapshot())
    lengths = _SimEngine([PROMPT, PROMPT], [RESPONSE, RESPONSE], k=8).run(budgeted)
    assert all(sum(n) <= 6 for n in lengths) and max(max(n) for n in lengths) == 3


# ------------------------------------------------------------------------------------------ history feed

class _Sample:
    def __init__(self, sid, prompt, response, epoch):
        self.sample_id, self.prompt_tokens, self.response_tokens, self.epoch = sid, prompt, response, epoch


class _RecordingPool:
    """Stands in for the Ray pool's `collective_rpc` only: applies shipments to real proposers."""

    def __init__(self, n):
        self.proposers = [HistoSpecProposer() for _ in range(n)]
        self.calls = []
        self.slots = []

    def collective_rpc(self, method, *args, **kwargs):
        self.calls.append(method)
        if method == "histospec_update":
            return [[{"active": True, **p.apply_update(args[0])}] for p in self.proposers]
        if method == "histospec_configure":
            return [[{"active": True, **p.configure(**kwargs)}] for p in self.proposers]
        gate = lambda p: {"cost_gate": p.gate.state()} if p.gate is not None else {}  # noqa: E731 (as the extension)
        return [[{"active": True, "totals": dict(p.stats.totals), **gate(p)}] for p in self.proposers]


def test_run_summary_carries_each_engines_cost_gate_medians():
    """summary.json's `spec_cost_gate`: per engine, per bucket of running requests, the median ms per generated
    token of the plain and the drafted steps its gate holds; absent without the gate or without HistoSpec."""
    from speculative.feed import HistoryFeed

    pool = _RecordingPool(2)
    for k, p in enumerate(pool.proposers):
        for seconds in (0.010, 0.012, 0.016):  # 64 rows, 64 tokens: plain steps at 0.156, 0.1875, 0.25 ms/token
            p.gate.observe(rows=64, drafted=False, tokens=64, seconds=seconds * (k + 1))
        p.gate.observe(rows=5, drafted=True, tokens=20, seconds=0.004)  # 4-7 rows: 0.2 ms/token
    feed = HistoryFeed(SpeculativeConfig(), pool)
    feed._by_kind = {"short": [300.0, 100.0]}  # (what `end_step` accumulates from the engines' counters)
    got = feed.summary()
    assert got["spec_tokens_per_forward"] == 3.0
    assert [g["64"]["plain_ms"] for g in got["spec_cost_gate"]] == pytest.approx([0.1875, 0.375])
    assert [(g["64"]["plain_n"], g["64"]["drafted_n"], g["4"]["drafted_ms"]) for g in got["spec_cost_gate"]] == \
        [(3, 0, pytest.approx(0.2))] * 2
    for cfg in (SpeculativeConfig(cost_gate=False), SpeculativeConfig(method="suffix")):
        other = HistoryFeed(cfg, pool)
        other._by_kind = {"short": [300.0, 100.0]}
        assert other.summary() == {"spec_tokens_per_forward": 3.0, "spec_tokens_per_forward_short": 3.0}
    assert HistoryFeed(SpeculativeConfig(), pool).summary() == {}  # nothing generated yet: no figures at all

    class _Gone(_RecordingPool):
        def collective_rpc(self, method, *args, **kwargs):
            raise RuntimeError("engine died")

    lost = HistoryFeed(SpeculativeConfig(), _Gone(1))
    lost._by_kind = {"long": [30.0, 10.0]}
    assert lost.summary() == {"spec_tokens_per_forward": 3.0, "spec_tokens_per_forward_long": 3.0}


def test_feed_ships_siblings_once_and_heals_a_restarted_engine():
    from speculative.feed import HistoryFeed

    cfg = SpeculativeConfig(sibling_ship_interval_s=0.0, min_confidence=0.3, history_epochs=2)
    pool = _RecordingPool(2)
    feed = HistoryFeed(cfg, pool)
    first = _Sample("p/e1/0", list(PROMPT), RESPONSE, 1)
    feed.on_finished(first)  # finished mid-round: recorded and shipped to both engines at once
    feed.maybe_ship()
    assert pool.calls[:2] == ["histospec_configure", "histospec_update"]
    assert all(p.settings.min_confidence == 0.3 for p in pool.proposers)  # config reached the engines
    assert all(len(p.drafter) == 1 for p in pool.proposers)
    feed.record_batch([first, _Sample("p/e1/1", list(PROMPT), RESPONSE[:9], 1)])  # first is not recorded twice
    assert len(feed.store.get(PROMPT).responses) == 2
    pool.proposers[1] = HistoSpecProposer()  # an engine restarted and lost its history
    feed.on_finished(_Sample("p/e2/0", list(PROMPT), RESPONSE[:5], 2))
    feed.maybe_ship()
    assert all(p.replica.version == feed.store.version for p in pool.proposers)
    assert pool.proposers[1].settings.min_confidence == 0.3
    assert pool.proposers[1].replica.entries[prompt_key(PROMPT)].epochs() == [1, 1, 2]


class _DeferringPool(_RecordingPool):
    """Also stands in for the pool's `collective_rpc_async`/`rpc_results`: an engine applies an unwaited call only
    when `release` says it got to it (between two of its steps)."""

    def __init__(self, n):
        super().__init__(n)
        self.pending, self.answers = [], {}

    def collective_rpc_async(self, method, *args, **kwargs):
        ref = len(self.answers) + len(self.pending)
        self.pending.append((ref, method, args, kwargs))
        return [ref]

    def release(self):
        for ref, method, args, kwargs in self.pending:
            self.answers[ref] = self.collective_rpc(method, *args, **kwargs)
        self.pending = []

    def rpc_results(self, refs, timeout=0.0):
        if any(r not in self.answers for r in refs):
            if timeout is None:  # a blocking read: the engines get to it
                self.release()
            else:
                return None
        return self.answers[refs[0]]


def test_feed_ships_siblings_without_waiting_one_at_a_time_and_in_order():
    from speculative.feed import HistoryFeed

    cfg = SpeculativeConfig(sibling_ship_interval_s=0.0, history_epochs=2)
    pool = _DeferringPool(2)
    feed = HistoryFeed(cfg, pool)
    feed.on_finished(_Sample("p/e1/0", list(PROMPT), RESPONSE, 1))
    feed.maybe_ship()  # sent, not yet applied: the driver goes on
    assert pool.calls == ["histospec_configure"] and len(pool.pending) == 1
    assert all(len(p.drafter) == 0 for p in pool.proposers)
    feed.on_finished(_Sample("p/e1/1", list(PROMPT), RESPONSE[:9], 1))
    feed.maybe_ship()  # the first is still in flight: nothing more is sent
    assert len(pool.pending) == 1
    pool.release()
    feed.maybe_ship()  # answered: the second goes
    assert len(pool.pending) == 1 and all(p.replica.version == 1 for p in pool.proposers)
    pool.proposers[1] = HistoSpecProposer()  # an engine restarts before it applies the second
    pool.release()
    feed.ship()  # the step's end: reads the answers, finds the restarted engine, heals it
    assert all(p.replica.version == feed.store.version for p in pool.proposers)
    assert pool.proposers[1].replica.entries[prompt_key(PROMPT)].epochs() == [1, 1]
