"""What an RL run writes and reads back around its loop: the resume point, the run's record files, the
per-step metrics row and its printed line, the summary, the run report, and the stop signals.

    resume = resume_point(cfg, ckpt_root)                    # per checkpoint.resume; None starts over
    records = RunRecords(cfg, run_dir, resumed_step=None)    # metrics.jsonl, timeline.jsonl, reward_failures.jsonl
    row = records.log_step(step, version, batch, ...)        # one metrics row, printed every log_interval steps
    restore = catch_stop_signals(on_signal)                  # SIGTERM/SIGUSR1 -> on_signal(name); restore() undoes

The driver (`driver.py`) keeps the phases of the algorithm; this module keeps the bookkeeping that is not
part of it. A resumed run drops the records of steps after its checkpoint (they run again), so every step
appears once in every file. Left out: what goes into a checkpoint's `extra` (the driver's `checkpoint`
phase decides that) and the contents of the run report (`telemetry/run_report.py`).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
from collections import Counter
from pathlib import Path
from typing import Any, Callable

from megatron_sortedrl.errors import CheckpointError
from megatron_sortedrl.metrics import METRICS_FILE, MetricsWriter
from megatron_sortedrl.sample import Sample
from megatron_sortedrl.telemetry.timeline import (
    RunClock, TimelineWriter, driver_idle, phase_intervals, worker_bubble_ratio)
from megatron_sortedrl.telemetry.trackers import open_trackers

RECORD_FILES = (METRICS_FILE, "timeline.jsonl", "reward_failures.jsonl")


def resume_point(cfg, ckpt_root: Path) -> Path | None:
    """The checkpoint to continue from, per `checkpoint.resume` (see its help)."""
    from megatron_sortedrl.trainer.checkpoint import find_latest_checkpoint, is_complete

    mode = cfg.checkpoint.resume
    if mode == "never":
        return None
    if mode in ("auto", "required"):
        latest = find_latest_checkpoint(ckpt_root)
        if latest is None and mode == "required":
            raise CheckpointError(f"checkpoint.resume=required but {ckpt_root} holds no complete checkpoint; "
                                  "use checkpoint.resume=auto to start a new run there")
        return latest
    given = Path(mode)
    if is_complete(given):
        return given
    latest = find_latest_checkpoint(given) or find_latest_checkpoint(given / "checkpoints")
    if latest is None:
        raise CheckpointError(f"checkpoint.resume={mode}: no complete checkpoint there (a checkpoint directory "
                              "holds COMPLETE.json; a run directory holds checkpoints/iter_*)")
    return latest


class RunRecords:
    """The run directory's record files, opened for a new run or trimmed to `resumed_step` for a resumed one."""

    def __init__(self, cfg, run_dir: Path, resumed_step: int | None, clock_epoch: float | None,
                 printer: Callable[[str], None] = print) -> None:
        from megatron_sortedrl.config import to_dict, to_yaml

        self.cfg, self.run_dir, self.say = cfg, run_dir, printer
        resumed = resumed_step is not None
        for name in RECORD_FILES:
            path = run_dir / name
            if not resumed:
                path.unlink(missing_ok=True)
            elif path.exists():
                keep_rows(path, lambda row: int(row.get("step", 0)) <= resumed_step)
        if not resumed:
            shutil.rmtree(run_dir / "tensorboard", ignore_errors=True)
            (run_dir / "summary.json").unlink(missing_ok=True)
        self.clock = RunClock(clock_epoch)
        self.timeline = TimelineWriter(run_dir / "timeline.jsonl", self.clock)
        # TensorBoard, wandb, MLflow as logging.* selects; a resumed run continues their runs
        self.metrics = MetricsWriter(run_dir, trackers=open_trackers(cfg.logging, run_dir, to_dict(cfg), cfg.name,
                                                                     resumed_step))
        self._reward_fail_log = open(run_dir / "reward_failures.jsonl", "a", buffering=1, encoding="utf-8")
        self._failures_seen = 0
        (run_dir / "config.yaml").write_text(to_yaml(cfg))

    def log_step(self, step: int, version: int, step_s: float, batch: list[Sample], harvest_stats: dict,
                 events: list, rewards, *parts: dict) -> dict[str, Any]:
        """Writes the step's metrics row (and its reward failures); prints it every `logging.log_interval` steps."""
        scores = [s.reward or 0.0 for s in batch]
        tokens = sum(s.generated_length for s in batch)  # sampled tokens (a trajectory's tool tokens left out)
        for sid, err in rewards.failures[self._failures_seen:]:
            self._reward_fail_log.write(json.dumps({"step": step, "sample_id": sid, "error": err}) + "\n")
        self._failures_seen = len(rewards.failures)
        stale = harvest_stats.get("staleness", [])
        hist = {str(k): v for k, v in sorted(Counter(stale).items())}
        row = {"reward/mean": sum(scores) / max(1, len(scores)),
               "reward/accuracy": sum(r >= 1.0 for r in scores) / max(1, len(scores)),
               "reward/errors_total": rewards.stats["errors"], "reward/timeouts_total": rewards.stats["timeouts"],
               "reward/per_sample": {s.sample_id: s.reward for s in batch},
               "rollout/samples": len(batch), "rollout/response_len": tokens / max(1, len(batch)),
               "rollout/tokens_per_s": tokens / max(step_s, 1e-9), "rollout/bubble_ratio": _bubble(events, step),
               **_driver_idle(events, step), **_phase_seconds(events, step),
               "rollout/staleness_mean": sum(stale) / max(1, len(stale)), "rollout/staleness_hist": hist,
               "policy/version": version,
               "time/step_s": step_s,
               # the policy's own per-round decision log (twotier: prompts carried in/out, harvest target)
               **{f"scheduler/{k}": v for k, v in harvest_stats.get("decision", {}).items()}}
        row.update(_routes(batch))
        for part in parts:
            row.update(part)
        row = self.metrics.log(step, row)
        if step % max(1, self.cfg.logging.log_interval) == 0:
            spec = row.get("spec/mean_accepted_length")
            self.say(f"step {step}: reward {row['reward/mean']:.3f} acc {row['reward/accuracy']:.2f} "
                     f"len {row['rollout/response_len']:.0f} tok/s {row['rollout/tokens_per_s']:.0f} "
                     f"bubble {row['rollout/bubble_ratio']:.2f}"
                     + (f" draft-accept {spec:.2f}" if spec is not None else "")
                     + f" ({step_s:.1f}s, v{version})")
        return row

    def write_summary(self, summary: dict[str, Any]) -> dict[str, Any]:
        tmp = self.run_dir / "summary.json.tmp"
        tmp.write_text(json.dumps(summary, indent=2))
        os.replace(tmp, self.run_dir / "summary.json")
        return summary

    def write_report(self) -> Path | None:
        """The HTML run report; a failure to render it is reported and never fails the run."""
        try:
            from megatron_sortedrl.telemetry.run_report import write_run_report

            self.timeline.flush()
            path = write_run_report(self.run_dir)
            self.say(f"run report: {path}")
            return path
        except Exception as exc:
            self.say(f"warning: the run report was not written ({type(exc).__name__}: {exc}); "
                     f"retry with: python -m megatron_sortedrl report {self.run_dir}")
            return None

    def closers(self) -> list[Callable[[], None]]:
        return [self.timeline.close, self.metrics.close, self._reward_fail_log.close]


def _routes(batch: list[Sample]) -> dict[str, float]:
    """MoE routing replay: `rollout/routed_share` (samples of the update whose engine routes cover every input
    position) and `rollout/route_bytes` (what their routes hold); absent when no sample carries routes."""
    held = [s.routed_experts for s in batch if s.routed_experts is not None]
    if not held:
        return {}
    full = sum(s.routed_experts is not None
               and s.routed_experts.num_rows == len(s.prompt_tokens) + len(s.response_tokens) - 1 for s in batch)
    return {"rollout/routed_share": full / len(batch), "rollout/route_bytes": float(sum(len(r.data) for r in held))}


def _bubble(events: list, step: int) -> float:
    try:
        return float(worker_bubble_ratio(events, step))
    except Exception:  # a step without request events has no bubble to speak of
        return 0.0


def _driver_idle(events: list, step: int) -> dict[str, float]:
    """`rollout/driver_idle_s`: engine-seconds of the step's rollout with no request in flight for reasons on the
    driver's side (see `telemetry.timeline.driver_idle_from_intervals`); `_share`: of all engine-seconds."""
    idle, total = driver_idle(events, step)
    return {"rollout/driver_idle_s": idle, "rollout/driver_idle_share": idle / total if total > 0 else 0.0}


def _phase_seconds(events: list, step: int) -> dict[str, float]:
    """`time/<phase>_s` for each phase of the step (rollout, train, sync, history, ...): the fixed cost of an
    update is train + sync + history, paid once per update whatever the policy."""
    out: dict[str, float] = {}
    for s, name, a, b in phase_intervals(events):
        if s == step:
            out[f"time/{name}_s"] = out.get(f"time/{name}_s", 0.0) + (b - a)
    return out


def keep_rows(path: Path, keep: Callable[[dict], bool]) -> None:
    """Rewrites a JSON-lines file with the rows `keep` accepts (atomically; a torn last line is dropped)."""
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:  # the line a killed process was writing
            continue
        if keep(row):
            rows.append(line)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(r + "\n" for r in rows), encoding="utf-8")
    os.replace(tmp, path)


def catch_stop_signals(on_signal: Callable[[str], None]) -> Callable[[], None]:
    """SIGTERM and SIGUSR1 call `on_signal(name)` (the run checkpoints after its current step); returns the undo.
    Only the main thread can install handlers; elsewhere this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    old = {sig: signal.signal(sig, lambda signum, _frame: on_signal(signal.Signals(signum).name))
           for sig in (signal.SIGTERM, signal.SIGUSR1)}

    def restore() -> None:
        for sig, previous in old.items():
            signal.signal(sig, previous)

    return restore
