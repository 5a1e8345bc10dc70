"""Where GPU time went: NVML samples joined with the timeline's phases, as plain numbers for the report.

    from megatron_sortedrl.telemetry.utilization import phase_utilization
    table = phase_utilization(read_samples(run_dir / "nvml"), read_run_timeline(run_dir))

Definitions (the report and docs/telemetry.md use these):
- A sample belongs to every phase whose [start, end) contains its time (phases of different steps can
  overlap under asynchronous rollout), to the pseudo-phase "none" when no phase contains it, and always
  to the pseudo-phase "all". Without a timeline every sample is in "all" only.
- Idle fraction of a GPU in a phase = 1 - mean(util) / 100 over its samples in that phase. NVML's util
  is the share of each sample period in which a kernel ran, so this is the share of the phase's time in
  which the GPU ran no kernel at all.
- Seconds of a GPU in a phase = its sample count there times its median sampling interval.

Left out: weighting samples by unequal gaps (a sampler that stalled under load would under-count that
stretch; the sampler reports late ticks so the reader can judge).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from megatron_sortedrl.telemetry.nvml import Samples
from megatron_sortedrl.telemetry.timeline import Event, phase_intervals

GpuKey = tuple[str, int]  # (host, NVML index)


def gpu_label(key: GpuKey, single_host: bool) -> str:
    return f"GPU {key[1]}" if single_host else f"{key[0]}:{key[1]}"


def series(samples: Samples, field: str = "util") -> dict[GpuKey, tuple[np.ndarray, np.ndarray]]:
    """Per GPU, (times, values) of one field sorted by time; rows without the field are skipped."""
    acc: dict[GpuKey, list[tuple[float, float]]] = defaultdict(list)
    for r in samples.rows:
        if r.get(field) is not None:
            acc[(r["host"], int(r["gpu"]))].append((float(r["t"]), float(r[field])))
    out = {}
    for key, pairs in sorted(acc.items()):
        pairs.sort()
        arr = np.asarray(pairs, dtype=float)
        out[key] = (arr[:, 0], arr[:, 1])
    return out


def median_interval(times: np.ndarray) -> float:
    return float(np.median(np.diff(times))) if len(times) > 1 else 0.0


@dataclass
class PhaseUtil:
    """One GPU in one phase."""

    host: str
    gpu: int
    phase: str
    samples: int
    seconds: float
    mean_util: float
    idle_fraction: float
    mean_power_w: float | None
    mean_mem_used_mib: float | None


def phase_masks(times: np.ndarray, spans: Sequence[tuple[int, str, float, float]]) -> dict[str, np.ndarray]:
    """Boolean mask per phase name (plus "none" and "all") over sorted `times`, per the module's definitions."""
    masks: dict[str, np.ndarray] = {}
    any_phase = np.zeros(len(times), dtype=bool)
    # `times` is sorted, so each span is one slice: linear in samples plus spans, not their product.
    for _, phase, a, b in spans:
        lo, hi = np.searchsorted(times, [a, b], side="left")
        mask = masks.setdefault(phase, np.zeros(len(times), dtype=bool))
        mask[lo:hi] = True
        any_phase[lo:hi] = True
    if spans:
        masks["none"] = ~any_phase
    masks["all"] = np.ones(len(times), dtype=bool)
    return masks


def phase_utilization(samples: Samples, events: Sequence[Event] = ()) -> list[PhaseUtil]:
    """One row per GPU per phase that has samples of that GPU, GPUs in order, phases in timeline order
    then "none" and "all"."""
    spans = phase_intervals(events)
    util = series(samples, "util")
    power = series(samples, "power_w")
    mem = series(samples, "mem_used_mib")
    rows = []
    for key, (times, values) in util.items():
        dt = median_interval(times)
        masks = phase_masks(times, spans)
        extra = {name: _aligned(s.get(key), times) for name, s in (("power", power), ("mem", mem))}
        for phase, mask in masks.items():
            n = int(mask.sum())
            if n == 0:
                continue
            mean = float(values[mask].mean())
            rows.append(PhaseUtil(host=key[0], gpu=key[1], phase=phase, samples=n, seconds=n * dt,
                                  mean_util=mean, idle_fraction=1.0 - mean / 100.0,
                                  mean_power_w=_masked_mean(extra["power"], mask),
                                  mean_mem_used_mib=_masked_mean(extra["mem"], mask)))
    return rows


def _aligned(s: tuple[np.ndarray, np.ndarray] | None, times: np.ndarray) -> np.ndarray | None:
    """Values of another field at exactly `times` (NaN where that row lacked the field)."""
    if s is None:
        return None
    lookup = dict(zip(s[0].tolist(), s[1].tolist()))
    return np.asarray([lookup.get(t, np.nan) for t in times.tolist()], dtype=float)


def _masked_mean(values: np.ndarray | None, mask: np.ndarray) -> float | None:
    if values is None:
        return None
    picked = values[mask]
    picked = picked[~np.isnan(picked)]
    return float(picked.mean()) if len(picked) else None


def heatmap_grid(samples: Samples, max_bins: int = 600, field: str = "util") -> tuple[list[GpuKey], np.ndarray, float, float]:
    """(GPU keys, matrix GPUs x time bins of mean value, t_min, t_max); NaN where a bin has no sample.

    Bins are no narrower than the sampling interval, so a short run is not stretched into empty bins."""
    s = series(samples, field)
    keys = list(s)
    if not keys:
        return [], np.zeros((0, 0)), 0.0, 0.0
    t_min = min(float(t[0]) for t, _ in s.values())
    t_max = max(float(t[-1]) for t, _ in s.values())
    dt = min((median_interval(t) for t, _ in s.values() if len(t) > 1), default=1.0) or 1.0
    # Each sample covers one interval from its time on, so the last one ends at t_max + dt.
    span = t_max - t_min + dt
    n_bins = max(1, min(max_bins, int(round(span / dt))))
    width = span / n_bins
    grid = np.full((len(keys), n_bins), np.nan)
    for i, key in enumerate(keys):
        t, v = s[key]
        idx = np.minimum(((t - t_min) / width).astype(int), n_bins - 1)
        sums = np.bincount(idx, weights=v, minlength=n_bins)
        counts = np.bincount(idx, minlength=n_bins)
        with np.errstate(invalid="ignore", divide="ignore"):
            grid[i] = np.where(counts > 0, sums / np.maximum(counts, 1), np.nan)
    return keys, grid, t_min, t_min + n_bins * width
