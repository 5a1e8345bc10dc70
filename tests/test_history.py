"""Length history and predictor: values, fallback, lower bounds, memory bound, JSON state round trip.

Hardware: CPU only. Run: .venv/bin/python -m pytest tests/test_history.py -q
"""

from __future__ import annotations

import json

import pytest

from scheduler.history import LengthHistory


def test_predictors_use_latest_epoch():
    for name, want in (("prev_max", 40.0), ("prev_mean", 25.0), ("quantile", 40.0)):
        h = LengthHistory(name, quantile_q=0.9)
        for x in (100, 200):
            h.record("p", 0, x)
        for x in (10, 40):
            h.record("p", 1, x)
        assert h.predict("p") == want
        assert h.lengths("p", 0) == [100, 200]


def test_unseen_prompt_falls_back_to_dataset_distribution_and_is_not_known():
    h = LengthHistory("quantile", quantile_q=0.5)
    assert h.predict("new") == 0.0
    for i, x in enumerate([10, 20, 30, 40]):
        h.record(f"p{i}", 0, x)
    assert h.predict("new") == 20.0 and not h.known("new")


def test_aborted_partial_raises_prediction():
    h = LengthHistory("prev_max")
    h.record("p", 0, 50)
    h.record_lower_bound("p", 300)
    assert h.predict("p") == 300.0 and h.known("p")


def test_memory_is_bounded():
    h = LengthHistory("prev_max", max_prompts=3, keep_epochs=2, global_window=5)
    for e in range(4):
        for i in range(10):
            h.record(f"p{i}", e, i + e)
    assert len(h) == 3 and "p9" in h and "p0" not in h
    for e in range(4):
        h.record("p9", e, e)
    assert sorted(h._lengths["p9"]) == [2, 3]  # only the last keep_epochs epochs
    assert len(h.state_dict()["recent"]) == 5


def test_state_dict_is_json_and_round_trips():
    h = LengthHistory("prev_mean")
    h.record("a", 0, 5)
    h.record("b", 1, 7)
    h.record_lower_bound("c", 9)
    state = json.loads(json.dumps(h.state_dict()))
    g = LengthHistory("prev_mean")
    g.load_state_dict(state)
    assert g.state_dict() == h.state_dict() and g.predict("a") == 5.0 and g.predict("c") == 9.0


def test_unknown_predictor_rejected():
    with pytest.raises(ValueError):
        LengthHistory("oracle")
