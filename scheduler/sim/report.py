"""Figures of simulated runs: bubble ratios (from the timeline, with the telemetry functions a real run
uses), rollout and step time, throughput, staleness and samples per update; a table and a plot.

    from scheduler.sim.report import summarize, format_table, plot
    rows = [summarize(simulate(sim, run, p)) for p in ("sync", "twotier")]
    print(format_table(rows)); plot(rows, results, "docs/benchmarks/simulation.png")

Bubble ratios are pooled over all rollout phases, each phase weighted by its worker-seconds (worker
bubble) or slot-seconds (slot bubble), exactly as `worker_bubble_ratio(events)` with `step=None` does;
they are computed per step on that step's events only, which is the same number but linear in time.
Throughput is samples trained per second of wall time over the whole run (every policy trains the same
samples: all prompts x n x epochs). "vs sync" columns are ratios to the `sync` row of the same run; `x_best_sync`
(scheduler/sim/equal_footing.py) is the ratio to the better of sync at its recipe batch and sync at the default's mean
harvest, at the same samples per optimizer step. `updates` are optimizer steps (mini-batches x epochs), and
`max_staleness_steps` the largest number of optimizer steps between a trained sample's weights and its step.

Left out: accuracy (the simulator has no model), and NVML utilisation.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from megatron_sortedrl.telemetry.timeline import Event, phase_window, slot_bubble_ratio, step_breakdown, worker_bubble_ratio


def _by_step(events: list[Event]) -> dict[int, list[Event]]:
    out: dict[int, list[Event]] = defaultdict(list)
    for e in events:
        out[e.step].append(e)
    return out


def bubble_ratios(events: list[Event], max_batch: int) -> dict[str, float]:
    """Pooled worker and slot bubble ratios over every rollout phase of the timeline."""
    w_idle = w_total = s_idle = s_total = 0.0
    for step, evs in _by_step(events).items():
        window = phase_window(evs, step, "rollout")
        if window is None or window[1] <= window[0]:
            continue
        workers = {e.worker for e in evs if e.kind == "request" and e.worker is not None}
        if not workers:
            continue
        span = window[1] - window[0]
        w_idle += worker_bubble_ratio(evs, step) * len(workers) * span
        w_total += len(workers) * span
        s_idle += slot_bubble_ratio(evs, max_batch, step) * len(workers) * span
        s_total += len(workers) * span
    return {"worker_bubble": w_idle / w_total if w_total else 0.0, "slot_bubble": s_idle / s_total if s_total else 0.0}


def summarize(result: Any) -> dict[str, Any]:
    """One table row (plain numbers) for a `SimResult`."""
    rounds = result.rounds
    samples = sum(r["samples"] for r in rounds)
    phases: dict[str, float] = defaultdict(float)
    for row in step_breakdown(result.events).values():
        for k, v in row.items():
            phases[k] += v
    stale = result.staleness
    row = {
        "policy": result.policy,
        **bubble_ratios(result.events, result.max_num_seqs),
        "rounds": len(rounds),
        "long_rounds": sum(1 for r in rounds if r["kind"] == "long"),
        "samples": samples,
        "total_s": result.total_s,
        "rollout_s": phases.get("rollout", 0.0),
        "train_s": phases.get("train", 0.0),
        "relayout_s": phases.get("relayout", 0.0),
        "step_s": result.total_s / max(1, len(rounds)),
        "samples_per_s": samples / result.total_s if result.total_s else 0.0,
        "updates": result.optimizer_steps,
        "harvests": sum(1 for r in rounds if r.get("optimizer_steps")),
        "samples_per_update": samples / max(1, result.optimizer_steps),
        "samples_per_harvest": samples / max(1, sum(1 for r in rounds if r.get("optimizer_steps"))),
        "max_staleness": max(stale) if stale else 0,
        "max_staleness_steps": max((a for r in rounds for a in r.get("staleness_steps", [])), default=0),
        "staleness": {str(k): v for k, v in sorted(stale.items())},
        "preemptions": sum(r["preemptions"] for r in rounds),
        "wasted_tokens": result.policy_stats.get("wasted_tokens", 0),
        "tokens_trained": sum(r["tokens"] for r in rounds),
    }
    fig = result.policy_stats.get("async")  # an asynchronous run (scheduler/sim/async_sim.py): its own figures
    if fig:
        row.update(placement="async", worker_bubble=fig["worker_bubble"], pause_share=fig["pause_share"],
                   trainer_idle_share=fig["trainer_idle_share"], trainer_gpus=fig["trainer_gpus"], bound=fig["bound"],
                   discarded=fig["discarded"], length_bias_max=fig["length_bias_max"],
                   harvests=-(-result.optimizer_steps // max(1, fig["steps_per_push"])))
    return row


def add_ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    base = next((r for r in rows if r["policy"] == "sync"), None)
    for r in rows:
        if base:
            r["throughput_vs_sync"] = r["samples_per_s"] / base["samples_per_s"] if base["samples_per_s"] else 0.0
            r["time_vs_sync"] = r["total_s"] / base["total_s"] if base["total_s"] else 0.0
    return rows


COLUMNS = [("policy", "policy", "{}"), ("worker_bubble", "worker bubble", "{:.1%}"), ("slot_bubble", "slot bubble", "{:.1%}"),
           ("rollout_s", "rollout s", "{:.0f}"), ("step_s", "step s", "{:.1f}"), ("samples_per_s", "samples/s", "{:.2f}"),
           ("throughput_vs_sync", "x sync", "{:.2f}"), ("x_best_sync", "x best sync", "{:.2f}"),
           ("ratio_to_limit", "x limit", "{:.2f}"), ("updates", "updates", "{}"),
           ("samples_per_update", "samples/upd", "{:.0f}"), ("max_staleness_steps", "stale steps", "{}"),
           ("rounds", "rounds", "{}"), ("long_rounds", "long", "{}"), ("max_staleness", "max stale", "{}"),
           ("preemptions", "preempt", "{}")]


def format_table(rows: list[dict[str, Any]]) -> str:
    head = [c[1] for c in COLUMNS]
    body = [[fmt.format(r[k]) if k in r else "-" for k, _, fmt in COLUMNS] for r in rows]
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(head)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(head, widths))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(b, widths)) for b in body]
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], results: list[Any], path: str, title: str = "") -> None:
    """Four panels: bubble ratios, time split, throughput vs sync, staleness histogram."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["policy"] for r in rows]
    fig, ax = plt.subplots(2, 2, figsize=(12, 8.5))
    x = range(len(rows))
    ax[0][0].bar([i - 0.2 for i in x], [r["worker_bubble"] * 100 for r in rows], 0.4, label="worker bubble")
    ax[0][0].bar([i + 0.2 for i in x], [r["slot_bubble"] * 100 for r in rows], 0.4, label="slot bubble")
    ax[0][0].set(xticks=list(x), xticklabels=names, ylabel="% of rollout time", title="Rollout bubble ratio")
    ax[0][0].legend()
    bottom = [0.0] * len(rows)
    for key in ("rollout_s", "train_s", "relayout_s"):
        vals = [r[key] for r in rows]
        ax[0][1].bar(list(x), vals, bottom=bottom, label=key.replace("_s", ""))
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax[0][1].bar(list(x), [r["total_s"] - b for r, b in zip(rows, bottom)], bottom=bottom, label="sync/other")
    ax[0][1].set(xticks=list(x), xticklabels=names, ylabel="seconds (same samples trained)", title="Wall time")
    ax[0][1].legend()
    best = all("x_best_sync" in r for r in rows)  # equal footing (scheduler/sim/equal_footing.py)
    ax[1][0].bar(list(x), [r.get("x_best_sync" if best else "throughput_vs_sync", 0) for r in rows], color="tab:green")
    ax[1][0].axhline(1.0, color="gray", lw=0.8)
    ax[1][0].set(xticks=list(x), xticklabels=names,
                 ylabel="samples/s relative to the best sync" if best else "samples/s relative to sync",
                 title="Throughput vs the best sync, same optimizer steps" if best else "Throughput vs sync")
    width = 0.8 / max(1, len(rows))
    for i, r in enumerate(rows):
        hist = {int(k): v for k, v in r["staleness"].items()}
        ax[1][1].bar([k + i * width for k in hist], list(hist.values()), width, label=r["policy"])
    ax[1][1].set(xlabel="staleness (policy versions)", ylabel="trained samples", title="Staleness histogram")
    ax[1][1].legend(fontsize=7, ncol=2)
    for a in (ax[0][0], ax[0][1], ax[1][0]):
        a.tick_params(axis="x", labelrotation=35, labelsize=7)
        for label in a.get_xticklabels():
            label.set_horizontalalignment("right")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
