"""The NVML utilization report: a self-contained HTML page with PNG figures and CSV tables.

    python -m megatron_sortedrl nvml-report runs/my_run            # a run directory
    python -m megatron_sortedrl nvml-report samples.jsonl           # a sample file recorded elsewhere
    python tools/nvml_report.py runs/my_run -o /tmp/report          # the same, from a checkout

Inputs: NVML samples (`<run_dir>/nvml/*.jsonl`, or one .jsonl/.csv file) and, where present, the run's
timeline (`<run_dir>/timeline*.jsonl`). Outputs in the report directory: `report.html` (figures embedded,
so the one file can be mailed), the figures as PNG, `summary.csv` (per GPU per phase) and `steps.csv`
(per step: phase seconds, idle, bubble ratios). Definitions are in `utilization.py` and `timeline.py`.

Left out: interactive plots (no JavaScript, so the page renders anywhere), comparisons of two runs.
"""

from __future__ import annotations

import base64
import csv
import html
import math
import os
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

import matplotlib

matplotlib.use("Agg")  # headless: reports are rendered on cluster nodes without a display
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from megatron_sortedrl.telemetry.nvml import Samples  # noqa: E402
from megatron_sortedrl.telemetry.timeline import (  # noqa: E402
    PHASES, Event, phase_intervals, rollout_bubble_by_step, slot_bubble_ratio, step_breakdown, step_windows,
    worker_bubble_ratio)
from megatron_sortedrl.telemetry.utilization import (  # noqa: E402
    PhaseUtil, gpu_label, heatmap_grid, phase_utilization)

# Fixed colours per phase so that every figure (and every run) reads the same way.
PHASE_COLORS = {"rollout": "#4C72B0", "reward": "#DD8452", "logprob": "#55A868", "train": "#C44E52",
                "sync": "#8172B3", "history": "#64B5CD", "checkpoint": "#937860", "eval": "#DA8BC3", "idle": "#CCCCCC",
                "none": "#CCCCCC", "all": "#333333", "relayout": "#F2B701"}
DPI = 110


def save_figure(fig, path: Path) -> Path:
    """Writes `fig` to `path` at the reports' resolution, frees it, and returns `path` (every report figure)."""
    fig.savefig(path, dpi=DPI, bbox_inches="tight")
    plt.close(fig)
    return path


@dataclass
class Report:
    """What was rendered: file paths and the numbers behind the figures (the tests read these)."""

    out_dir: Path
    html: Path
    figures: dict[str, Path] = field(default_factory=dict)
    summary: list[PhaseUtil] = field(default_factory=list)
    steps: dict[int, dict[str, float]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    headline: dict[str, float] = field(default_factory=dict)  # whole-run figures shown first


def phase_color(phase: str) -> str:
    if phase in PHASE_COLORS:
        return PHASE_COLORS[phase]
    # crc32, not hash(): str hashes are salted per process and colours must match between reports.
    return plt.get_cmap("tab10")(zlib.crc32(phase.encode()) % 10)


def phase_order(names: Sequence[str]) -> list[str]:
    known = [p for p in PHASES if p in names]
    return known + sorted(n for n in names if n not in PHASES and n not in ("none", "all")) + \
        [n for n in ("none", "all") if n in names]


def plot_heatmap(samples: Samples, events: Sequence[Event], path: Path) -> Path:
    keys, grid, t0, t1 = heatmap_grid(samples)
    spans = phase_intervals(events)
    names = phase_order(sorted({p for _, p, _, _ in spans}))
    single = len({k[0] for k in keys}) <= 1
    band_rows = max(1, len(names))
    height = 1.2 + 0.28 * band_rows + max(1.6, 0.32 * len(keys))
    fig, (ax_p, ax_h) = plt.subplots(2, 1, sharex=True, figsize=(11, height),
                                     gridspec_kw={"height_ratios": [0.28 * band_rows + 0.2, max(1.6, 0.32 * len(keys))]})
    # Phase bands: one row per phase name, since phases of consecutive steps may overlap in time.
    for row, name in enumerate(names):
        for _, p, a, b in spans:
            if p == name:
                ax_p.broken_barh([(a, b - a)], (row + 0.1, 0.8), color=phase_color(name))
    ax_p.set_yticks([i + 0.5 for i in range(len(names))], names, fontsize=8)
    ax_p.set_ylim(len(names) or 1, 0)
    ax_p.set_title("GPU utilization (NVML, % of time a kernel ran) with training phases", fontsize=10)
    if not names:
        ax_p.text(0.5, 0.5, "no timeline: phases unknown", transform=ax_p.transAxes, ha="center", va="center", fontsize=8)
    ax_p.tick_params(axis="x", labelbottom=False)
    cmap = plt.get_cmap("viridis").with_extremes(bad="#eeeeee")  # grey where a GPU has no sample
    im = ax_h.imshow(np.ma.masked_invalid(grid), aspect="auto", cmap=cmap, vmin=0, vmax=100,
                     extent=(t0, t1, len(keys), 0), interpolation="nearest")
    ax_h.set_yticks([i + 0.5 for i in range(len(keys))], [gpu_label(k, single) for k in keys], fontsize=8)
    ax_h.set_xlabel("run time (s)")
    lo = min([t0] + [a for _, _, a, _ in spans])
    hi = max([t1] + [b for _, _, _, b in spans])
    ax_h.set_xlim(lo, hi)
    fig.colorbar(im, ax=[ax_p, ax_h], label="util %", fraction=0.03, pad=0.01)
    return save_figure(fig, path)


def plot_idle_by_phase(summary: Sequence[PhaseUtil], path: Path) -> Path:
    keys = sorted({(r.host, r.gpu) for r in summary})
    single = len({k[0] for k in keys}) <= 1
    phases = phase_order(sorted({r.phase for r in summary}))
    matrix = np.full((len(keys), len(phases)), np.nan)
    for r in summary:
        matrix[keys.index((r.host, r.gpu)), phases.index(r.phase)] = r.idle_fraction
    fig, ax = plt.subplots(figsize=(1.2 + 1.1 * len(phases), 1.0 + 0.35 * len(keys)))
    cmap = plt.get_cmap("Reds").with_extremes(bad="#eeeeee")
    im = ax.imshow(np.ma.masked_invalid(matrix), cmap=cmap, vmin=0, vmax=1, aspect="auto")
    if matrix.size <= 600:  # numbers stay legible up to about this many cells
        for i in range(len(keys)):
            for j in range(len(phases)):
                if not np.isnan(matrix[i, j]):
                    ax.text(j, i, f"{matrix[i, j]:.0%}", ha="center", va="center", fontsize=7,
                            color="white" if matrix[i, j] > 0.6 else "black")
    ax.set_xticks(range(len(phases)), phases, fontsize=8)
    ax.set_yticks(range(len(keys)), [gpu_label(k, single) for k in keys], fontsize=8)
    ax.set_title("Idle fraction per phase and GPU (1 - mean util)", fontsize=10)
    fig.colorbar(im, ax=ax, fraction=0.04, pad=0.02)
    return save_figure(fig, path)


def step_figure(n_steps: int, max_width: float | None = None):
    """A figure for one bar per step: 0.35 in per step (at least 5 in), at most `max_width` inches."""
    width = max(5, 0.35 * n_steps + 2)
    return plt.subplots(figsize=(min(width, max_width) if max_width else width, 3))


def set_step_ticks(ax, steps: Sequence[int]) -> None:
    """One x tick per bar, labelled with the step; thinned to about 3 labels per inch on a capped figure."""
    every = max(1, math.ceil(len(steps) / (3 * ax.figure.get_figwidth())))
    ax.set_xticks(range(0, len(steps), every), [str(s) for s in steps[::every]], fontsize=8)


def plot_bubbles(bubbles: dict[int, dict[str, float]], path: Path, max_width: float | None = None) -> Path:
    steps = sorted(bubbles)
    x = np.arange(len(steps))
    has_slot = any("slot_bubble" in bubbles[s] for s in steps)
    width = 0.4 if has_slot else 0.7
    fig, ax = step_figure(len(steps), max_width)
    ax.bar(x - (width / 2 if has_slot else 0), [bubbles[s]["worker_bubble"] for s in steps], width,
           label="worker bubble", color="#4C72B0")
    if has_slot:
        ax.bar(x + width / 2, [bubbles[s].get("slot_bubble", np.nan) for s in steps], width,
               label="slot bubble", color="#DD8452")
    set_step_ticks(ax, steps)
    ax.set_xlabel("training step")
    ax.set_ylabel("bubble ratio")
    # A slot bubble below zero means queued requests exceeded the slots (oversubscribed), so allow it.
    low = min([0.0] + [bubbles[s].get("slot_bubble", 0.0) for s in steps])
    ax.set_ylim(low, 1.0)
    ax.axhline(0, color="black", linewidth=0.6)
    ax.set_title("Rollout bubble ratio per step (lower is better)", fontsize=10)
    ax.legend(fontsize=8)
    return save_figure(fig, path)


RATIOS = ("worker_bubble", "slot_bubble", "driver_idle")  # per-step ratios kept in the steps table beside phase seconds


def step_columns(steps: dict[int, dict[str, float]], ratios: bool = True) -> list[str]:
    """Columns of the steps table in reading order: phases, idle, then (if `ratios`) bubble ratios.
    The breakdown figure stacks only seconds, so it asks for `ratios=False`."""
    keys = {k for row in steps.values() for k in row}
    cols = phase_order(sorted(keys - {"idle", *RATIOS})) + ["idle"]
    return cols + [c for c in RATIOS if c in keys] if ratios else cols


def plot_breakdown(breakdown: dict[int, dict[str, float]], path: Path, max_width: float | None = None) -> Path:
    steps = sorted(breakdown)
    phases = step_columns(breakdown, ratios=False)
    fig, ax = step_figure(len(steps), max_width)
    bottom = np.zeros(len(steps))
    for p in phases:
        vals = np.array([breakdown[s].get(p, 0.0) for s in steps])
        ax.bar(range(len(steps)), vals, bottom=bottom, label=p, color=phase_color(p))
        bottom += vals
    set_step_ticks(ax, steps)
    ax.set_xlabel("training step")
    ax.set_ylabel("seconds")
    ax.set_title("Step time breakdown", fontsize=10)
    ax.legend(fontsize=7, ncol=min(4, len(phases)), loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return save_figure(fig, path)


def step_table(events: Sequence[Event], max_batch: int | None) -> dict[int, dict[str, float]]:
    """Per step: seconds per phase, idle, and the rollout bubble ratios (where there was a rollout)."""
    table = {s: dict(row) for s, row in step_breakdown(events).items()}
    for s, row in rollout_bubble_by_step(events, max_batch).items():
        table.setdefault(s, {}).update({k: v for k, v in row.items() if k != "rollout_s"})
    return table


def headline(report: Report, samples: Samples, events: Sequence[Event], max_batch: int | None) -> dict[str, float]:
    """Whole-run figures: recording length, GPUs, mean idle fraction, pooled bubble ratios, step time."""
    out: dict[str, float] = {}
    whole = [r for r in report.summary if r.phase == "all"]
    if whole:
        out["gpus"] = len(whole)
        out["recorded_s"] = max(r.seconds for r in whole)
        out["idle_fraction"] = sum(r.idle_fraction for r in whole) / len(whole)
    if any("worker_bubble" in row for row in report.steps.values()):
        out["worker_bubble"] = worker_bubble_ratio(events)
        if max_batch:
            out["slot_bubble"] = slot_bubble_ratio(events, max_batch)
    if report.steps:
        walls = step_windows(events)
        out["steps"] = len(walls)
        out["mean_step_s"] = sum(b - a for a, b in walls.values()) / len(walls)
    return out


def write_csvs(out_dir: Path, summary: Sequence[PhaseUtil], steps: dict[int, dict[str, float]]) -> None:
    with open(out_dir / "summary.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(PhaseUtil.__dataclass_fields__))
        w.writeheader()
        for r in summary:
            w.writerow({k: (round(v, 4) if isinstance(v, float) else v) for k, v in asdict(r).items()})
    cols = step_columns(steps)
    with open(out_dir / "steps.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step", *cols])
        for s in sorted(steps):
            w.writerow([s, *(round(steps[s][c], 4) if c in steps[s] else "" for c in cols)])


def render(samples: Samples, events: Sequence[Event], out_dir: str | os.PathLike, title: str = "NVML utilization report",
           max_batch: int | None = None, source: str = "") -> Report:
    """Compute, plot and write everything into `out_dir`; returns what was written."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    report = Report(out_dir=out, html=out / "report.html")
    if samples.rows:
        report.summary = phase_utilization(samples, events)
        report.figures["utilization"] = plot_heatmap(samples, events, out / "utilization_heatmap.png")
        report.figures["idle"] = plot_idle_by_phase(report.summary, out / "idle_by_phase.png")
    else:
        report.notes.append("No NVML samples (no NVIDIA driver where the run went, or sampling was off): "
                            "only the timeline figures are shown.")
    if events:
        report.steps = step_table(events, max_batch)
        bubbles = {s: row for s, row in report.steps.items() if "worker_bubble" in row}
        if bubbles:
            report.figures["bubbles"] = plot_bubbles(bubbles, out / "rollout_bubbles.png")
        if report.steps:
            report.figures["breakdown"] = plot_breakdown(report.steps, out / "step_breakdown.png")
    else:
        report.notes.append("No timeline: phase bands, bubble ratios and the step breakdown need the run's timeline*.jsonl.")
    report.headline = headline(report, samples, events, max_batch)
    write_csvs(out, report.summary, report.steps)
    report.html.write_text(_html(report, samples, title, source), encoding="utf-8")
    return report


_CAPTIONS = {
    "utilization": "Per-GPU utilization over time (colour), with the run's phases as bands above. Dark "
                   "stretches inside a phase are GPUs waiting: the bubbles the scheduler should remove.",
    "idle": "Share of each phase's time in which the GPU ran no kernel. \"none\" is time outside every "
            "phase (driver overhead, data loading); \"all\" is the whole recording.",
    "bubbles": "Worker bubble: share of rollout worker-time after a worker's last request finished. Slot "
               "bubble: share of engine batch slots left empty during the rollout phase.",
    "breakdown": "Seconds per phase per step; idle is the step's wall time covered by no phase.",
}


def _ranges(indices: list[int]) -> str:
    """[0, 1, 2, 3, 6] -> "0-3, 6"."""
    out: list[str] = []
    for i in sorted(indices):
        if out and int(out[-1].split("-")[-1]) == i - 1:
            out[-1] = f"{out[-1].split('-')[0]}-{i}"
        else:
            out.append(str(i))
    return ", ".join(out)


def img_tag(path: Path) -> str:
    data = base64.b64encode(path.read_bytes()).decode()
    return f'<img alt="{path.stem}" src="data:image/png;base64,{data}">'


def page_start(title: str) -> str:
    """Doctype, the shared style sheet and the title heading of a report page."""
    e = html.escape
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{e(title)}</title><style>"
            "body{font-family:sans-serif;margin:2em;max-width:1200px;color:#222}"
            "table{border-collapse:collapse;font-size:12px;margin:0.5em 0}"
            "td,th{border:1px solid #ccc;padding:2px 6px;text-align:right}"
            "th{background:#f3f3f3}img{max-width:100%}figcaption{font-size:13px;color:#555}"
            ".note{background:#fff7e0;padding:0.5em}</style></head><body>\n"
            f"<h1>{e(title)}</h1>")


def _html(report: Report, samples: Samples, title: str, source: str) -> str:
    e = html.escape
    parts = [page_start(title)]
    if source:
        parts.append(f"<p>Source: <code>{e(source)}</code></p>")
    for note in report.notes:
        parts.append(f"<p class='note'>{e(note)}</p>")
    h = report.headline
    items = []
    if "gpus" in h:
        items.append(f"{h['recorded_s']:.0f} s recorded on {h['gpus']:.0f} GPU(s); "
                     f"mean idle fraction over the whole run: <b>{h['idle_fraction']:.1%}</b>")
    if "worker_bubble" in h:
        slot = f", slot bubble ratio <b>{h['slot_bubble']:.1%}</b>" if "slot_bubble" in h else ""
        items.append(f"rollout worker bubble ratio over all steps: <b>{h['worker_bubble']:.1%}</b>{slot}")
    if "steps" in h:
        items.append(f"{h['steps']:.0f} step(s), mean step time {h['mean_step_s']:.1f} s")
    if items:
        parts.append("<ul>" + "".join(f"<li>{i}</li>" for i in items) + "</ul>")
    for name in ("utilization", "idle", "bubbles", "breakdown"):
        if name in report.figures:
            parts.append(f"<figure>{img_tag(report.figures[name])}<figcaption>{e(_CAPTIONS[name])}</figcaption></figure>")
    if report.summary:
        single = len({r.host for r in report.summary}) <= 1
        rows = "".join(f"<tr><td>{e(gpu_label((r.host, r.gpu), single))}</td><td>{e(r.phase)}</td><td>{r.seconds:.1f}</td>"
                       f"<td>{r.mean_util:.1f}</td><td>{r.idle_fraction:.1%}</td>"
                       f"<td>{'' if r.mean_power_w is None else f'{r.mean_power_w:.0f}'}</td></tr>"
                       for r in report.summary)
        parts.append("<h2>Per GPU and phase</h2><p>Also in <code>summary.csv</code>.</p><table><tr><th>GPU</th>"
                     f"<th>phase</th><th>seconds</th><th>mean util %</th><th>idle</th><th>mean power W</th></tr>{rows}</table>")
    if report.steps:
        cols = step_columns(report.steps)
        head = "".join(f"<th>{e(c)}</th>" for c in cols)
        rows = "".join("<tr><td>%d</td>%s</tr>" % (s, "".join(
            f"<td>{report.steps[s][c]:.3f}</td>" if c in report.steps[s] else "<td></td>" for c in cols))
            for s in sorted(report.steps))
        parts.append(f"<h2>Per step</h2><p>Also in <code>steps.csv</code>.</p><table><tr><th>step</th>{head}</tr>{rows}</table>")
    if samples.meta:
        # One row per host and GPU model, not per GPU: an 8-GPU node is one line.
        groups: dict[tuple, list[int]] = {}
        for m in samples.meta:
            for g in m.get("gpus", []):
                key = (m.get("host"), g.get("name"), g.get("mem_total_mib"), g.get("power_limit_w"),
                       m.get("interval_s"), m.get("driver"))
                groups.setdefault(key, []).append(g.get("index"))
        rows = "".join("<tr>" + "".join(f"<td>{e(str(v))}</td>" for v in (k[0], _ranges(ix), *k[1:])) + "</tr>"
                       for k, ix in groups.items())
        parts.append("<h2>Hardware</h2><table><tr><th>host</th><th>GPUs</th><th>name</th><th>memory MiB</th>"
                     f"<th>power limit W</th><th>interval s</th><th>driver</th></tr>{rows}</table>")
    if samples.overhead:
        rows = "".join(f"<tr><td>{o.get('ticks')}</td><td>{o.get('ms_per_tick')}</td>"
                       f"<td>{100 * o.get('cpu_fraction_of_one_core', 0):.3f} %</td><td>{o.get('late_ticks')}</td></tr>"
                       for o in samples.overhead)
        parts.append("<h2>Sampler cost</h2><table><tr><th>ticks</th><th>ms per tick</th>"
                     f"<th>CPU of one core</th><th>late ticks</th></tr>{rows}</table>")
    parts.append("</body></html>")
    return "\n".join(parts)
