"""The tools panel of the run report: tool calls, errors, turns and tool seconds per step (multi-turn runs).

    from megatron_sortedrl.telemetry.tools_panel import plot_tools, tools_summary
    path = plot_tools(steps, out / "tools.png")     # None when no step logged tools/*

Reads each step's `tools/calls`, `tools/errors`, `tools/errors_<kind>`, `tools/turns_per_trajectory`,
`tools/calling_share`, `tools/seconds` (the longest trajectory's tool wait: the tools' share of the critical
path) and `rollout/samples` (written by `agentic.trajectory.step_metrics` and the driver). The held-out
`eval/tools/*` are in the report's per-step table.
Left out: per-tool breakdowns (a run's metrics count calls over all its tools).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from megatron_sortedrl.agentic.tools import ERROR_KINDS

CAPTION = ("Left: tool calls per trajectory, the share of trajectories that called a tool, and assistant turns per "
           "trajectory (right axis). Right: tool errors per call by kind (stacked: timeout, crash, answer too long, "
           "malformed call, unknown tool, bad arguments), and seconds of tool wait on the step's critical path (the longest "
           "trajectory's summed tool waits; line, right axis).")


def _steps(steps: dict[int, dict[str, Any]]) -> list[int]:
    return [s for s in sorted(steps) if "tools/calls" in steps[s]]


def tools_summary(steps: dict[int, dict[str, Any]]) -> dict[str, float] | None:
    """Totals over the run: calls, errors, calls per trajectory and errors per call (None without tools/*)."""
    xs = _steps(steps)
    if not xs:
        return None
    calls = sum(steps[s]["tools/calls"] for s in xs)
    errors = sum(steps[s].get("tools/errors", 0.0) for s in xs)
    samples = sum(steps[s].get("rollout/samples", 0) for s in xs)
    return {"calls": calls, "errors": errors, "calls_per_trajectory": calls / samples if samples else 0.0,
            "errors_per_call": errors / calls if calls else 0.0}


def _second_axis(ax, xs: list[int], ys: list[float], label: str, ylabel: str, color: str, title: str) -> None:
    """`ys` as a line on a right-hand axis of `ax`, one legend for both axes, and the panel's title."""
    right = ax.twinx()
    right.plot(xs, ys, color=color, linestyle="--", marker=".", label=label)
    right.set_ylim(bottom=0)
    right.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = right.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, fontsize=8, loc="best")


def plot_tools(steps: dict[int, dict[str, Any]], path: Path) -> Path | None:
    from megatron_sortedrl.telemetry.report import plt, save_figure

    xs = _steps(steps)
    if not xs:
        return None
    fig, (ax, axe) = plt.subplots(1, 2, figsize=(12, 3.2))
    fig.subplots_adjust(wspace=0.45)  # room for both second-axis labels
    per = [steps[s]["tools/calls"] / max(1, steps[s].get("rollout/samples", 0)) for s in xs]
    ax.plot(xs, per, marker=".", color="#4C72B0", label="tool calls per trajectory")
    ax.plot(xs, [steps[s].get("tools/calling_share", 0.0) for s in xs], marker=".", color="#55A868",
            label="share calling a tool")
    ax.set_ylim(bottom=0)
    ax.set(xlabel="training step", ylabel="per trajectory / share")
    _second_axis(ax, xs, [steps[s].get("tools/turns_per_trajectory", 0.0) for s in xs], "turns per trajectory",
                 "turns", "#8172B3", "Tool use per step")
    bottom = [0.0] * len(xs)
    for kind in ERROR_KINDS:
        ys = [steps[s].get(f"tools/errors_{kind}", 0.0) / max(1.0, steps[s]["tools/calls"]) for s in xs]
        if any(ys):
            axe.bar(xs, ys, bottom=bottom, label=kind.replace("_", " "))
            bottom = [b + y for b, y in zip(bottom, ys)]
    axe.set(xlabel="training step", ylabel="errors per call")
    axe.set_ylim(0, max(0.05, 1.2 * max(bottom)))
    _second_axis(axe, xs, [steps[s].get("tools/seconds", 0.0) for s in xs], "tool wait on the critical path (s)",
                 "seconds", "#C44E52", "Tool errors and tool seconds per step")
    for a in (ax, axe):
        a.grid(alpha=0.3)
    return save_figure(fig, path)
