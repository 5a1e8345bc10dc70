"""The layout switch on the run timeline and in the run report: the `relayout` phase and the per-rollout
layout the driver records (megatron_sortedrl/relayout.py), read back and drawn. CPU only, a few seconds.

    python -m pytest tests/test_layout_timeline.py -q

The synthetic run: 8 steps of 10 s, each a rollout [b + 1, b + 4] (two workers, one request each) and a
train phase; steps 3 and 5 switch layout (2xTP1 -> 1xTP2 -> 2xTP1) in a relayout phase [b, b + 1] first.
"""

from __future__ import annotations

from megatron_sortedrl.metrics import MetricsWriter
from megatron_sortedrl.telemetry.run_report import gantt_steps, relayout_steps, rollout_layouts, write_run_report
from megatron_sortedrl.telemetry.timeline import Event, TimelineWriter, read_run_timeline, worker_bubble_ratio

STEPS = 8
LAYOUT = {1: "2xTP1", 2: "2xTP1", 3: "1xTP2", 4: "1xTP2", 5: "2xTP1", 6: "2xTP1", 7: "2xTP1", 8: "2xTP1"}


def _write_run(run):
    with TimelineWriter(run / "timeline.jsonl") as tl:
        for s in range(1, STEPS + 1):
            b = 10.0 * (s - 1)
            if LAYOUT[s] != LAYOUT.get(s - 1, "2xTP1"):
                tl.record("phase", "start", s, t=b, phase="relayout", layout=LAYOUT[s])
                tl.record("phase", "end", s, t=b + 1, phase="relayout", layout=LAYOUT[s])
            tl.record("phase", "start", s, t=b + 1, phase="rollout", layout=LAYOUT[s])
            for w in range(int(LAYOUT[s][0])):
                tl.record("request", "submit", s, t=b + 1, worker=w, sample_id=f"s{s}w{w}", tokens=0)
                tl.record("request", "finish", s, t=b + 4, worker=w, sample_id=f"s{s}w{w}", tokens=10)
            tl.record("phase", "end", s, t=b + 4, phase="rollout")
            tl.record("phase", "start", s, t=b + 4, phase="train")
            tl.record("phase", "end", s, t=b + 7, phase="train")
    m = MetricsWriter(run, tensorboard=False)
    for s in range(1, STEPS + 1):
        engines, tp = (int(x) for x in LAYOUT[s].split("xTP"))
        m.log(s, {"reward/mean": 0.5, "rollout/samples": 4, "time/step_s": 10.0, "rollout/layout_engines": engines,
                  "rollout/layout_tp": tp, "time/relayout_s": 1.0 if s in (3, 5) else 0.0})
    m.close()


def test_layout_round_trips_through_the_timeline(tmp_path):
    _write_run(tmp_path)
    events = read_run_timeline(tmp_path)
    assert relayout_steps(events) == [3, 5]
    assert rollout_layouts(events) == LAYOUT
    line = Event(1.0, "phase", "start", 3, phase="relayout", layout="1xTP2").to_json()
    assert Event.from_json(line).layout == "1xTP2"
    # The relayout phase lies before the rollout phase: the worker bubble of the switch step is that of the
    # rollout alone (both workers busy to its end: 0).
    assert worker_bubble_ratio(events, 3) == 0.0


def test_gantt_shows_the_steps_around_the_last_switch():
    steps = list(range(1, 13))
    assert gantt_steps(steps, [], 3) == [10, 11, 12]  # no switch: the last steps, as before
    assert gantt_steps(steps, [11], 3) == [10, 11, 12]  # the switch is among the last steps already
    assert gantt_steps(steps, [3, 5], 3) == [4, 5, 6]  # the step before the last switch, it, the one after
    assert gantt_steps(steps, [1], 3) == [1, 2, 3]
    assert gantt_steps([1, 2], [2], 3) == [1, 2]


def test_report_names_the_switches_and_each_steps_layout(tmp_path):
    _write_run(tmp_path)
    page = write_run_report(tmp_path).read_text()
    assert "engine layout switches</td><td>2 (step 3: 1xTP2, step 5: 2xTP1)" in page
    assert "around the last layout switch: 3 of 8 steps with a rollout (steps 4-6)" in page
    assert "<th>engines</th><th>engine TP</th><th>relayout s</th>" in page
