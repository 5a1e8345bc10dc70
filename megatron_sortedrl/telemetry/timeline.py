"""The run timeline: one append-only JSON-lines event format, its writer, its reader, and the metrics of
DESIGN section 4 computed from it (worker bubble ratio, slot bubble ratio, driver idle, step-time breakdown).

One line is one event, for example::

    {"t": 12.503, "kind": "request", "event": "finish", "step": 3, "worker": 1, "sample_id": "p17/2", "tokens": 812}
    {"t": 30.118, "kind": "phase", "event": "end", "step": 3, "phase": "rollout"}
    {"t": 30.120, "kind": "worker", "event": "idle", "step": 3, "worker": 1}

Fields: `t` float seconds on the run clock (see `RunClock`), `kind` ("request" | "phase" | "worker"),
`event` (request: submit | first_token | finish | abort | tool_call | tool_result; phase: start | end; worker:
busy | idle; a trajectory's turn is one submit..finish request, its tool wait runs from tool_call to tool_result),
`step` (int, training step), and the optional `worker` (int, rollout worker index), `sample_id` (str),
`tokens` (int, response tokens so far / in total; at `first_token`: the tokens that exist once decoding
starts, i.e. those the request was submitted with plus the one a real engine's prefill step samples; the
simulator decodes every token, so there it is the submitted count), `phase` (str, one of `PHASES` for phase events),
`layout` (str, on rollout phase starts and `relayout` phases: the engine layout, e.g. "2xTP1"), `detail` (str,
on colocated transitions: what moved, e.g. "weights" or "kv_cache" on a `wake`) and `bytes` (int, on the end
of a colocated transition: the bytes it moved or freed; see docs/cluster.md, "Colocated").

Each process writes its own file (`timeline.jsonl` for the driver, `timeline.<name>.jsonl` for workers);
`read_run_timeline(run_dir)` merges them by time. The metric functions also come as pure functions over
plain numbers (`*_from_*`) so the scheduler simulator can call them without building events.

Run the module's tests with `python -m pytest tests/test_telemetry_timeline.py -q`.
Left out: clock synchronisation between nodes (the run clock is wall time minus a run epoch, so nodes
rely on NTP; sub-millisecond alignment across nodes is not attempted), and compression or rotation of
large timelines.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Iterable, Sequence

from megatron_sortedrl.errors import UserError

KINDS: dict[str, tuple[str, ...]] = {
    # tool_call / tool_result: a trajectory's turn handed its calls to the tools / got their answers (no worker)
    "request": ("submit", "first_token", "finish", "abort", "tool_call", "tool_result"),
    "phase": ("start", "end"),
    "worker": ("busy", "idle"),
}
# Phase names the driver uses; readers accept others too (a user's custom phase is still time spent).
PHASES: tuple[str, ...] = ("rollout", "reward", "logprob", "train", "sync", "history", "checkpoint", "eval", "relayout",
                           # colocated layout (megatron_sortedrl/colocate/): the transitions between rollout and update
                           "sleep", "wake", "offload", "reload", "handoff")
TIMELINE_GLOB = "timeline*.jsonl"


class TimelineError(UserError):
    """A timeline file has a malformed line (the message names file and line number)."""


@dataclass(frozen=True)
class Event:
    """One timeline event; `None` optional fields are left out of the JSON line."""

    t: float  # seconds on the run clock
    kind: str  # "request" | "phase" | "worker"
    event: str  # see KINDS[kind]
    step: int  # training step the event belongs to
    worker: int | None = None  # rollout worker index (request and worker events)
    sample_id: str | None = None  # request events: the Sample's id
    tokens: int | None = None  # request events: response tokens generated so far (finish: in total)
    phase: str | None = None  # phase events: one of PHASES
    layout: str | None = None  # rollout start and relayout events: the engine layout, e.g. "2xTP1" (engines x TP)
    detail: str | None = None  # colocated transitions: what moved ("weights", "kv_cache", "trainer state")
    bytes: int | None = None  # end of a colocated transition: bytes moved or freed

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind={self.kind!r}; expected one of {sorted(KINDS)}")
        if self.event not in KINDS[self.kind]:
            raise ValueError(f"event={self.event!r} for kind {self.kind!r}; expected one of {KINDS[self.kind]}")
        if self.kind == "phase" and not self.phase:
            raise ValueError("phase events need a phase name")

    def to_json(self) -> str:
        return json.dumps({k: v for k, v in asdict(self).items() if v is not None}, separators=(",", ":"))

    @classmethod
    def from_json(cls, line: str) -> Event:
        obj = json.loads(line)
        if not isinstance(obj, dict):
            raise ValueError("not a JSON object")
        unknown = set(obj) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown field(s) {sorted(unknown)}")
        for key in ("t", "kind", "event", "step"):
            if key not in obj:
                raise ValueError(f"missing field {key!r}")
        return cls(
            t=float(obj["t"]), kind=obj["kind"], event=obj["event"], step=int(obj["step"]),
            worker=None if obj.get("worker") is None else int(obj["worker"]),
            sample_id=None if obj.get("sample_id") is None else str(obj["sample_id"]),
            tokens=None if obj.get("tokens") is None else int(obj["tokens"]),
            phase=obj.get("phase"),
            layout=None if obj.get("layout") is None else str(obj["layout"]),
            detail=None if obj.get("detail") is None else str(obj["detail"]),
            bytes=None if obj.get("bytes") is None else int(obj["bytes"]),
        )


class RunClock:
    """Seconds since the run's epoch (a Unix time chosen by the driver and passed to every process).

    Wall time rather than a monotonic clock because the driver, the rollout workers and the NVML samplers
    on other nodes must agree on one time axis; monotonic clocks are per boot.
    """

    def __init__(self, epoch: float | None = None) -> None:
        self.epoch = time.time() if epoch is None else float(epoch)

    def now(self) -> float:
        return time.time() - self.epoch


class TimelineWriter:
    """Appends events to one JSON-lines file; safe to share between threads of one process.

    Use one writer (one file) per process: the reader merges files, and concurrent appends from several
    processes to one file are only atomic on local file systems.
    """

    def __init__(self, path: str | os.PathLike, clock: RunClock | None = None) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.clock = clock or RunClock()
        # Line-buffered so that a crashed run still leaves every event it recorded on disk.
        self._file: IO[str] | None = open(self.path, "a", buffering=1, encoding="utf-8")
        self._lock = threading.Lock()

    def write(self, event: Event) -> None:
        line = event.to_json() + "\n"
        with self._lock:
            if self._file is None:
                raise ValueError(f"timeline {self.path} is closed")
            self._file.write(line)

    def record(self, kind: str, event: str, step: int, t: float | None = None, **fields: object) -> Event:
        """Build an event stamped with the run clock (unless `t` is given), write it and return it."""
        ev = Event(t=self.clock.now() if t is None else t, kind=kind, event=event, step=step, **fields)  # type: ignore[arg-type]
        self.write(ev)
        return ev

    def flush(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.flush()

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None

    def __enter__(self) -> TimelineWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_timeline(path: str | os.PathLike) -> list[Event]:
    """All events of one file, in file order; a malformed line raises `TimelineError` naming file:line."""
    events = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                events.append(Event.from_json(line))
            except (ValueError, TypeError) as exc:
                raise TimelineError(f"{path}:{lineno}: malformed timeline event ({exc}): {line.strip()[:200]}") from None
    return events


def read_run_timeline(run_dir: str | os.PathLike) -> list[Event]:
    """Every `timeline*.jsonl` of a run directory merged and sorted by time (stable within a file)."""
    events: list[Event] = []
    for path in sorted(Path(run_dir).glob(TIMELINE_GLOB)):
        events.extend(read_timeline(path))
    events.sort(key=lambda e: e.t)
    return events


# ----------------------------------------------------------------------------------------------------
# Metrics, pure versions: plain numbers in, one float out.


def worker_bubble_ratio_from_times(last_finish: Sequence[float], t_start: float, t_end: float) -> float:
    """`sum_w (T_end - t_last_w) / (W * (T_end - T_start))`; `last_finish[w]` is clipped into the phase."""
    span = t_end - t_start
    if not last_finish or span <= 0:
        return 0.0
    idle = sum(t_end - min(max(t, t_start), t_end) for t in last_finish)
    return idle / (len(last_finish) * span)


def active_integral(intervals: Iterable[tuple[float, float]], t_start: float, t_end: float) -> float:
    """Integral over [t_start, t_end] of the number of open intervals (sequence-seconds)."""
    return sum(max(0.0, min(b, t_end) - max(a, t_start)) for a, b in intervals)


def slot_bubble_ratio_from_intervals(
    intervals: Iterable[tuple[float, float]], capacity: int, t_start: float, t_end: float
) -> float:
    """`1 - integral(active dt) / (capacity * (T_end - T_start))`, `capacity` = total slots of all engines.

    `intervals` are (submit, finish-or-abort) times of the requests; a request waiting in an engine's queue
    counts as active, so with more submitted requests than slots the ratio can go negative. That is
    reported as is: it means the engines were oversubscribed, not that they idled.
    """
    span = t_end - t_start
    if capacity <= 0 or span <= 0:
        return 0.0
    return 1.0 - active_integral(intervals, t_start, t_end) / (capacity * span)


# ----------------------------------------------------------------------------------------------------
# Metrics over events.


def phase_window(events: Sequence[Event], step: int, phase: str = "rollout",
                 t_last: float | None = None) -> tuple[float, float] | None:
    """(first start, last end) of `phase` in `step`; an unterminated phase ends at `t_last` (default: the
    last event's time)."""
    starts = [e.t for e in events if e.kind == "phase" and e.phase == phase and e.step == step and e.event == "start"]
    ends = [e.t for e in events if e.kind == "phase" and e.phase == phase and e.step == step and e.event == "end"]
    if not starts:
        return None
    if ends:
        return min(starts), max(ends)
    return min(starts), max(e.t for e in events) if t_last is None else t_last


def request_intervals(events: Sequence[Event], step: int) -> dict[int, list[tuple[float, float]]]:
    """Per worker, the (submit, finish-or-abort) times of the requests of `step`.

    Requests are matched by `sample_id` (and worker); a request with no finish or abort stays open
    (end = +inf) and so is active until the phase ends. Requests without a worker are ignored.
    """
    open_: dict[tuple[int, str | None], list[float]] = defaultdict(list)
    out: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for e in sorted((e for e in events if e.kind == "request" and e.step == step and e.worker is not None),
                    key=lambda e: e.t):
        key = (e.worker, e.sample_id)
        if e.event == "submit":
            open_[key].append(e.t)
        elif e.event in ("finish", "abort"):
            start = open_[key].pop(0) if open_[key] else e.t
            out[e.worker].append((start, e.t))  # type: ignore[index]
    for (worker, _), starts in open_.items():
        out[worker].extend((s, float("inf")) for s in starts)
    return dict(out)


def _rollout_figures(events: Sequence[Event], step: int | None) -> dict[int, tuple[float, float, dict]]:
    """Per step with a rollout phase (or only `step`): (T_start, T_end, request intervals per worker).
    Events are grouped by step once, so pooling over many steps stays linear in the number of events."""
    if not events:
        return {}
    t_last = max(e.t for e in events)
    by_step: dict[int, list[Event]] = defaultdict(list)
    for e in events:
        if step is None or e.step == step:
            by_step[e.step].append(e)
    out = {}
    for s, evs in sorted(by_step.items()):
        window = phase_window(evs, s, "rollout", t_last)
        if window is not None:
            out[s] = (window[0], window[1], request_intervals(evs, s))
    return out


def worker_bubble_ratio(events: Sequence[Event], step: int | None = None) -> float:
    """Worker bubble ratio of the rollout phase of `step` (DESIGN section 4).

    T_start/T_end are the rollout phase's start and end in that step; the workers are those that got at
    least one request of that step; `t_last_w` is the last finish or abort on worker w (T_end if one of
    its requests is still open). With `step=None` the ratio covers every step with a rollout phase, each
    weighted by its W * (T_end - T_start): total idle worker-seconds over total worker-seconds.
    """
    idle = total = 0.0
    for t0, t1, per_worker in _rollout_figures(events, step).values():
        if not per_worker or t1 <= t0:
            continue
        last = [max(b for _, b in iv) for iv in per_worker.values()]
        idle += worker_bubble_ratio_from_times(last, t0, t1) * len(last) * (t1 - t0)
        total += len(last) * (t1 - t0)
    return idle / total if total > 0 else 0.0


def driver_idle_from_intervals(per_worker: dict[int, list[tuple[float, float]]], t_start: float,
                               t_end: float) -> dict[int, float]:
    """Seconds each worker spends with no request in flight for reasons on the driver's side.

    A worker's empty stretch inside [t_start, t_end] counts when the driver still owed it something:
    - it ends with a new submission to that worker (work remained: the driver fed it late), including
      the stretch from t_start to its first submission;
    - or it lies after the last request of the phase ended on every worker (the round is done and only the
      harvest, scoring and phase end are pending).
    An empty stretch while other workers still generate and nothing more comes to this one is the tail
    bubble (`worker_bubble_ratio`), not driver idle. Pure function of the intervals, for the simulator too.
    """
    ends = [b for iv in per_worker.values() for _, b in iv]
    all_done = min(max(ends), t_end) if ends else t_start
    out: dict[int, float] = {}
    for w, iv in per_worker.items():
        idle, covered = 0.0, t_start  # `covered`: the end of the busy span seen so far
        for a, b in sorted(iv):
            a, b = max(a, t_start), min(b, t_end)
            if a > covered:
                idle += a - covered  # an empty stretch that a later submission ended
            covered = max(covered, b)
        if covered < t_end:
            idle += t_end - max(covered, all_done)  # after everything ended: the harvest is pending
        out[w] = idle
    return out


def driver_idle(events: Sequence[Event], step: int | None = None) -> tuple[float, float]:
    """(driver-idle worker-seconds, worker-seconds) of the rollout phase of `step` (or every step), with the
    workers and window of `worker_bubble_ratio`; their quotient is the share of rollout capacity lost
    waiting on the driver (`driver_idle_from_intervals` says what counts)."""
    idle = total = 0.0
    for t0, t1, per_worker in _rollout_figures(events, step).values():
        if not per_worker or t1 <= t0:
            continue
        idle += sum(driver_idle_from_intervals(per_worker, t0, t1).values())
        total += len(per_worker) * (t1 - t0)
    return idle, total


def slot_bubble_ratio(events: Sequence[Event], max_batch: int, step: int | None = None,
                      num_workers: int | None = None) -> float:
    """Slot bubble ratio of the rollout phase of `step` (DESIGN section 4).

    Exact definition: `1 - sum_w integral_{T_start}^{T_end} active_w(t) dt / (max_batch * W * (T_end - T_start))`
    where `max_batch` is ONE engine's capacity (vLLM `max_num_seqs`), W is `num_workers` or, if not given,
    the number of workers that got requests of that step, and `active_w(t)` counts requests of that step on
    worker w submitted at or before t and not yet finished or aborted. `step=None` pools every step with a
    rollout phase (slot-seconds weighted), like `worker_bubble_ratio`.
    """
    busy = total = 0.0
    for t0, t1, per_worker in _rollout_figures(events, step).values():
        w = num_workers if num_workers is not None else len(per_worker)
        if w <= 0 or t1 <= t0:
            continue
        busy += sum(active_integral(iv, t0, t1) for iv in per_worker.values())
        total += max_batch * w * (t1 - t0)
    return 1.0 - busy / total if total > 0 else 0.0


def union_length(intervals: Iterable[tuple[float, float]], t_start: float, t_end: float) -> float:
    """Length of the union of intervals clipped to [t_start, t_end]."""
    covered, cursor = 0.0, t_start
    for a, b in sorted((max(a, t_start), min(b, t_end)) for a, b in intervals):
        if b <= cursor:
            continue
        covered += b - max(a, cursor)
        cursor = b
    return covered


def phase_intervals(events: Sequence[Event]) -> list[tuple[int, str, float, float]]:
    """(step, phase, start, end) for every phase occurrence; starts and ends pair up in order per
    (step, phase); an unterminated phase ends at the last event's time (a crashed or running run)."""
    open_: dict[tuple[int, str], list[float]] = defaultdict(list)
    out: list[tuple[int, str, float, float]] = []
    for e in sorted((e for e in events if e.kind == "phase"), key=lambda e: e.t):
        key = (e.step, e.phase or "")
        if e.event == "start":
            open_[key].append(e.t)
        elif open_[key]:
            out.append((e.step, key[1], open_[key].pop(0), e.t))
    t_last = max((e.t for e in events), default=0.0)
    out.extend((s, p, t, t_last) for (s, p), starts in open_.items() for t in starts)
    out.sort(key=lambda r: (r[2], r[0]))
    return out


def step_windows(events: Sequence[Event]) -> dict[int, tuple[float, float]]:
    """Wall-clock window of each step: from its first phase start to its last phase end or, if later,
    the next step's first phase start (so the gap between two steps is charged to the earlier one)."""
    spans: dict[int, list[float]] = {}
    for step, _, a, b in phase_intervals(events):
        lo, hi = spans.get(step, [a, b])
        spans[step] = [min(lo, a), max(hi, b)]
    steps = sorted(spans)
    out = {}
    for i, s in enumerate(steps):
        start, end = spans[s]
        if i + 1 < len(steps):
            end = max(end, spans[steps[i + 1]][0])
        out[s] = (start, end)
    return out


def step_breakdown(events: Sequence[Event]) -> dict[int, dict[str, float]]:
    """Seconds per phase per step, plus "idle": the step's wall time (`step_windows`) covered by no
    phase of any step. Phases of different steps may overlap (asynchronous rollout), so the phase seconds
    of a step can sum to more than its wall time; "idle" is never negative."""
    intervals = phase_intervals(events)
    windows = step_windows(events)
    out: dict[int, dict[str, float]] = {}
    for step, (start, end) in windows.items():
        row: dict[str, float] = defaultdict(float)
        for s, phase, a, b in intervals:
            if s == step:
                row[phase] += b - a
        covered = union_length([(a, b) for _, _, a, b in intervals], start, end)
        row["idle"] = max(0.0, (end - start) - covered)
        out[step] = dict(row)
    return out


def rollout_bubble_by_step(events: Sequence[Event], max_batch: int | None = None) -> dict[int, dict[str, float]]:
    """Per step with a rollout phase: its duration, worker bubble ratio, driver-idle share (`driver_idle`) and
    (given `max_batch`) slot bubble ratio. This is the table the report plots."""
    out = {}
    for s, (t0, t1, per_worker) in _rollout_figures(events, None).items():
        row = {"rollout_s": t1 - t0, "worker_bubble": 0.0, "driver_idle": 0.0}
        if per_worker and t1 > t0:
            last = [max(b for _, b in iv) for iv in per_worker.values()]
            row["worker_bubble"] = worker_bubble_ratio_from_times(last, t0, t1)
            idle = driver_idle_from_intervals(per_worker, t0, t1)
            row["driver_idle"] = sum(idle.values()) / (len(per_worker) * (t1 - t0))
        if max_batch:
            intervals = [iv for ivs in per_worker.values() for iv in ivs]
            row["slot_bubble"] = slot_bubble_ratio_from_intervals(intervals, max_batch * len(per_worker), t0, t1) \
                if per_worker else 0.0
        out[s] = row
    return out
