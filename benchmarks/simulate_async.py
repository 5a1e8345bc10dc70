"""Asynchronous rollout and training against the best sync, at equal optimizer steps, in a simulator scenario.

    nice .venv/bin/python benchmarks/simulate_async.py                        # the 32B scenario, ~15 min on 2 cores
    nice .venv/bin/python benchmarks/simulate_async.py --splits 64 --bounds 2 --stem async_quick
    nice .venv/bin/python benchmarks/simulate_async.py --scenario configs/sim_tiny_cpu.yaml --splits 1 --stem async_tiny

Rows, every one at the scenario's mini-batch (`algorithm.ppo_mini_batch_size`, the same optimizer steps for all):

- the synchronous baselines, colocated on every GPU: `sync` at its recipe's rollout batch, `twotier` (the default),
  their `+histospec` forms, and `sync@b<B>` / `sync+histospec@b<B>` at twotier's mean harvest (through
  `scheduler/sim/equal_footing.compare`, so `x_best_sync` means what it means in the other benchmarks);
- the asynchronous rows (`scheduler/sim/async_sim.py`), disaggregated at each `--splits` (trainer GPUs; the engines
  get the rest, so every row uses the same GPUs in all) and each `--bounds` (staleness bound in optimizer steps),
  with and without HistoSpec: `async` admits by the history (longest predicted first within each epoch),
  `async-fifo` in data order (as verl's fully-async and AReaL admit), both under the same admission control;
  `async-partial` counts the bound from each group's completion and caps only the samples in flight (what
  partial-rollout systems keep): a comparison, its `max_staleness_steps` says how old its oldest tokens got.

Per row (JSON `rows`): `samples_per_s`, `x_best_sync` (over the better plain sync), `x_best_sync_histospec` (over the
better sync+histospec), `ratio_to_limit` (asynchronous rows: over the overlapped bound at their split,
`scheduler/sim/limit.overlapped_limit`; synchronous rows: the colocated bound), `worker_bubble` (engine time with
nothing to run), `pause_share` (engine time paused for in-flight weights), `trainer_idle_share`,
`max_staleness_steps` (never above the row's bound), `discarded` (0) and `length_bias_max` (the largest per-epoch
deviation of the trained mean response length from the generated one). `headline`: the best asynchronous row
without and with HistoSpec, against the best sync. The simulator is deterministic: one run per row, wall time is
the simulator's own (`sim_wall_s`).

Left out: accuracy (the learning side is benchmarks/learning_parity.py), and the colocated asynchronous layout
(a trainer sharing the engines' GPUs cannot overlap them; the simulator refuses it).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from scheduler.sim.async_sim import simulate_any  # noqa: E402
from scheduler.sim.equal_footing import add_best_sync, compare  # noqa: E402
from scheduler.sim.limit import add_limit, physical_limit  # noqa: E402
from scheduler.sim.report import format_table, summarize  # noqa: E402
from scheduler.sim.sim_config import load_sim_config  # noqa: E402

SYNC_ROWS = ["sync", "twotier", "sync+histospec", "twotier+histospec"]
KEEP = ("policy", "samples_per_s", "total_s", "updates", "harvests", "x_best_sync", "x_best_sync_histospec",
        "best_sync", "ratio_to_limit", "overlapped_limit_s_per_sample", "worker_bubble", "slot_bubble", "pause_share",
        "trainer_idle_share", "max_staleness_steps", "discarded", "length_bias_max", "trainer_gpus", "bound",
        "placement", "sim_wall_s", "train_s", "rollout_s")


def async_labels(splits: list[int], bounds: list[int], fifo: bool) -> list[str]:
    out = []
    for t in splits:
        for s in bounds:
            for spec in ("", "+histospec"):
                out.append(f"async{spec}@t{t}s{s}")
                if fifo:
                    out.append(f"async-fifo{spec}@t{t}s{s}")
                    out.append(f"async-partial{spec}@t{t}s{s}")
    return out


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(15, 5.5))
    names = [r["policy"] for r in rows]
    x = range(len(rows))
    colors = ["tab:gray" if r.get("placement") != "async" else
              ("tab:orange" if "fifo" in r["policy"] else "tab:green") for r in rows]
    ax[0].bar(list(x), [r.get("x_best_sync", 0.0) for r in rows], color=colors)
    ax[0].axhline(1.0, color="black", lw=0.8)
    ax[0].set(xticks=list(x), xticklabels=names, ylabel="samples/s over the best sync (same optimizer steps)",
              title="Throughput (grey: synchronous, green: async, orange: async-fifo)")
    ax[1].bar([i - 0.2 for i in x], [100 * r.get("worker_bubble", 0.0) for r in rows], 0.4, label="engine bubble")
    ax[1].bar([i + 0.2 for i in x], [100 * r.get("trainer_idle_share", 0.0) for r in rows], 0.4, label="trainer idle")
    ax[1].set(xticks=list(x), xticklabels=names, ylabel="% of the run", title="Where time is lost")
    ax[1].legend()
    for a in ax:
        a.tick_params(axis="x", labelrotation=60, labelsize=6)
        for label in a.get_xticklabels():
            label.set_horizontalalignment("right")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scenario", default="configs/sim_qwen32b_128gpu.yaml")
    ap.add_argument("--splits", default="32,64,96", help="trainer GPUs of the asynchronous rows, comma-separated")
    ap.add_argument("--bounds", default="1,2,4,8", help="staleness bounds in optimizer steps, comma-separated")
    ap.add_argument("--no-fifo", action="store_true", help="leave out the async-fifo and async-partial rows")
    ap.add_argument("--stem", default="simulate_async_qwen32b_128gpu")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks")
    ap.add_argument("--machine-note", default="")
    args = ap.parse_args()
    try:
        splits = [int(x) for x in args.splits.split(",") if x]
        bounds = [int(x) for x in args.bounds.split(",") if x]
    except ValueError:
        print(f"error: --splits and --bounds take comma-separated integers (got {args.splits!r}, {args.bounds!r})",
              file=sys.stderr)
        return 2
    sim, run = load_sim_config(ROOT / args.scenario, [])
    t0 = time.time()
    load0 = os.getloadavg()
    rows, _ = compare(sim, run, SYNC_ROWS, simulate_any)
    for label in async_labels(splits, bounds, not args.no_fifo):
        t1 = time.time()
        res = simulate_any(sim, run, label)
        row = summarize(res)
        row["sim_wall_s"] = round(time.time() - t1, 1)
        rows.append(row)
        print(f"{label}: {row['samples_per_s']:.2f} samples/s, engine bubble {row['worker_bubble']:.1%}, "
              f"trainer idle {row['trainer_idle_share']:.1%}, max staleness {row['max_staleness_steps']} "
              f"({row['sim_wall_s']} s)", flush=True)
    add_best_sync(rows)
    limit = physical_limit(sim, run)
    add_limit(rows, limit)
    rows = [{k: r[k] for k in KEEP if k in r} for r in rows]
    bounded = [r for r in rows if r.get("placement") == "async" and "partial" not in r["policy"]]  # keep the bound
    plain = [r for r in bounded if "histospec" not in r["policy"]]
    spec = [r for r in bounded if "histospec" in r["policy"]]
    head = {}
    for name, group in (("async", plain), ("async+histospec", spec)):
        if group:
            best = max(group, key=lambda r: r["samples_per_s"])
            head[name] = {k: best.get(k) for k in ("policy", "x_best_sync", "x_best_sync_histospec", "worker_bubble",
                                                    "ratio_to_limit", "max_staleness_steps", "trainer_idle_share")}
    result = {"scenario": sim.name, "config": args.scenario, "splits": splits, "bounds": bounds,
              "best_sync": rows[0].get("best_sync"), "headline": head, "rows": rows,
              "limit": {k: limit[k] for k in ("s_per_sample", "throughput_s", "latency_s", "token_train_s",
                                              "step_fixed_s", "samples")},
              "machine": f"{platform.machine()} {os.cpu_count()} CPUs",
              "machine_note": args.machine_note or "not given.",
              "load_average": {"start": [round(x, 2) for x in load0], "end": [round(x, 2) for x in os.getloadavg()]},
              "benchmark_s": round(time.time() - t0, 1),
              "command": "python benchmarks/simulate_async.py " + " ".join(sys.argv[1:])}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.stem}.json").write_text(json.dumps(result, indent=1) + "\n")
    table = format_table(rows)
    (args.out / f"{args.stem}.md").write_text(
        f"# Asynchronous rows against the best sync: {sim.name}\n\nGenerated by `{result['command']}` "
        f"({result['benchmark_s']:.0f} s). Every row at {run.algorithm.ppo_mini_batch_size} samples per optimizer step; "
        f"figures in [{args.stem}.json]({args.stem}.json).\n\n```\n{table}\n```\n\nHeadline: "
        + "; ".join(f"{k}: {v['policy']} {v['x_best_sync']:.2f}x the best sync" for k, v in head.items()) + "\n")
    plot(rows, args.out / f"{args.stem}.png", sim.name)
    print(table)
    print(json.dumps(head, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
