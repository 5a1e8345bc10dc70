"""What the run report reads from a run directory: metrics rows, evaluations, the timeline and the summary.

    from megatron_sortedrl.telemetry.run_data import load_run
    run = load_run("runs/my_run")       # RunData: steps, evals, events, summary, notes

Nothing here raises for a killed or half-written run: each missing or malformed input becomes a note that the
report prints (`run_report.py`, which draws from this). Left out: any figure or page.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_sortedrl.errors import UserError
from megatron_sortedrl.metrics import METRICS_FILE, read_jsonl
from megatron_sortedrl.telemetry.timeline import Event, read_run_timeline


@dataclass
class RunData:
    """What the report reads from a run directory, and what it could not read (`notes`)."""

    run_dir: Path
    steps: dict[int, dict[str, Any]] = field(default_factory=dict)  # step -> its metrics row (the last one logged)
    evals: list[tuple[int, float]] = field(default_factory=list)  # (step, eval/accuracy) in logged order
    events: list[Event] = field(default_factory=list)
    summary: dict[str, Any] | None = None  # summary.json; None until the run finished
    notes: list[str] = field(default_factory=list)


def load_run(run_dir: str | os.PathLike) -> RunData:
    """Read metrics, timeline and summary; each missing or malformed input becomes a note, not an error."""
    run = RunData(Path(run_dir))
    rows = _read_metrics_tolerant(run)
    for row in rows:
        if "eval/accuracy" in row:
            run.evals.append((int(row["step"]), float(row["eval/accuracy"])))
        elif int(row.get("step", 0)) >= 1 and any(k not in ("step", "t") for k in row):
            # A resumed run continues the same file and may log a step again: the later row wins.
            run.steps[int(row["step"])] = row
    if not run.steps:
        run.notes.append(f"No training step in {METRICS_FILE}: the run stopped (or is) before its first step "
                         "ended, so there are no reward, bubble, acceptance or staleness figures from metrics.")
    try:
        run.events = read_run_timeline(run.run_dir)
    except UserError as exc:
        run.notes.append(f"Timeline unreadable, timeline figures left out: {exc}")
    if not run.events and not any("Timeline unreadable" in n for n in run.notes):
        run.notes.append("No timeline (timeline*.jsonl): the step-time breakdown and the rollout Gantt are left "
                         "out; bubble ratios come from metrics.jsonl where it has them.")
    path = run.run_dir / "summary.json"
    if path.exists():
        try:
            run.summary = json.loads(path.read_text())
        except ValueError as exc:
            run.notes.append(f"summary.json unreadable ({exc}); the summary uses metrics.jsonl instead.")
    else:
        run.notes.append("No summary.json: the run did not finish (killed, crashed or still running). The "
                         "summary below comes from metrics.jsonl up to the last step logged.")
    return run


def _read_metrics_tolerant(run: RunData) -> list[dict[str, Any]]:
    path = run.run_dir / METRICS_FILE
    if not path.exists():
        run.notes.append(f"No {METRICS_FILE} in {run.run_dir}: no rewards, accuracies or per-step metrics.")
        return []
    rows, bad = read_jsonl(path)
    if not bad:
        return rows
    # a run killed mid-write can leave a cut-off last line; keep every whole one
    run.notes.append(f"{METRICS_FILE}: skipped {bad} malformed line(s).")
    return [r for r in rows if isinstance(r, dict) and "step" in r]
