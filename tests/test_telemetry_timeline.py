"""Timeline format and the DESIGN section 4 metrics, against hand-computed values. CPU only, < 1 s.

    python -m pytest tests/test_telemetry_timeline.py -q
"""

from __future__ import annotations

import threading

import pytest

from megatron_sortedrl.telemetry.timeline import (
    Event,
    TimelineError,
    TimelineWriter,
    driver_idle,
    driver_idle_from_intervals,
    read_run_timeline,
    read_timeline,
    request_intervals,
    rollout_bubble_by_step,
    slot_bubble_ratio,
    slot_bubble_ratio_from_intervals,
    step_breakdown,
    step_windows,
    union_length,
    worker_bubble_ratio,
    worker_bubble_ratio_from_times,
)


def phase(t, event, step, name):
    return Event(t=t, kind="phase", event=event, step=step, phase=name)


def req(t, event, step, worker, sid, tokens=None):
    return Event(t=t, kind="request", event=event, step=step, worker=worker, sample_id=sid, tokens=tokens)


def rollout_step(step=0, t0=0.0, finishes=((0, 4.0), (1, 10.0), (2, 7.0)), t1=10.0):
    """One rollout phase [t0, t1]; worker w gets one request submitted at t0 finishing at the given time."""
    ev = [phase(t0, "start", step, "rollout")]
    for w, t in finishes:
        ev.append(req(t0, "submit", step, w, f"s{step}w{w}"))
        ev.append(req(t, "finish", step, w, f"s{step}w{w}", tokens=10))
    ev.append(phase(t1, "end", step, "rollout"))
    return ev


def test_event_json_round_trip_leaves_out_unset_fields():
    e = req(1.5, "finish", 3, 1, "p7/0", tokens=812)
    line = e.to_json()
    assert '"phase"' not in line and '"tokens":812' in line
    assert Event.from_json(line) == e
    assert Event.from_json('{"t": 2, "kind": "phase", "event": "start", "step": 0, "phase": "train"}').phase == "train"


@pytest.mark.parametrize("bad", [
    '{"t": 1, "kind": "request", "event": "start", "step": 0}',  # event of another kind
    '{"t": 1, "kind": "gpu", "event": "busy", "step": 0}',  # unknown kind
    '{"t": 1, "kind": "phase", "event": "start", "step": 0}',  # phase without a name
    '{"t": 1, "kind": "worker", "event": "busy"}',  # no step
    '{"t": 1, "kind": "worker", "event": "busy", "step": 0, "color": 3}',  # unknown field
    'not json',
])
def test_malformed_line_is_reported_with_file_and_line(tmp_path, bad):
    path = tmp_path / "timeline.jsonl"
    path.write_text(phase(0, "start", 0, "rollout").to_json() + "\n\n" + bad + "\n")
    with pytest.raises(TimelineError, match=r"timeline.jsonl:3: malformed"):
        read_timeline(path)


def test_writer_is_thread_safe_appends_and_reader_merges_files(tmp_path):
    with TimelineWriter(tmp_path / "timeline.jsonl") as w:
        threads = [threading.Thread(target=lambda k=k: [w.record("worker", "busy", 0, t=float(k * 1000 + i), worker=k)
                                                         for i in range(200)]) for k in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    with TimelineWriter(tmp_path / "timeline.worker0.jsonl") as w:  # a second process's file
        w.record("phase", "start", 1, t=0.5, phase="rollout")
    with TimelineWriter(tmp_path / "timeline.jsonl") as w:  # reopening appends
        w.record("phase", "end", 1, t=9999.0, phase="rollout")
    assert len(read_timeline(tmp_path / "timeline.jsonl")) == 801
    merged = read_run_timeline(tmp_path)
    assert len(merged) == 802
    assert [e.t for e in merged] == sorted(e.t for e in merged)
    assert merged[1].phase == "rollout"  # t=0.5 from the other file lands between t=0 and t=1


def test_writer_stamps_with_run_clock(tmp_path):
    from megatron_sortedrl.telemetry.timeline import RunClock
    import time

    clock = RunClock(epoch=time.time() - 100.0)
    with TimelineWriter(tmp_path / "t.jsonl", clock=clock) as w:
        e = w.record("worker", "idle", 0, worker=2)
    assert 100.0 <= e.t < 110.0


def test_worker_bubble_ratio_hand_computed():
    # Workers idle after their last finish: (10-4) + (10-10) + (10-7) = 9 of 3 * 10 worker-seconds.
    assert worker_bubble_ratio(rollout_step()) == pytest.approx(9 / 30)
    assert worker_bubble_ratio_from_times([4.0, 10.0, 7.0], 0.0, 10.0) == pytest.approx(0.3)
    # A finish recorded after the phase end is clipped; one before its start counts as idle all phase.
    assert worker_bubble_ratio_from_times([12.0, -1.0], 0.0, 10.0) == pytest.approx(0.5)


def test_worker_bubble_uses_last_finish_or_abort_and_open_requests_keep_worker_busy():
    ev = [phase(0, "start", 0, "rollout"),
          req(0, "submit", 0, 0, "a"), req(0, "submit", 0, 0, "b"), req(3, "finish", 0, 0, "a"),
          req(6, "abort", 0, 0, "b"),  # worker 0 last done at 6
          req(0, "submit", 0, 1, "c"),  # worker 1: never finished -> busy to the end
          phase(8, "end", 0, "rollout")]
    assert worker_bubble_ratio(ev, step=0) == pytest.approx((8 - 6) / (2 * 8))


def test_bubble_over_all_steps_is_weighted_by_worker_seconds():
    ev = rollout_step(0) + rollout_step(1, t0=20.0, finishes=((0, 22.0),), t1=30.0)
    assert worker_bubble_ratio(ev, step=1) == pytest.approx(0.8)
    # (9 + 8) idle worker-seconds over (30 + 10).
    assert worker_bubble_ratio(ev) == pytest.approx(17 / 40)
    assert worker_bubble_ratio(ev, step=7) == 0.0  # no such step: nothing to report


def test_slot_bubble_ratio_hand_computed():
    ev = [phase(0, "start", 0, "rollout"),
          req(0, "submit", 0, 0, "a"), req(2, "submit", 0, 0, "b"), req(4, "finish", 0, 0, "a"),
          req(10, "finish", 0, 0, "b"),
          req(1, "submit", 0, 1, "c"), req(5, "abort", 0, 1, "c"),
          req(5, "submit", 1, 1, "other-step"),  # another step's request does not count
          phase(10, "end", 0, "rollout")]
    # active sequence-seconds: 4 + 8 + 4 = 16; capacity 2 slots x 2 workers x 10 s = 40.
    assert slot_bubble_ratio(ev, max_batch=2, step=0) == pytest.approx(1 - 16 / 40)
    # The same with W fixed at 4 engines (two of which got nothing).
    assert slot_bubble_ratio(ev, max_batch=2, step=0, num_workers=4) == pytest.approx(1 - 16 / 80)
    assert slot_bubble_ratio_from_intervals([(0, 4), (2, 10), (1, 5)], 4, 0, 10) == pytest.approx(0.6)
    # Clipped to the window [3, 10]: (4-3) + (10-3) = 8 sequence-seconds of 2 slots x 7 s.
    assert slot_bubble_ratio_from_intervals([(0, 4), (2, 12)], 2, 3, 10) == pytest.approx(1 - 8 / 14)


def test_request_intervals_pair_by_sample_and_leave_unfinished_open():
    ev = [req(0, "submit", 0, 0, "a"), req(1, "submit", 0, 0, "b"), req(2, "finish", 0, 0, "b"),
          req(3, "first_token", 0, 0, "a")]
    assert request_intervals(ev, 0) == {0: [(1, 2), (0, float("inf"))]}


def test_step_breakdown_counts_phases_and_idle_gaps():
    ev = [phase(0, "start", 0, "rollout"), phase(10, "end", 0, "rollout"),
          phase(11, "start", 0, "reward"), phase(12, "end", 0, "reward"),
          phase(12, "start", 0, "train"), phase(17, "end", 0, "train"),
          phase(17.5, "start", 0, "sync"), phase(18, "end", 0, "sync"),
          phase(20, "start", 1, "rollout"), phase(28, "end", 1, "rollout"),
          phase(28, "start", 1, "checkpoint"), phase(30, "end", 1, "checkpoint")]
    b = step_breakdown(ev)
    # Step 0 runs from 0 to the start of step 1 at 20: gaps 10-11, 17-17.5 and 18-20 are idle.
    assert b[0] == pytest.approx({"rollout": 10, "reward": 1, "train": 5, "sync": 0.5, "idle": 3.5})
    assert b[1] == pytest.approx({"rollout": 8, "checkpoint": 2, "idle": 0})
    assert step_windows(ev) == {0: (0, 20), 1: (20, 30)}


def test_step_breakdown_with_overlapping_steps_and_an_unterminated_phase():
    # Asynchronous rollout: step 1's rollout starts while step 0 trains; the run stopped during train.
    ev = [phase(0, "start", 0, "rollout"), phase(5, "end", 0, "rollout"),
          phase(6, "start", 0, "train"), phase(9, "end", 0, "train"),
          phase(6, "start", 1, "rollout"), phase(12, "end", 1, "rollout"),
          phase(13, "start", 1, "train"), Event(t=15, kind="worker", event="idle", step=1, worker=0)]
    b = step_breakdown(ev)
    assert b[0] == pytest.approx({"rollout": 5, "train": 3, "idle": 1})  # window 0-9, gap 5-6
    # Step 1: window 6-15 (train open until the last event at 15), union 6-12 and 13-15 -> idle 1.
    assert b[1] == pytest.approx({"rollout": 6, "train": 2, "idle": 1})


def test_rollout_bubble_by_step_table():
    ev = rollout_step(0) + rollout_step(1, t0=20.0, finishes=((0, 25.0), (1, 30.0)), t1=30.0)
    table = rollout_bubble_by_step(ev, max_batch=1)
    assert table[0] == pytest.approx({"rollout_s": 10, "worker_bubble": 0.3, "slot_bubble": 0.3, "driver_idle": 0.0})
    assert table[1] == pytest.approx({"rollout_s": 10, "worker_bubble": 0.25, "slot_bubble": 0.25,
                                       "driver_idle": 0.0})


# ------------------------------------------------------------------------------------------ driver idle


def test_driver_idle_counts_gaps_before_a_later_submission_and_after_everything_ended():
    """Hand-built phase [0, 10] with two workers:
    w0: busy 0-2, empty 2-3 (then fed again: 1 s driver idle), busy 3-6, then empty while w1 still runs
        (6-8: tail bubble, not the driver's) and after everything ended (8-10: harvest pending, 2 s).
    w1: first submission only at 0.5 (0.5 s driver idle), busy 0.5-8, then 8-10 pending (2 s).
    """
    ev = [phase(0.0, "start", 1, "rollout"),
          req(0.0, "submit", 1, 0, "a"), req(2.0, "finish", 1, 0, "a"),
          req(3.0, "submit", 1, 0, "b"), req(6.0, "finish", 1, 0, "b"),
          req(0.5, "submit", 1, 1, "c"), req(8.0, "abort", 1, 1, "c"),
          phase(10.0, "end", 1, "rollout")]
    idle, total = driver_idle(ev, 1)
    assert idle == pytest.approx(1.0 + 2.0 + 0.5 + 2.0)
    assert total == pytest.approx(2 * 10.0)
    assert rollout_bubble_by_step(ev)[1]["driver_idle"] == pytest.approx(5.5 / 20.0)
    # The worker bubble counts w0's 6-10 and w1's 8-10: the tail and the pending harvest are both in it,
    # but only the pending part is the driver's.
    assert worker_bubble_ratio(ev, 1) == pytest.approx((4.0 + 2.0) / 20.0)


def test_driver_idle_is_zero_when_every_engine_is_fed_until_the_phase_ends():
    ev = rollout_step(finishes=((0, 10.0), (1, 10.0)), t1=10.0)
    assert driver_idle(ev, 0) == (0.0, 20.0)


@pytest.mark.parametrize("seed", range(20))
def test_driver_idle_never_exceeds_empty_engine_time(seed):
    """Property: per worker, driver idle <= the time it had nothing in flight inside the phase, and a request
    left open (no finish) keeps its worker busy until the phase ends."""
    import random

    rng = random.Random(seed)
    per_worker = {}
    for w in range(3):
        t, iv = rng.uniform(0, 2), []
        for _ in range(rng.randint(1, 4)):
            a = t + rng.uniform(0, 2)
            b = a + rng.uniform(0.1, 3)
            iv.append((a, b))
            t = b if rng.random() < 0.7 else a + 0.05  # sometimes overlapping requests
        per_worker[w] = iv
    per_worker[3] = [(1.0, float("inf"))]
    t0, t1 = 0.0, 12.0
    idle = driver_idle_from_intervals(per_worker, t0, t1)
    for w, iv in per_worker.items():
        empty = (t1 - t0) - union_length(iv, t0, t1)
        assert -1e-9 <= idle[w] <= empty + 1e-9
    assert idle[3] == pytest.approx(1.0)  # only its start was late
