"""Run metrics: one JSON line per step in `<run_dir>/metrics.jsonl`, mirrored to the experiment trackers
(TensorBoard, wandb, MLflow: `telemetry/trackers.py`).

    m = MetricsWriter(run_dir, tensorboard=True)            # or trackers=open_trackers(cfg.logging, ...)
    m.log(step, {"reward/mean": 0.4, "time/step_s": 12.1})
    m.close()
    rows = read_metrics(run_dir)

Each line is `{"step": int, "t": seconds since the writer started, <name>: number, ...}`; names use `/`
groups as TensorBoard does. The file is appended and line-buffered, so a killed run keeps every step it
logged, and a resumed run continues the same file. Every numeric scalar of a row goes to every tracker;
TensorBoard is optional: without the `tensorboard` package the events are skipped with one note. Left out:
aggregation across ranks (the driver logs once).
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

from megatron_sortedrl.telemetry.trackers import Tracker, tensorboard_tracker

METRICS_FILE = "metrics.jsonl"


class MetricsWriter:
    def __init__(self, run_dir: str | Path, tensorboard: bool = True, purge_step: int | None = None,
                 trackers: list[Tracker] | None = None) -> None:
        """`trackers`: the sinks besides the jsonl file (`telemetry.trackers.open_trackers`); None: TensorBoard
        alone when `tensorboard`, with `purge_step` (a resumed run's first step) hiding the events at and after
        it that the interrupted run wrote (the jsonl file is trimmed by the caller)."""
        self.dir = Path(run_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._file = open(self.dir / METRICS_FILE, "a", buffering=1, encoding="utf-8")
        self._t0 = time.monotonic()
        if trackers is None:
            trackers = tensorboard_tracker(self.dir, purge_step) if tensorboard else []
        self.trackers = trackers

    def log(self, step: int, values: dict[str, Any]) -> dict[str, Any]:
        row: dict[str, Any] = {"step": int(step), "t": round(time.monotonic() - self._t0, 3)}
        for k, v in values.items():
            if isinstance(v, bool):
                v = int(v)
            if isinstance(v, (int, float)) and math.isfinite(float(v)):
                row[k] = v
            elif isinstance(v, (str, list, dict)):
                row[k] = v
        self._file.write(json.dumps(row) + "\n")
        scalars = {k: v for k, v in row.items() if k not in ("step", "t") and isinstance(v, (int, float))}
        for tracker in self.trackers:
            tracker.log(step, scalars)
        return row

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()
        trackers, self.trackers = self.trackers, []
        for tracker in trackers:
            tracker.close()


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / METRICS_FILE
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def read_jsonl(path: str | Path) -> tuple[list[Any], int]:
    """The rows of every whole line of a JSON-lines file, and how many lines did not parse (a process killed
    mid-write leaves a cut-off last line). A missing file has no rows."""
    path = Path(path)
    if not path.exists():
        return [], 0
    rows, bad = [], 0
    for line in filter(str.strip, path.read_text().splitlines()):
        try:
            rows.append(json.loads(line))
        except ValueError:
            bad += 1
    return rows, bad

