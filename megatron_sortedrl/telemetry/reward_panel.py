"""The reward-stage panel of the run report: the reward critical path and the reward workers per step.

    from megatron_sortedrl.telemetry.reward_panel import plot_reward_stage
    path = plot_reward_stage(steps, out / "reward_stage.png")     # None when no step logged reward/*

Reads the `reward/critical_path_s`, `reward/critical_path_share`, `reward/workers_active` and
`reward/workers` of each step's metrics row (written by `reward_stage.RewardStage.step_metrics`).
Left out: per-prompt timeouts (they are in metrics.jsonl as `reward/timeouts_by_prompt`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

CAPTION = ("Left: seconds per step from the last trained sample finishing generation to the last of its rewards "
           "arriving (the reward critical path: every engine and trainer waits for it), and its share of the step "
           "(line, right axis). Right: reward workers in the pool and busy on average during the step.")


def plot_reward_stage(steps: dict[int, dict[str, Any]], path: Path) -> Path | None:
    from megatron_sortedrl.telemetry.report import plt, save_figure

    xs = [s for s in sorted(steps) if "reward/critical_path_s" in steps[s]]
    if not xs:
        return None
    fig, (ax, axw) = plt.subplots(1, 2, figsize=(12, 3.2))
    fig.subplots_adjust(wspace=0.4)  # room for the left panel's second axis label
    ax.bar(xs, [steps[s]["reward/critical_path_s"] for s in xs], color="#DD8452", label="critical path (s)")
    ax.set_xlabel("training step")
    ax.set_ylabel("seconds")
    share = ax.twinx()
    share.plot(xs, [steps[s].get("reward/critical_path_share", 0.0) for s in xs], color="#4C72B0", marker=".",
               label="share of step")
    share.set_ylim(0, max(0.1, 1.1 * max(steps[s].get("reward/critical_path_share", 0.0) for s in xs)))
    share.set_ylabel("share of the step")
    ax.set_title("Reward critical path per step", fontsize=10)
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = share.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, fontsize=8, loc="upper left")
    for key, label, color in (("reward/workers", "workers in the pool (end of step)", "#55A868"),
                              ("reward/workers_max", "most workers during the step", "#8172B3"),
                              ("reward/workers_active", "busy workers (mean)", "#C44E52")):
        ys = [s for s in xs if key in steps[s]]
        axw.plot(ys, [steps[s][key] for s in ys], label=label, color=color, marker=".")
    axw.set_xlabel("training step")
    axw.set_ylabel("workers")
    axw.set_ylim(bottom=0)
    axw.set_title("Reward workers", fontsize=10)
    axw.legend(fontsize=8, loc="best")
    for a in (ax, axw):
        a.grid(alpha=0.3)
    return save_figure(fig, path)
