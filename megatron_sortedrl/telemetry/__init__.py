"""Telemetry: what a run's hardware did and where its time went.

- `timeline`: the append-only JSON-lines event log (requests, phases, workers) and the metrics of
  DESIGN section 4 computed from it (worker and slot bubble ratios, step-time breakdown).
- `nvml`: a background sampler of every visible NVIDIA GPU (SM utilization, memory, power, clocks,
  temperature) on the same clock as the timeline; without an NVIDIA driver it says so and does nothing.
- `nodes`: one sampler per GPU node of a Ray cluster, started by the driver.
- `utilization`: samples joined with phases (idle fraction per GPU and phase).
- `report`: the HTML utilization report (`python -m megatron_sortedrl nvml-report <run_dir>`).
- `run_report`: the RL run report: rewards, accuracy, step time, rollout Gantt with the bubble, draft
  acceptance, staleness (`python -m megatron_sortedrl report <run_dir>`; the driver writes it at the end).
- `record`: standalone sampling around any command (`python tools/nvml_record.py -- <command>`).
- `demo`: a synthetic run directory for trying the report without a GPU.
- `trackers`: the experiment trackers the per-step metrics go to (TensorBoard, wandb, MLflow).

Usage and definitions: docs/telemetry.md.

Left out: a metrics server or dashboard; everything is files in the run directory.
"""

from megatron_sortedrl.telemetry.timeline import (
    KINDS,
    PHASES,
    Event,
    RunClock,
    TimelineError,
    TimelineWriter,
    active_integral,
    driver_idle,
    driver_idle_from_intervals,
    phase_intervals,
    read_run_timeline,
    read_timeline,
    request_intervals,
    rollout_bubble_by_step,
    slot_bubble_ratio,
    slot_bubble_ratio_from_intervals,
    step_breakdown,
    step_windows,
    worker_bubble_ratio,
    worker_bubble_ratio_from_times,
)

__all__ = [
    "KINDS", "PHASES", "Event", "RunClock", "TimelineError", "TimelineWriter", "active_integral",
    "driver_idle", "driver_idle_from_intervals",
    "phase_intervals", "read_run_timeline", "read_timeline", "request_intervals", "rollout_bubble_by_step",
    "slot_bubble_ratio", "slot_bubble_ratio_from_intervals", "step_breakdown", "step_windows",
    "worker_bubble_ratio", "worker_bubble_ratio_from_times",
]
