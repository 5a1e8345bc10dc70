"""The RL run report on a synthetic run directory with known request intervals. CPU only, a few seconds.

    python -m pytest tests/test_run_report.py -q

The synthetic run: 4 steps, each 10 s from b = 10 * (step - 1): rollout [b, b + 4], train [b + 4, b + 7],
sync [b + 7, b + 8]. Worker 1 runs requests (b, b + 3) and (b + 1, b + 4), so it decodes to the end of
the rollout. Worker 0 runs (b, b + 0.5) and (b + 1, b + 1 + 0.25 * step): idle in (b + 0.5, b + 1) and
from its last finish to b + 4 while worker 1 still works, so its worker bubble ratio is
(3 - 0.25 * step) / (2 workers * 4 s).
"""

from __future__ import annotations

import json
from html.parser import HTMLParser
from pathlib import Path

import pytest

from megatron_sortedrl.cli import main
from megatron_sortedrl.metrics import MetricsWriter
from megatron_sortedrl.telemetry.run_report import (
    GANTT_STEPS, idle_while_others_busy, staleness_totals, write_run_report)
from megatron_sortedrl.telemetry.timeline import (
    TimelineWriter, read_run_timeline, request_intervals, rollout_bubble_by_step)

STEPS = 4
HIST = {1: {"0": 6, "1": 2}, 2: {"0": 5, "2": 3}, 3: {}, 4: {"1": 4, "3": 1}}  # rollout/staleness_hist per step
FIGURES = ("rewards", "step_breakdown", "rollout_gantt", "rollout_bubbles", "draft_acceptance", "tokens_per_forward",
           "staleness")


def requests(step: int) -> dict[int, list[tuple[float, float]]]:
    b = 10.0 * (step - 1)
    return {0: [(b, b + 0.5), (b + 1, b + 1 + 0.25 * step)], 1: [(b, b + 3), (b + 1, b + 4)]}


def write_timeline(run: Path) -> None:
    with TimelineWriter(run / "timeline.jsonl") as tl:
        for s in range(1, STEPS + 1):
            b = 10.0 * (s - 1)
            tl.record("phase", "start", s, t=b, phase="rollout")
            edges = []
            for w, ivs in requests(s).items():
                for i, (a, z) in enumerate(ivs):
                    edges += [(a, "submit", w, f"s{s}p{i}"), (z, "finish", w, f"s{s}p{i}")]
            for t, ev, w, sid in sorted(edges):
                tl.record("request", ev, s, t=t, worker=w, sample_id=sid, tokens=10)
            for name, a, z in (("rollout", None, b + 4), ("train", b + 4, b + 7), ("sync", b + 7, b + 8)):
                if a is not None:
                    tl.record("phase", "start", s, t=a, phase=name)
                tl.record("phase", "end", s, t=z, phase=name)


def write_metrics(run: Path, spec: bool = True, hist: bool = True, steps: int = STEPS, final: bool = True,
                  tools: bool = False) -> None:
    m = MetricsWriter(run, tensorboard=False)
    m.log(0, {"eval/accuracy": 0.20})
    for s in range(1, steps + 1):
        row = {"reward/mean": 0.1 * s, "reward/accuracy": 0.1 * s, "reward/errors_total": 1, "reward/timeouts_total": s,
               "rollout/samples": 8, "rollout/response_len": 100.0 + s, "rollout/tokens_per_s": 500.0,
               "rollout/bubble_ratio": 0.5, "rollout/staleness_mean": 0.5, "policy/version": s, "time/step_s": 10.0,
               "train/loss": 1.0 / s, "sync/seconds": 1.0}
        if hist:
            row["rollout/staleness_hist"] = HIST[s]
        if spec:
            row.update({"spec/mean_accepted_length": 2.0 + 0.1 * s, "spec/acceptance_rate": 0.6,
                        "spec/tokens_per_forward": 3.0})
            long = s % 3 == 0  # every third round is a long one: 4 tokens per forward there, 2 elsewhere
            row.update({"spec/round_long": float(long), "spec/step/tokens": 100.0,
                        "spec/step/target_forwards": 25.0 if long else 50.0,
                        "spec/step/tokens_per_forward": 4.0 if long else 2.0, "spec/step/accepted_tokens": 50.0})
        if tools:  # 8 trajectories per step: s + 4 tool calls, s - 1 of them timed out
            row.update({"tools/calls": float(s + 4), "tools/errors": float(s - 1), "tools/errors_timeout": float(s - 1),
                        "tools/turns_per_trajectory": 1.5 + 0.1 * s, "tools/calling_share": 0.5,
                        "tools/seconds": 0.2 * s})
        m.log(s, row)
        if s == 2:
            m.log(s, {"eval/accuracy": 0.30})
    if final:
        m.log(steps, {"eval/accuracy": 0.45})
    m.close()


@pytest.fixture(scope="module")
def full_run(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("run")
    write_metrics(run)
    write_timeline(run)
    (run / "summary.json").write_text(json.dumps({"steps": STEPS, "policy_version": STEPS, "accuracy_before_rl": 0.20,
                                                  "accuracy_after_rl": 0.45, "wall_s": 95.0, "reward_errors": 1,
                                                  "reward_timeouts": STEPS}))
    return run


@pytest.fixture(scope="module")
def page(full_run) -> str:
    path = write_run_report(full_run)
    assert path == full_run / "report" / "report.html"
    return path.read_text()


class Tables(HTMLParser):
    """The report's tables by id, as lists of rows of cell texts (header row first)."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.tables: dict[str, list[list[str]]] = {}
        self._id: str | None = None
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        if tag == "table":
            self._id = dict(attrs).get("id")
            self.tables[self._id] = []
        elif tag == "tr" and self._id:
            self.tables[self._id].append([])
        elif tag in ("td", "th") and self._id:
            self.tables[self._id][-1].append("")

    def handle_endtag(self, tag):
        if tag == "table":
            self._id = None

    def handle_data(self, data):
        if self._id and self.tables[self._id] and self.tables[self._id][-1]:
            self.tables[self._id][-1][-1] += data


def column(table: list[list[str]], name: str) -> dict[int, str]:
    i = table[0].index(name)
    return {int(r[0]): r[i] for r in table[1:]}


def test_page_is_self_contained_and_embeds_every_figure(full_run, page):
    assert page.count("data:image/png;base64,") == len(FIGURES)
    for name in FIGURES:
        assert f'alt="{name}"' in page
        assert (full_run / "report" / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "class='note'" not in page  # nothing is missing in a finished run with a timeline


def test_bubble_ratios_in_the_table_are_the_timeline_ones(full_run, page):
    from_timeline = rollout_bubble_by_step(read_run_timeline(full_run))
    printed = column(Tables(page).tables["steps"], "worker bubble")
    assert set(printed) == set(from_timeline) == set(range(1, STEPS + 1))
    for s, row in from_timeline.items():
        assert row["worker_bubble"] == pytest.approx((3 - 0.25 * s) / 8)  # the hand computation
        assert printed[s] == f"{row['worker_bubble']:.3f}"  # the table prints 3 decimals


def test_bubble_shading_is_idle_time_while_another_worker_runs(full_run):
    events = read_run_timeline(full_run)
    for s in range(1, STEPS + 1):
        b = 10.0 * (s - 1)
        per_worker = request_intervals(events, s)
        assert per_worker == {w: sorted(iv) for w, iv in requests(s).items()}
        gaps = idle_while_others_busy(per_worker, b, b + 4)
        assert gaps[0] == [(b + 0.5, b + 1), (b + 1 + 0.25 * s, b + 4)]  # exact in binary floating point
        assert gaps[1] == []
    # Nobody else working means no bubble, and an open request runs to the end of the phase.
    assert idle_while_others_busy({0: [(0.0, 1.0)], 1: [(2.0, float("inf"))]}, 0.0, 4.0) == \
        {0: [(2.0, 4.0)], 1: [(0.0, 1.0)]}


def test_staleness_totals_sum_the_per_step_histograms(full_run, page):
    expected = {0: 11, 1: 6, 2: 3, 3: 1}
    assert staleness_totals([{"rollout/staleness_hist": h} for h in HIST.values()]) == expected
    table = Tables(page).tables["staleness"]
    assert {int(k): int(v) for k, v in table[1:]} == expected


def test_summary_and_long_run_gantt_caption(page):
    summary = dict(Tables(page).tables["summary"][1:])
    assert summary["RL steps"] == str(STEPS) and summary["status"] == "finished"
    assert summary["eval accuracy before RL"] == "0.200" and summary["eval accuracy after RL"] == "0.450"
    assert summary["reward errors / timeouts"] == f"1 / {STEPS}"
    assert summary["speculative decoding"].startswith("on")
    assert GANTT_STEPS < STEPS and f"the last {GANTT_STEPS} of {STEPS} steps" in page
    evals = column(Tables(page).tables["steps"], "eval accuracy")
    assert evals[2] == "0.300" and evals[STEPS] == "0.450"


def test_tokens_per_forward_per_round_kind(page):
    steps = range(1, STEPS + 1)
    n_long = sum(1 for s in steps if s % 3 == 0)
    want = 100.0 * STEPS / (25.0 * n_long + 50.0 * (STEPS - n_long))
    summary = dict(Tables(page).tables["summary"][1:])
    assert summary["tokens per target forward (short / long rounds)"] == f"{want:.2f} (2.00 / 4.00)"


def test_killed_run_without_timeline_summary_or_spec(tmp_path):
    write_metrics(tmp_path, spec=False, hist=False, steps=2, final=False)
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "reward/me')  # killed mid-write
    text = write_run_report(tmp_path).read_text()
    assert "No timeline" in text and "No summary.json" in text and "skipped 1 malformed line" in text
    assert "Speculative decoding was off" in text and "No staleness histogram" in text
    # The bubble figure falls back to the driver's per-step value in metrics.jsonl.
    assert set(column(Tables(text).tables["steps"], "worker bubble").values()) == {"0.500"}
    summary = dict(Tables(text).tables["summary"][1:])
    assert summary["status"].startswith("not finished") and summary["eval accuracy after RL"].startswith("not evaluated")


def test_zero_steps_and_no_metrics_render_a_page_that_says_so(tmp_path):
    write_metrics(tmp_path / "zero", steps=0, final=False)
    text = write_run_report(tmp_path / "zero").read_text()
    assert "No training step" in text and 'alt="rewards"' in text  # the step-0 evaluation is still drawn
    (tmp_path / "empty").mkdir()
    text = write_run_report(tmp_path / "empty", tmp_path / "out").read_text()
    assert "No metrics.jsonl" in text and "data:image/png" not in text


def test_cli_prints_the_path_and_rejects_a_bad_dir_in_one_line(full_run, tmp_path, capsys):
    assert main(["report", str(full_run), "-o", str(tmp_path / "rep")]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "rep" / "report.html")
    for bad, message in ((tmp_path / "missing", "is not a directory"), (tmp_path, "has no metrics.jsonl")):
        assert main(["report", str(bad)]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1


def test_tools_section_totals_and_per_step_columns(tmp_path):
    """A multi-turn run: the Tools section's totals are the sums of the steps' tools/* and the per-step table
    carries them; a run without tools/* has no Tools section (the page above)."""
    write_metrics(tmp_path, spec=False, steps=3, tools=True)
    text = write_run_report(tmp_path).read_text()
    assert "<h2>Tools</h2>" in text and (tmp_path / "report" / "tools.png").is_file()
    # 5 + 6 + 7 = 18 calls over 24 trajectories; 0 + 1 + 2 = 3 errors
    assert "18 tool calls, 0.75 per trajectory; 3 errors, 0.167 per call." in text
    steps = Tables(text).tables["steps"]
    assert column(steps, "tool calls") == {1: "5", 2: "6", 3: "7"}
    assert column(steps, "tool s crit. path") == {1: "0.20", 2: "0.40", 3: "0.60"}


def test_no_tools_section_without_tool_metrics(page):
    assert "<h2>Tools</h2>" not in page and "tool calls" not in page
