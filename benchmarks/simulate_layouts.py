"""Simulation benchmark: colocated against disaggregated, per scheduling policy, on one 8-GPU node (Qwen2.5-7B) and
on 128 GPUs (Qwen2.5-32B); figures committed to docs/benchmarks/sim_colocate.{json,md,png}.

    PYTHONPATH=. nice .venv/bin/python benchmarks/simulate_layouts.py --jobs 3          # both scenarios, 3 seeds
    PYTHONPATH=. nice .venv/bin/python benchmarks/simulate_layouts.py --scenarios qwen7b_8gpu --seeds 0,1,2,3,4

Rows: sync, tail, twotier and twotier+HistoSpec, each on both layouts (`scheduler/sim/layout_sim.py`), and per
layout and seed sync again at a rollout batch of twotier's mean harvest there (`sync@b<B>`, B prompts;
scheduler/sim/equal_footing.py). Every policy trains the scenario's mini-batches (`algorithm.ppo_mini_batch_size`,
one optimizer step each), so all make the same optimizer steps on the same data (`updates`); the switch (or
weight sync) comes once per harvest that trained (`harvests`, and once more for the last partial mini-batch):

- **colocated**: every GPU generates (engines on all GPUs), then the switch the planner prices
  (`megatron_sortedrl/plan/colocated.py`): engines sleep (level 2), the trainer's state comes back from host
  memory, training on every GPU, the state goes back to host, engines wake, the new weights over CUDA IPC;
- **disaggregated**: the trainer on GPUs of its own (7B: 4 of the node's 8, "halves both"; 32B: 96 of 128, the
  share `benchmarks/simulate_policies.py` chose for this scenario), the engines on the rest, stream training on
  (the trainer trains finished samples while the round's tail generates), the weights over the network
  (the model's bytes at 20 GB/s, the planner's default).

Each row runs with `workload.seed` 0, 1, 2 (the response lengths; the simulator is otherwise deterministic) and
reports the median with min and max of the run time, of `x_best_sync` (samples/s over the better of the same
seed's sync and sync@b<B> in the same layout) and of the throughput ratio to the same seed's `sync`
disaggregated row (`x sync disagg.`; > 1 is faster), with `updates` (optimizer steps) and
`max_staleness_steps` (the most optimizer steps between a sample's weights and its step). The `sync@b<B>`
rows of all seeds pool as one (`sync@b<lo>-<hi>` when B differs by seed). The 32B scenario is configs/sim_qwen32b_128gpu.yaml as
committed plus the layout keys, so its legacy rows (docs/benchmarks/simulation_qwen32b_128gpu.json) are
untouched; it takes most of the time (10-45 s per row and seed; the whole benchmark 9 minutes with --jobs 2 on
the shared 2-core machine).

Left out: bubbles and the staleness histogram in policy versions (the simulations run without a timeline, to be
fast: docs/benchmarks/simulation_*.json has them), asynchronous RL, and colocated stream training (an engine that ran dry would have to
sleep before its GPU trains; scheduler/sim/layout_sim.py).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from scheduler.sim.equal_footing import compare, pooled_labels  # noqa: E402
from scheduler.sim.layout_sim import step_costs  # noqa: E402
from scheduler.sim.sim_config import load_sim_config  # noqa: E402
from scheduler.sim.simulator import simulate  # noqa: E402

POLICIES = ("sync", "tail", "twotier", "twotier+histospec")
BASELINE = ("sync", "disaggregated")
# scenario -> (config, colocated overrides, disaggregated overrides)
SCENARIOS = {
    "qwen7b_8gpu": ("configs/sim_qwen7b_8gpu.yaml", ["layout.kind=colocated"],
                    ["layout.kind=disaggregated", "cluster.trainer_gpus=4", "cluster.stream_training=true"]),
    "qwen32b_128gpu": ("configs/sim_qwen32b_128gpu.yaml",
                       ["layout.kind=colocated", "layout.trainer_model_parallel=16"],  # the recipe's TP=8 x PP=2
                       ["layout.kind=disaggregated", "cluster.trainer_gpus=96", "cluster.stream_training=true"]),
}
LAYOUTS = ("colocated", "disaggregated")
KEEP = ("scenario", "layout", "policy", "seed", "total_s", "samples", "samples_per_s", "updates", "harvests",
        "switches", "samples_per_update", "max_staleness_steps", "x_best_sync", "best_sync", "x_best_sync_histospec",
        "rollout_s", "switch_s_per_step", "switch_s", "engines", "trainer_gpus", "streamed_tokens", "overrides",
        "sim_wall_s")


def fast(sim, run, policy: str):
    return simulate(sim, run, policy, record=False)  # no timeline: bubbles are left out


def run_one(task: tuple[str, str, int]) -> list[dict]:
    """One scenario, layout and seed: every policy, then sync at twotier's mean harvest (`sync@b<B>`)."""
    scenario, layout, seed = task
    path, colo, disagg = SCENARIOS[scenario]
    over = (colo if layout == "colocated" else disagg) + [f"workload.seed={seed}"]
    sim, run = load_sim_config(ROOT / path, over)
    step = {k: v for k, v in step_costs(sim, run).items() if k != "total"}

    def measured(label, result, row):
        # one switch (weight sync) per harvest that trained, one more for the last partial mini-batch
        switches = row["harvests"] + (result.optimizer_steps > sum(r["optimizer_steps"] for r in result.rounds))
        row.update(scenario=scenario, layout=layout, seed=seed, switches=switches,
                   rollout_s=sum(r["rollout_s"] for r in result.rounds), switch_s_per_step=step,
                   switch_s=switches * sum(step.values()), engines=sim.cluster.gpus - sim.cluster.trainer_gpus,
                   trainer_gpus=sim.cluster.trainer_gpus or sim.cluster.gpus,
                   streamed_tokens=sum(r["streamed_tokens"] for r in result.rounds), overrides=over)

    rows, _ = compare(sim, run, list(POLICIES), fast, measured)
    return [{k: r[k] for k in KEEP if k in r} for r in rows]


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def aggregate(runs: list[dict]) -> list[dict]:
    base = {(r["scenario"], r["seed"]): r["total_s"] for r in runs if (r["policy"], r["layout"]) == BASELINE}
    rows = []
    for scenario in SCENARIOS:
        for layout in LAYOUTS:
            here = [r for r in runs if (r["scenario"], r["layout"]) == (scenario, layout)]
            pooled = pooled_labels([r["policy"] for r in here])
            for policy in dict.fromkeys(pooled.values()):
                mine = [r for r in here if pooled[r["policy"]] == policy]
                ratios = [base[(scenario, r["seed"])] / r["total_s"] for r in mine if (scenario, r["seed"]) in base]
                rows.append({"scenario": scenario, "layout": layout, "policy": policy,
                             "seeds": [r["seed"] for r in mine], "total_s": spread([r["total_s"] for r in mine]),
                             "throughput_vs_sync_disaggregated": spread(ratios) if ratios else None,
                             "x_best_sync": spread([r["x_best_sync"] for r in mine]),
                             "rollout_share": spread([r["rollout_s"] / r["total_s"] for r in mine]),
                             "switch_share": spread([r["switch_s"] / r["total_s"] for r in mine]),
                             "updates": spread([r["updates"] for r in mine]),
                             "harvests": spread([r["harvests"] for r in mine]),
                             "max_staleness_steps": spread([r["max_staleness_steps"] for r in mine]),
                             "switch_s_per_step": mine[0]["switch_s_per_step"], "engines": mine[0]["engines"],
                             "trainer_gpus": mine[0]["trainer_gpus"], "samples": mine[0]["samples"]})
    return rows


def _fmt(s: dict | None, f: str = "{:.0f}") -> str:
    if not s:
        return "-"
    return f"{f.format(s['median'])} [{f.format(s['min'])}, {f.format(s['max'])}]"


def markdown(doc: dict) -> str:
    lines = ["# Colocated against disaggregated, simulated", "",
             f"`{doc['command']}`: {len(doc['seeds'])} seeds (`workload.seed` {', '.join(map(str, doc['seeds']))}), "
             "median [min, max]. Every policy trains the same mini-batches (`algorithm.ppo_mini_batch_size` samples "
             "per optimizer step), so all make the same optimizer steps on the same data (`updates`). `sync@b<B>` is "
             "sync with its rollout batch set to twotier's mean harvest in that layout and seed (B prompts), the way a "
             "sync user amortises the long tail. `x best sync` is samples/s over the better of sync and sync@b<B> in "
             "the same layout and seed; `x sync disagg.` over the same seed's sync disaggregated row "
             "(> 1: faster). `harvests`: rounds that trained (one switch each); `stale steps`: the most optimizer "
             "steps between a sample's weights and its step. Switch: the colocated step's sleep + reload + offload + wake + handoff seconds "
             "(plan/colocated.py formulas), the disaggregated step's network weight sync.", "",
             "| scenario | layout | policy | GPUs: engines / trainer | run time s | x best sync | x sync disagg. "
             "| switch s per step | switch share | rollout share | updates | harvests | stale steps |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in doc["rows"]:
        sw = sum(r["switch_s_per_step"].values())
        lines.append(f"| {r['scenario']} | {r['layout']} | {r['policy']} | {r['engines']} / {r['trainer_gpus']} | "
                     f"{_fmt(r['total_s'])} | {_fmt(r['x_best_sync'], '{:.2f}')} | "
                     f"{_fmt(r['throughput_vs_sync_disaggregated'], '{:.2f}')} | {sw:.1f} | "
                     f"{_fmt(r['switch_share'], '{:.1%}')} | {_fmt(r['rollout_share'], '{:.0%}')} | "
                     f"{_fmt(r['updates'])} | {_fmt(r['harvests'])} | {_fmt(r['max_staleness_steps'])} |")
    lines += ["", "Switch seconds per step, colocated: " + "; ".join(
        f"{r['scenario']}: " + ", ".join(f"{k} {v:.2f}" for k, v in r["switch_s_per_step"].items())
        for r in doc["rows"] if r["layout"] == "colocated" and r["policy"] == "sync")]
    return "\n".join(lines) + "\n"


def plot(doc: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scenarios = list(dict.fromkeys(r["scenario"] for r in doc["rows"]))
    fig, axes = plt.subplots(1, len(scenarios), figsize=(5.5 * len(scenarios), 3.6), squeeze=False)
    for ax, scenario in zip(axes[0], scenarios):
        for i, layout in enumerate(LAYOUTS):
            rows = [r for r in doc["rows"] if r["scenario"] == scenario and r["layout"] == layout
                    and r["policy"] in POLICIES]  # sync@b<B> is in the table and JSON
            xs = [POLICIES.index(r["policy"]) + (i - 0.5) * 0.4 for r in rows]
            med = [r["throughput_vs_sync_disaggregated"]["median"] for r in rows]
            err = [[m - r["throughput_vs_sync_disaggregated"]["min"] for m, r in zip(med, rows)],
                   [r["throughput_vs_sync_disaggregated"]["max"] - m for m, r in zip(med, rows)]]
            ax.bar(xs, med, 0.4, yerr=err, capsize=3, label=layout)
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xticks(range(len(POLICIES)), [p.replace("+histospec", "\n+HistoSpec") for p in POLICIES], fontsize=8)
        ax.set_ylabel("samples/s vs sync disaggregated")
        ax.set_title(scenario, fontsize=10)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenarios", default=",".join(SCENARIOS))
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--jobs", type=int, default=1, help="simulations run at once (processes)")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args(argv)
    scenarios = args.scenarios.split(",")
    seeds = [int(s) for s in args.seeds.split(",")]
    tasks = [(s, lay, seed) for s in scenarios for seed in seeds for lay in LAYOUTS]
    t0 = time.monotonic()
    runs = []
    with ProcessPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        for rows in pool.map(run_one, tasks):
            for run in rows:
                runs.append(run)
                print(f"{run['scenario']:>15} {run['layout']:>13} {run['policy']:>18} seed {run['seed']}: "
                      f"{run['total_s']:.0f} s, x best sync {run['x_best_sync']:.2f}, {run['updates']} updates "
                      f"(simulated in {run['sim_wall_s']} s)", flush=True)
    cmd = "python benchmarks/simulate_layouts.py" + ("" if args.scenarios == ",".join(SCENARIOS) else
                                                     f" --scenarios {args.scenarios}") + (
        "" if args.seeds == "0,1,2" else f" --seeds {args.seeds}")
    doc = {"command": cmd, "seeds": seeds, "baseline": "/".join(BASELINE),
           "scenarios": {s: {"config": SCENARIOS[s][0], "colocated": SCENARIOS[s][1], "disaggregated": SCENARIOS[s][2]}
                         for s in scenarios},
           "rows": aggregate(runs), "runs": runs, "wall_s": round(time.monotonic() - t0, 1)}
    md = markdown(doc)
    print(md)
    if not args.no_write:
        out = ROOT / "docs" / "benchmarks" / "sim_colocate"
        out.with_suffix(".json").write_text(json.dumps(doc, indent=1) + "\n")
        out.with_suffix(".md").write_text(md)
        plot(doc, out.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
