"""The RL run report: one self-contained HTML page (PNG figures embedded, and saved beside it) that says
how a training run went and where its rollout time went.

    python -m megatron_sortedrl report runs/my_run                # -> runs/my_run/report/report.html
    python -m megatron_sortedrl report runs/my_run -o /tmp/rep

    from megatron_sortedrl.telemetry.run_report import write_run_report
    html_path = write_run_report("runs/my_run")

Inputs (all from the run directory the driver writes): `metrics.jsonl` (step rows and `eval/accuracy`
rows), `timeline*.jsonl` (phases and requests) and `summary.json` (only once the run finished). A missing
or unreadable input leaves out the figures that need it and the page says so; nothing here raises for a
killed run. The page: a summary table; reward and accuracy per step with the evaluations; the step-time
breakdown; a Gantt of requests per rollout worker with the bubble shaded (last `GANTT_STEPS` steps); the
worker bubble ratio per step and the engine time lost waiting on the driver (driver idle, in the summary and
the per-step table); draft acceptance (speculative decoding); dynamic sampling and history skip
(`sampling/*`, when on); the staleness histogram; and a per-step table
(also `steps.csv`). Plot helpers, colours and the page style come from `report.py`; reading the run
directory from `run_data.py`.

Left out: the slot bubble ratio (it needs one engine's `max_num_seqs`, which the run directory does not
record: use `nvml-report --max-batch`), GPU utilization (`nvml-report`), and comparing two runs.
"""

from __future__ import annotations

import csv
import html
import os
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any, Sequence

from matplotlib.ticker import MaxNLocator

from megatron_sortedrl.telemetry.run_data import RunData, load_run
from megatron_sortedrl.telemetry.report import (
    img_tag, page_start, phase_color, phase_order, plot_breakdown, plot_bubbles, plt, save_figure)
from megatron_sortedrl.telemetry.spec_panel import plot_acceptance, plot_tokens_per_forward, tokens_per_forward_by_kind
from megatron_sortedrl.telemetry.timeline import (
    Event, driver_idle, phase_intervals, phase_window, request_intervals, rollout_bubble_by_step,
    step_breakdown, step_windows, worker_bubble_ratio)

GANTT_STEPS = 3  # the Gantt draws the last this-many steps with a rollout phase: one bar per request
MAX_WIDTH_IN = 16.0  # per-step bar charts stop growing here and thin their tick labels
BUBBLE_COLOR = "#E45756"


# ----------------------------------------------------------------------------------------------------
# Numbers behind the figures (pure; the tests check these against the timeline functions).


def staleness_totals(step_rows: Sequence[dict[str, Any]]) -> dict[int, int]:
    """Samples per staleness (policy versions behind), summed over steps' `rollout/staleness_hist`."""
    total: Counter[int] = Counter()
    for row in step_rows:
        for k, v in (row.get("rollout/staleness_hist") or {}).items():
            total[int(k)] += int(v)
    return dict(sorted(total.items()))


def _union(intervals: Sequence[tuple[float, float]], t0: float, t1: float) -> list[tuple[float, float]]:
    """Disjoint sorted intervals covering the given ones clipped to [t0, t1]."""
    out: list[list[float]] = []
    for a, b in sorted((max(a, t0), min(b, t1)) for a, b in intervals):
        if b <= a:
            continue
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _subtract(keep: Sequence[tuple[float, float]], cut: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """Parts of disjoint sorted `keep` outside disjoint sorted `cut`."""
    out = []
    for a, b in keep:
        for c, d in cut:
            if d <= a or c >= b:
                continue
            if c > a:
                out.append((a, c))
            a = max(a, d)
        if a < b:
            out.append((a, b))
    return out


def idle_while_others_busy(per_worker: dict[int, list[tuple[float, float]]], t0: float,
                           t1: float) -> dict[int, list[tuple[float, float]]]:
    """Per worker, the stretches of [t0, t1] in which it has no request running while another worker
    does: the bubble the Gantt shades. Open requests (end = inf) run to t1."""
    busy = {w: _union(iv, t0, t1) for w, iv in per_worker.items()}
    out = {}
    for w in busy:
        others = _union([iv for v, ivs in busy.items() if v != w for iv in ivs], t0, t1)
        out[w] = _subtract(others, busy[w])
    return out


def peak_concurrency(intervals: Sequence[tuple[float, float]]) -> int:
    """Most intervals open at one time (an interval ending where another starts does not overlap it)."""
    edges = sorted([(a, 1) for a, _ in intervals] + [(b, -1) for _, b in intervals], key=lambda x: (x[0], x[1]))
    peak = cur = 0
    for _, d in edges:
        cur += d
        peak = max(peak, cur)
    return peak


def bubble_by_step(run: RunData) -> tuple[dict[int, float], str]:
    """Worker bubble ratio per step and where it came from: the timeline (`rollout_bubble_by_step`) or,
    without one, the driver's `rollout/bubble_ratio` in metrics.jsonl."""
    if run.events:
        ratios = {s: row["worker_bubble"] for s, row in rollout_bubble_by_step(run.events).items()}
        if ratios:
            return ratios, "timeline"
    ratios = {s: float(r["rollout/bubble_ratio"]) for s, r in run.steps.items() if "rollout/bubble_ratio" in r}
    return ratios, "metrics.jsonl" if ratios else ""


# ----------------------------------------------------------------------------------------------------
# Figures: each writes one PNG and returns its path.


def _integer_steps(ax) -> None:
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def plot_rewards(run: RunData, path: Path) -> Path:
    steps = sorted(run.steps)
    fig, ax = plt.subplots(figsize=(9, 3.2))
    for key, label, color in (("reward/mean", "train reward (mean)", "#4C72B0"),
                              ("reward/accuracy", "train accuracy", "#55A868")):
        xs = [s for s in steps if key in run.steps[s]]
        ax.plot(xs, [run.steps[s][key] for s in xs], label=label, color=color, linewidth=1.2,
                marker="." if len(xs) <= 60 else None)
    if run.evals:
        ax.plot([s for s, _ in run.evals], [a for _, a in run.evals], "D", color="#C44E52", markersize=6,
                label="eval accuracy (step 0: before RL)")
    ax.set_xlabel("training step")
    ax.set_ylabel("reward / accuracy")
    ax.set_title("Reward and accuracy per step, with evaluations", fontsize=10)
    _integer_steps(ax)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    return save_figure(fig, path)


def relayout_steps(events: Sequence[Event]) -> list[int]:
    """Steps whose rounds switched the engine layout (a `relayout` phase, megatron_sortedrl/relayout.py)."""
    return sorted({e.step for e in events if e.kind == "phase" and e.phase == "relayout" and e.event == "start"})


def rollout_layouts(events: Sequence[Event]) -> dict[int, str]:
    """Step -> the engine layout its (last) rollout ran on, e.g. "1xTP2", from the rollout phase starts."""
    return {e.step: e.layout for e in events
            if e.kind == "phase" and e.phase == "rollout" and e.event == "start" and e.layout}


def gantt_steps(steps: Sequence[int], switches: Sequence[int], last_steps: int) -> list[int]:
    """The `last_steps` consecutive steps of `steps` the Gantt draws: the last ones, or, when the run switched
    layout before them, those around its last switch (the step before it first), so the switch is seen."""
    steps = sorted(steps)
    end = len(steps)
    seen = [i for i, s in enumerate(steps) if s in set(switches)]
    if seen and seen[-1] < end - last_steps:
        end = min(len(steps), max(seen[-1] - 1, 0) + last_steps)
    return steps[max(0, end - last_steps):end]


def plot_gantt(events: Sequence[Event], path: Path, last_steps: int = GANTT_STEPS) -> tuple[Path, list[int]] | None:
    """Requests per rollout worker over time for the last `last_steps` steps with a rollout phase (or those
    around the last layout switch, `gantt_steps`), the bubble (idle while another worker still runs a request)
    shaded, each step's engine layout, and the phases of those steps on top (a `relayout` phase where the
    engines were rebuilt). Returns the path and the steps drawn, or None when no step has a rollout phase
    with requests."""
    # Grouped by step once: the timeline functions scan every event they are given, once per step.
    by_step: dict[int, list[Event]] = defaultdict(list)
    for ev in events:
        by_step[ev.step].append(ev)
    t_last = max(ev.t for ev in events)
    rollouts = {s: w for s in sorted(by_step) if (w := phase_window(by_step[s], s, "rollout", t_last))}
    with_requests = {s: iv for s in rollouts if (iv := request_intervals(by_step[s], s))}
    shown = gantt_steps(list(with_requests), relayout_steps(events), last_steps)
    per_step = {s: with_requests[s] for s in shown}
    if not shown:
        return None
    windows = step_windows(events)
    lo, hi = windows[shown[0]][0], windows[shown[-1]][1]
    workers = sorted({w for iv in per_step.values() for w in iv})
    fig, ax = plt.subplots(figsize=(12, 1.4 + 0.32 * (len(workers) + 1)))
    # Row 0: the phases of the shown steps, so the Gantt reads against train/sync time between rollouts.
    spans = [(s, p, a, b) for s, p, a, b in phase_intervals(events) if s in shown]
    for name in phase_order(sorted({p for _, p, _, _ in spans})):
        bars = [(a, b - a) for _, p, a, b in spans if p == name]
        ax.broken_barh(bars, (0.1, 0.8), color=phase_color(name), label=f"phase: {name}")
    # Overlapping requests darken the bar, so colour depth reads as concurrency up to the busiest worker's peak.
    peak = max([1] + [peak_concurrency([(a, min(b, rollouts[s][1])) for a, b in iv])
                      for s in shown for iv in per_step[s].values()])
    alpha = max(0.08, min(0.9, 1.5 / peak))
    # Each layout switch named inside its relayout bar: the layout the next rollout runs on and the switch's seconds.
    for e in (e for e in events if e.kind == "phase" and e.phase == "relayout" and e.event == "start" and e.step in shown):
        end = next((b for st, p, a, b in spans if p == "relayout" and st == e.step and a == e.t), e.t)
        ax.text((e.t + end) / 2, 0.5, f"relayout -> {e.layout} ({end - e.t:.0f} s)", ha="center", va="center", fontsize=7)
    for i, s in enumerate(shown):
        t0, t1 = rollouts[s]
        for w, iv in per_step[s].items():
            row = 1 + workers.index(w)
            ax.broken_barh([(a, min(b, t1) - a) for a, b in iv], (row + 0.15, 0.7), color="#4C72B0", alpha=alpha,
                           linewidth=0)
        for w, gaps in idle_while_others_busy(per_step[s], t0, t1).items():
            ax.broken_barh([(a, b - a) for a, b in gaps], (1 + workers.index(w) + 0.05, 0.9), facecolor=BUBBLE_COLOR,
                           alpha=0.45, hatch="///", edgecolor=BUBBLE_COLOR, linewidth=0)
        ax.axvline(t0, color="#888", linewidth=0.6, linestyle=":")
        ax.axvline(t1, color="#888", linewidth=0.6, linestyle=":")
        layout = rollout_layouts(by_step[s]).get(s)
        # Alternate heights so that the labels of short neighbouring rollouts do not overlap.
        ax.text((t0 + t1) / 2, -0.15 - 0.3 * (i % 2), f"step {s} rollout" + (f", {layout}" if layout else ""),
                ha="center", va="bottom", fontsize=8)
    ax.broken_barh([], (0, 0), color="#4C72B0", label="request (darker: more at once)")
    ax.broken_barh([], (0, 0), facecolor=BUBBLE_COLOR, alpha=0.45, hatch="///", edgecolor=BUBBLE_COLOR,
                   label="bubble: idle while another worker runs")
    ax.set_yticks([0.5] + [1.5 + i for i in range(len(workers))], ["phases"] + [f"worker {w}" for w in workers],
                  fontsize=8)
    ax.set_ylim(len(workers) + 1, -0.9)
    ax.set_xlim(lo, hi)
    ax.set_xlabel("run time (s)")
    ax.set_title(f"Rollout requests per worker, steps {shown[0]}-{shown[-1]}" if len(shown) > 1
                 else f"Rollout requests per worker, step {shown[0]}", fontsize=10)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return save_figure(fig, path), shown


def plot_selective(run: RunData, path: Path) -> Path | None:
    """Dynamic sampling and history skip (sampling.*): groups per step by outcome, predicted vs actual informative
    groups, and generated tokens per trained token (right axis)."""
    steps = [s for s in sorted(run.steps) if "sampling/trained_groups" in run.steps[s]]
    if not steps:
        return None
    fig, ax = plt.subplots(figsize=(9, 3))
    get = lambda key: [run.steps[s].get(key, 0) for s in steps]  # noqa: E731
    bottom = [0.0] * len(steps)
    for key, label, color in (("sampling/trained_groups", "trained (informative)", "#55A868"),
                              ("sampling/filtered_groups", "filtered (all rewards equal)", "#C44E52"),
                              ("sampling/skipped_prompts", "skipped by history", "#BBBBBB")):
        ax.bar(steps, get(key), bottom=bottom, label=label, color=color)
        bottom = [b + v for b, v in zip(bottom, get(key))]
    ax.plot(steps, get("sampling/predicted_informative"), "k--", marker=".", label="predicted informative")
    ax.set_xlabel("training step")
    ax.set_ylabel("prompt groups")
    ax2 = ax.twinx()
    ax2.plot(steps, get("sampling/generated_per_trained_token"), color="#4C72B0", marker="o",
             label="generated / trained tokens (right)")
    ax2.set_ylabel("tokens")
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, fontsize=8, loc="upper left", bbox_to_anchor=(1.1, 1.0))
    _integer_steps(ax)
    ax.set_title("Dynamic sampling and history skip per step", fontsize=10)
    return save_figure(fig, path)


def plot_staleness(totals: dict[int, int], path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(max(4, 0.5 * len(totals) + 2), 3))
    xs = list(totals)
    ax.bar(xs, [totals[x] for x in xs], color="#8172B3")
    ax.set_xticks(xs, [str(x) for x in xs], fontsize=8)
    ax.set_xlabel("staleness (policy versions behind the trained policy)")
    ax.set_ylabel("samples")
    ax.set_title(f"Staleness of trained samples, all steps ({sum(totals.values())} samples)", fontsize=10)
    return save_figure(fig, path)


# ----------------------------------------------------------------------------------------------------
# The page.

_CAPTIONS = {
    "rewards": "Train reward and accuracy of each step's batch (lines) and held-out evaluation accuracy "
               "(diamonds; step 0 is before RL, the last one after RL).",
    "breakdown": "Seconds per phase per step from the timeline; idle is the step's wall time covered by no phase.",
    "gantt": "One row per rollout worker: each request is a bar from submit to finish or abort (overlapping "
             "requests darken the bar). Hatched red: the worker had nothing to run while another worker still "
             "did, the bubble. The top row shows the phases of the same steps; a relayout phase is a switch of "
             "the engine layout (engines x TP, printed under each step) chosen by scheduler.layout_planner.",
    "bubbles": "Worker bubble ratio per step: share of rollout worker-time between a worker's last finished "
               "request and the end of the rollout phase.",
    "acceptance": "Mean accepted draft length, tokens per target forward and acceptance rate of the drafter.",
    "tokens_per_forward": "Tokens per target forward of each step's rollout (vLLM's counters: tokens / (tokens - "
                          "accepted draft tokens)), short and long rounds apart; dashed: each kind over the run.",
    "selective": "Prompt groups per update by outcome: trained (rewards differ), filtered by dynamic sampling "
                 "(all rewards equal), skipped before generation by the reward history; the dashed line is how many "
                 "of the generated groups the history predicted informative, the blue line the generated response "
                 "tokens (trained, filtered, aborted) per trained token.",
    "staleness": "How many policy versions behind the trained policy each trained sample was generated, "
                 "summed over steps (0 = on-policy).",
}

# (metrics key or computed name, column header, format) of the per-step table.
_STEP_COLUMNS = (
    ("reward/mean", "reward", "{:.3f}"), ("reward/accuracy", "accuracy", "{:.3f}"),
    ("eval", "eval accuracy", "{:.3f}"), ("rollout/response_len", "response len", "{:.0f}"),
    ("rollout/tokens_per_s", "tokens/s", "{:.0f}"), ("time/step_s", "step s", "{:.2f}"),
    ("worker_bubble", "worker bubble", "{:.3f}"), ("rollout/driver_idle_share", "driver idle", "{:.3f}"),
    ("rollout/staleness_mean", "staleness mean", "{:.2f}"),
    # mini-batches (megatron_sortedrl/minibatch.py): steps of the harvest, staleness in steps, the PPO clip at work
    ("train/optimizer_steps", "optimizer steps", "{:.0f}"), ("train/staleness_steps_max", "stale steps max", "{:.0f}"),
    ("train/clip_frac", "clip frac", "{:.3f}"), ("train/ppo_kl", "KL to old", "{:.4f}"),
    ("reward/critical_path_s", "reward crit. path s", "{:.2f}"), ("reward/workers_active", "reward workers busy", "{:.2f}"),
    ("spec/mean_accepted_length", "accepted len", "{:.2f}"),
    ("tools/calls", "tool calls", "{:.0f}"), ("tools/errors", "tool errors", "{:.0f}"),
    ("tools/turns_per_trajectory", "turns/trajectory", "{:.2f}"), ("tools/seconds", "tool s crit. path", "{:.2f}"),
    ("scheduler/carried", "carried in", "{:.0f}"), ("scheduler/trained", "prompts trained", "{:.0f}"),
    ("scheduler/carry_next", "carried out", "{:.0f}"),
    ("rollout/layout_engines", "engines", "{:.0f}"), ("rollout/layout_tp", "engine TP", "{:.0f}"),
    ("time/relayout_s", "relayout s", "{:.1f}"),
)


def step_rows(run: RunData, bubbles: dict[int, float]) -> tuple[list[str], list[list[str]]]:
    """Header and formatted rows of the per-step table; columns nobody logged are left out."""
    evals = dict(run.evals)
    cells: dict[int, dict[str, float]] = {}
    for s in sorted(set(run.steps) | set(bubbles)):
        row = {k: v for k, v in run.steps.get(s, {}).items() if isinstance(v, (int, float))}
        if s in evals:
            row["eval"] = evals[s]
        if s in bubbles:
            row["worker_bubble"] = bubbles[s]
        cells[s] = row
    cols = [c for c in _STEP_COLUMNS if any(c[0] in r for r in cells.values())]
    rows = [[str(s)] + [fmt.format(r[k]) if k in r else "" for k, _, fmt in cols] for s, r in cells.items()]
    return ["step"] + [h for _, h, _ in cols], rows


def summary_items(run: RunData, bubbles: dict[int, float]) -> list[tuple[str, str]]:
    """(label, value) rows of the summary table; summary.json first, metrics.jsonl where it is missing."""
    sm = run.summary or {}
    last = run.steps[max(run.steps)] if run.steps else {}
    evals = dict(run.evals)

    def pct(x: Any) -> str:
        return "" if x is None else f"{float(x):.3f}"

    step_s = [r["time/step_s"] for r in run.steps.values() if "time/step_s" in r]
    items = [("status", "finished" if run.summary else "not finished (no summary.json)"),
             ("RL steps", str(sm.get("steps", max(run.steps) if run.steps else 0)))]
    before = sm.get("accuracy_before_rl", evals.get(0))
    items.append(("eval accuracy before RL", pct(before) if before is not None else "not evaluated"))
    if "accuracy_after_rl" in sm:
        items.append(("eval accuracy after RL", pct(sm["accuracy_after_rl"])))
    else:
        later = [(s, a) for s, a in run.evals if s > 0]
        items.append(("eval accuracy after RL", f"not evaluated (last eval: step {later[-1][0]}, {later[-1][1]:.3f})"
                      if later else "not evaluated"))
    if "wall_s" in sm:
        items.append(("wall time", f"{sm['wall_s']:.0f} s ({sm['wall_s'] / 3600:.2f} h)"))
    else:
        items.append(("wall time", f"unknown; the logged steps took {sum(step_s):.0f} s" if step_s else "unknown"))
    errors = sm.get("reward_errors", last.get("reward/errors_total"))
    timeouts = sm.get("reward_timeouts", last.get("reward/timeouts_total"))
    items.append(("reward errors / timeouts", f"{errors if errors is not None else '?'} / "
                                              f"{timeouts if timeouts is not None else '?'}"))
    if step_s:
        items.append(("mean step time", f"{sum(step_s) / len(step_s):.2f} s"))
    if run.events and bubbles:
        items.append(("worker bubble ratio, all steps", f"{worker_bubble_ratio(run.events):.1%}"))
        idle, total = driver_idle(run.events)
        if total > 0:
            items.append(("engine time idle on the driver, all steps", f"{idle / total:.1%} ({idle:.1f} engine-s)"))
    elif bubbles:
        items.append(("worker bubble ratio, mean of steps", f"{sum(bubbles.values()) / len(bubbles):.1%}"))
    switches = relayout_steps(run.events)
    if switches or any("rollout/layout_tp" in r for r in run.steps.values()):
        layouts = rollout_layouts(run.events)
        items.append(("engine layout switches", f"{len(switches)}" + (" (" + ", ".join(
            f"step {s}: {layouts.get(s, '?')}" for s in switches) + ")" if switches else "")))
    spec = [r["spec/mean_accepted_length"] for r in run.steps.values() if "spec/mean_accepted_length" in r]
    items.append(("speculative decoding", f"on, mean accepted length {sum(spec) / len(spec):.2f}" if spec else "off"))
    tpf = tokens_per_forward_by_kind(run.steps)
    if tpf and spec:
        items.append(("tokens per target forward (short / long rounds)", f"{tpf['all']:.2f} ("
                      + " / ".join(f"{tpf[k]:.2f}" if k in tpf else "-" for k in ("short", "long")) + ")"))
    return items


def _table(header: Sequence[str], rows: Sequence[Sequence[str]], table_id: str) -> str:
    e = html.escape
    head = "".join(f"<th>{e(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{e(c)}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table id='{table_id}'><tr>{head}</tr>{body}</table>"


def write_run_report(run_dir: str | os.PathLike, out_dir: str | os.PathLike | None = None) -> Path:
    """Render the report of `run_dir` into `out_dir` (default `<run_dir>/report`); returns report.html."""
    run = load_run(run_dir)
    out = Path(out_dir) if out_dir is not None else run.run_dir / "report"
    out.mkdir(parents=True, exist_ok=True)
    e = html.escape
    bubbles, bubble_source = bubble_by_step(run)
    parts = [page_start(f"RL run report: {run.run_dir.name}"), f"<p>Run directory: <code>{e(str(run.run_dir))}</code></p>"]
    parts += [f"<p class='note'>{e(n)}</p>" for n in run.notes]
    parts += ["<h2>Summary</h2>", _table(["", "value"], summary_items(run, bubbles), "summary")]

    def figure(name: str, path: Path | None, extra: str = "") -> None:
        if path is not None:
            parts.append(f"<figure>{img_tag(path)}<figcaption>{e(_CAPTIONS[name] + extra)}</figcaption></figure>")

    parts.append("<h2>Reward and accuracy</h2>")
    if run.steps or run.evals:
        figure("rewards", plot_rewards(run, out / "rewards.png"))
    else:
        parts.append("<p class='note'>No rewards or evaluations logged.</p>")

    parts.append("<h2>Where the step time went</h2>")
    breakdown = step_breakdown(run.events) if run.events else {}
    if breakdown:
        figure("breakdown", plot_breakdown(breakdown, out / "step_breakdown.png", max_width=MAX_WIDTH_IN))
    else:
        parts.append("<p class='note'>No step-time breakdown: it needs phase events in the timeline.</p>")

    parts.append("<h2>Rollout</h2>")
    gantt = plot_gantt(run.events, out / "rollout_gantt.png") if run.events else None
    if gantt is not None:
        path, shown = gantt
        n_roll = len(bubbles) if bubble_source == "timeline" else len(shown)
        last = max(bubbles) if bubbles and bubble_source == "timeline" else shown[-1]
        which = "the last" if shown[-1] >= last else "around the last layout switch:"
        span = f" Drawn: {which} {len(shown)} of {n_roll} steps with a rollout (steps {shown[0]}-{shown[-1]})." \
            if n_roll > len(shown) else f" Drawn: all {len(shown)} step(s) with a rollout."
        figure("gantt", path, span)
    else:
        parts.append("<p class='note'>No rollout Gantt: it needs rollout phases and request events in the timeline.</p>")
    if bubbles:
        source = "" if bubble_source == "timeline" else " Source: rollout/bubble_ratio in metrics.jsonl (no timeline)."
        figure("bubbles", plot_bubbles({s: {"worker_bubble": v} for s, v in bubbles.items()},
                                       out / "rollout_bubbles.png", max_width=MAX_WIDTH_IN), source)
    else:
        parts.append("<p class='note'>No bubble ratios: neither the timeline nor metrics.jsonl has them.</p>")

    from megatron_sortedrl.telemetry.reward_panel import CAPTION as REWARD_CAPTION, plot_reward_stage

    if (reward_png := plot_reward_stage(run.steps, out / "reward_stage.png")) is not None:
        parts += ["<h2>Reward stage</h2>", f"<figure>{img_tag(reward_png)}<figcaption>{e(REWARD_CAPTION)}</figcaption></figure>"]

    from megatron_sortedrl.telemetry.tools_panel import CAPTION as TOOLS_CAPTION, plot_tools, tools_summary

    if (tools_png := plot_tools(run.steps, out / "tools.png")) is not None:
        t = tools_summary(run.steps)
        parts += ["<h2>Tools</h2>", f"<p>{t['calls']:.0f} tool calls, {t['calls_per_trajectory']:.2f} per trajectory; "
                  f"{t['errors']:.0f} errors, {t['errors_per_call']:.3f} per call.</p>",
                  f"<figure>{img_tag(tools_png)}<figcaption>{e(TOOLS_CAPTION)}</figcaption></figure>"]

    parts.append("<h2>Speculative decoding</h2>")
    acc = plot_acceptance(run.steps, out / "draft_acceptance.png")
    if acc is not None:
        figure("acceptance", acc)
        figure("tokens_per_forward", plot_tokens_per_forward(run.steps, out / "tokens_per_forward.png"))
    else:
        parts.append("<p>Speculative decoding was off in this run (no spec/* metrics), so there is no draft acceptance.</p>")

    selective = plot_selective(run, out / "selective_rollout.png")
    if selective is not None:
        parts.append("<h2>Dynamic sampling and history skip</h2>")
        figure("selective", selective)

    parts.append("<h2>Staleness</h2>")
    totals = staleness_totals(list(run.steps.values()))
    if totals:
        figure("staleness", plot_staleness(totals, out / "staleness.png"))
        parts.append(_table(["versions behind", "samples"], [[str(k), str(v)] for k, v in totals.items()], "staleness"))
    else:
        parts.append("<p class='note'>No staleness histogram: no step logged rollout/staleness_hist "
                     "(runs from before it was added log only rollout/staleness_mean, in the table below).</p>")

    header, rows = step_rows(run, bubbles)
    if rows:
        with open(out / "steps.csv", "w", newline="") as f:
            csv.writer(f).writerows([header, *rows])
        parts += ["<h2>Per step</h2><p>Also in <code>steps.csv</code>. worker bubble: "
                  + ("from the timeline." if bubble_source == "timeline" else "from metrics.jsonl.") + "</p>",
                  _table(header, rows, "steps")]
    parts.append("</body></html>")
    page = out / "report.html"
    page.write_text("\n".join(parts), encoding="utf-8")
    return page
