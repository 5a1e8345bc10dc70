"""History store: epochs, bounds, incremental deltas, wire format, checkpoint round trip (CPU, pure)."""

from __future__ import annotations

import numpy as np
import pytest

from speculative.config import SpeculativeConfig
from speculative.history import HistoryDelta, HistoryReplica, HistoryStore, prompt_key
from megatron_sortedrl.errors import ConfigError


def _resp(store, prompt):
    e = store.get(prompt)
    return None if e is None else [r.tolist() for r in e.responses]


def test_epochs_replace_accumulate_and_ignore_stale():
    s = HistoryStore(max_responses_per_prompt=3)
    p = [5, 6, 7]
    s.record(p, [[1, 2]], epoch=1)
    s.record(p, [[3], [4], [5]], epoch=1)  # same epoch accumulates up to the cap
    assert _resp(s, p) == [[1, 2], [3], [4]]
    s.record(p, [[9, 9]], epoch=2)  # newer epoch replaces
    assert _resp(s, p) == [[9, 9]]
    s.record(p, [[7]], epoch=1)  # older epoch ignored
    assert _resp(s, p) == [[9, 9]]
    assert s.total_tokens == 2
    assert prompt_key(p) == prompt_key(np.array(p, dtype=np.int64)) != prompt_key([5, 6, 8])


def test_several_epochs_kept_newest_first_and_shipped_with_their_epochs():
    s = HistoryStore(max_responses_per_prompt=3, keep_epochs=2)
    p = [5, 6, 7]
    s.record(p, [[1], [2]], epoch=1)
    s.record(p, [[3], [4]], epoch=2)  # room for one: it replaces one of epoch 1, never one of epoch 2
    assert _resp(s, p) == [[2], [3], [4]] and s.get(p).epochs() == [1, 2, 2]
    s.record(p, [[5]], epoch=2)  # full of the newest epoch's: epoch 1 gives way again
    assert _resp(s, p) == [[3], [4], [5]]
    s.record(p, [[6]], epoch=2)  # full of the newest epoch: the first ones stay
    assert _resp(s, p) == [[3], [4], [5]]
    s.record(p, [[7]], epoch=1)  # one epoch back is inside the window but cannot push out newer ones
    s.record(p, [[8]], epoch=4)  # epochs 2 and 3 fall out of the window (keep 3 and 4)
    assert _resp(s, p) == [[8]] and s.total_tokens == 1
    s.record(p, [[9]], epoch=2)  # older than the window: ignored
    assert _resp(s, p) == [[8]]
    s.record(p, [[10]], epoch=3)
    back = HistoryDelta.from_bytes(s.updates_since(0).to_bytes()).entries[prompt_key(p)]
    assert [r.tolist() for r in back.responses] == [[8], [10]] and back.epochs() == [4, 3]
    restored = HistoryStore(keep_epochs=2)
    restored.load_state_dict(s.state_dict())
    assert restored.get(p).epochs() == [4, 3]


def test_lru_eviction_by_prompts_and_tokens():
    s = HistoryStore(max_prompts=2)
    s.record([1], [[1]], 0)
    s.record([2], [[2]], 0)
    s.record([1], [[3]], 0)  # touching prompt 1 makes prompt 2 the least recently updated
    s.record([3], [[4]], 0)
    assert [1] in s and [3] in s and [2] not in s
    t = HistoryStore(max_total_tokens=10)
    t.record([1], [[0] * 6], 0)
    t.record([2], [[0] * 6], 0)
    assert len(t) == 1 and [2] in t and t.total_tokens == 6


def test_updates_since_is_incremental_and_replica_follows():
    s = HistoryStore(max_prompts=3)
    rep = HistoryReplica()
    for i in range(3):
        s.record([i], [[i, i]], 0)
    d0 = s.updates_since(0)
    assert len(d0.entries) == 3 and not d0.full
    rep.apply(HistoryDelta.from_bytes(d0.to_bytes()))
    v = s.version
    s.record([1], [[7]], 0)
    s.record([4], [[8]], 0)  # evicts prompt 0 (least recently updated)
    d1 = s.updates_since(v)
    assert set(d1.entries) == {prompt_key([1]), prompt_key([4])}
    assert d1.evicted == [prompt_key([0])]
    changed, removed = rep.apply(HistoryDelta.from_bytes(d1.to_bytes()))
    assert removed == [prompt_key([0])] and set(changed) == set(d1.entries)
    assert {k: [r.tolist() for r in e.responses] for k, e in rep.entries.items()} == \
           {k: [r.tolist() for r in e.responses] for k, e in s.snapshot().entries.items()}
    assert len(s.updates_since(s.version)) == 0
    # A replica that missed an update refuses the next delta instead of silently diverging.
    stale = HistoryReplica()
    with pytest.raises(ValueError, match="missed"):
        stale.apply(d1)


def test_old_consumer_gets_full_snapshot_after_eviction_log_wraps():
    s = HistoryStore(max_prompts=1, eviction_log_size=2)
    for i in range(6):
        s.record([i], [[i]], 0)
    d = s.updates_since(1)
    assert d.full and list(d.entries) == [prompt_key([5])]
    rep = HistoryReplica()
    rep.entries = {"junk": None}  # type: ignore[dict-item]
    rep.apply(d)
    assert list(rep.entries) == [prompt_key([5])] and rep.version == s.version


def test_state_dict_round_trip_and_fresh_consumers_get_snapshot():
    s = HistoryStore()
    s.record([1, 2], [[3, 4], [5]], 2)
    s.record([9], [[8]], 3)
    t = HistoryStore()
    t.load_state_dict(s.state_dict())
    assert t.version == s.version and _resp(t, [1, 2]) == [[3, 4], [5]] and t.get([9]).epoch == 3
    assert t.updates_since(1).full  # eviction log is not checkpointed
    t.record([9], [[1]], 4)
    assert list(t.updates_since(s.version).entries) == [prompt_key([9])]


def test_wire_format_rejects_garbage():
    with pytest.raises(ValueError):
        HistoryDelta.from_bytes(b"nope")


def test_config_validation_names_key():
    with pytest.raises(ConfigError, match="speculative.history_max_responses"):
        SpeculativeConfig(history_max_responses=0)
    with pytest.raises(ConfigError, match="speculative.method"):
        SpeculativeConfig(method="eagle")
