"""The speculative-decoding panels of the run report: draft acceptance and tokens per target forward per step.

    from megatron_sortedrl.telemetry.spec_panel import plot_acceptance, plot_tokens_per_forward
    path = plot_acceptance(steps, out / "draft_acceptance.png")   # None when no step logged spec/*

Reads each step's `spec/mean_accepted_length`, `spec/tokens_per_forward`, `spec/acceptance_rate` (the drafter's
own figures, speculative/metrics.py) and `spec/step/*` with `spec/round_long` (vLLM's counters per step and the
round kind, speculative/feed.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from matplotlib.ticker import MaxNLocator

from megatron_sortedrl.telemetry.report import plt, save_figure


def plot_acceptance(steps: dict[int, dict[str, Any]], path: Path) -> Path | None:
    drawn = [s for s in sorted(steps) if "spec/mean_accepted_length" in steps[s] or "spec/acceptance_rate" in steps[s]]
    if not drawn:
        return None
    fig, ax = plt.subplots(figsize=(9, 3))
    for key, label, color in (("spec/mean_accepted_length", "mean accepted length (tokens)", "#4C72B0"),
                              ("spec/tokens_per_forward", "tokens per target forward", "#55A868")):
        xs = [s for s in drawn if key in steps[s]]
        if xs:
            ax.plot(xs, [steps[s][key] for s in xs], label=label, color=color, marker="." if len(xs) <= 60 else None)
    ax.set_xlabel("training step")
    ax.set_ylabel("tokens")
    ax.grid(alpha=0.3)
    rate = [s for s in drawn if "spec/acceptance_rate" in steps[s]]
    handles, labels = ax.get_legend_handles_labels()
    if rate:
        ax2 = ax.twinx()
        ax2.plot(rate, [steps[s]["spec/acceptance_rate"] for s in rate], color="#C44E52", linestyle="--",
                 label="acceptance rate (right axis)")
        ax2.set_ylim(0, 1)
        ax2.set_ylabel("acceptance rate")
        h2, l2 = ax2.get_legend_handles_labels()
        handles, labels = handles + h2, labels + l2
    ax.legend(handles, labels, fontsize=8, loc="upper left", bbox_to_anchor=(1.1 if rate else 1.0, 1.0))
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_title("Speculative decoding: draft acceptance per step", fontsize=10)
    return save_figure(fig, path)


def tokens_per_forward_by_kind(steps: dict[int, dict[str, Any]]) -> dict[str, float]:
    """Tokens per target forward over all steps, short rounds and long rounds (`spec/step/*`, vLLM's counters)."""
    sums: dict[str, list[float]] = {}
    for r in steps.values():
        if r.get("spec/step/target_forwards"):
            for kind in ("all", "long" if r.get("spec/round_long") else "short"):
                t = sums.setdefault(kind, [0.0, 0.0])
                t[0] += r["spec/step/tokens"]
                t[1] += r["spec/step/target_forwards"]
    return {k: t[0] / t[1] for k, t in sums.items() if t[1]}


def plot_tokens_per_forward(steps: dict[int, dict[str, Any]], path: Path) -> Path | None:
    """Per step tokens per target forward, short and long rounds apart, with each kind's run-wide figure."""
    drawn = [s for s in sorted(steps) if steps[s].get("spec/step/target_forwards")]
    if not drawn or all(steps[s].get("spec/step/accepted_tokens", 0) == 0 for s in drawn):
        return None
    overall = tokens_per_forward_by_kind(steps)
    fig, ax = plt.subplots(figsize=(9, 3))
    for kind, color in (("short", "#4C72B0"), ("long", "#DD8452")):
        xs = [s for s in drawn if bool(steps[s].get("spec/round_long")) == (kind == "long")]
        if xs:
            ax.plot(xs, [steps[s]["spec/step/tokens_per_forward"] for s in xs], "o", ms=3, color=color,
                    label=f"{kind} rounds (all steps: {overall.get(kind, float('nan')):.2f})")
            ax.axhline(overall[kind], color=color, lw=0.8, ls="--")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xlabel("training step")
    ax.set_ylabel("tokens / target forward")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_title("Speculative decoding: tokens per target forward per round kind", fontsize=10)
    return save_figure(fig, path)
