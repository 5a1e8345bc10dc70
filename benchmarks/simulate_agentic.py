"""Simulation benchmark of multi-turn, tool-using rollouts: sync, tail, twotier and twotier+HistoSpec on the agent
scenario, several seeds, at equal footing: ratios to the better sync of the same seed, the same optimizer steps.

    nice .venv/bin/python benchmarks/simulate_agentic.py                    # about two minutes on 2 CPU cores
    nice .venv/bin/python benchmarks/simulate_agentic.py --config configs/sim_agentic_7b_8gpu.yaml --seeds 0,1,2,3,4

Scenario: configs/sim_agentic_7b_8gpu.yaml (Qwen2.5-7B on 8 GPUs, 1-8 assistant turns per trajectory, tool
latencies log-normal per kind from 0.1 s to tens of seconds; scheduler/sim/trajectory_sim.py). Each seed redraws the
whole workload (`workload.seed`: turns, tokens, tool calls, rewards); within a seed every policy sees the same
trajectories. Every policy trains the scenario's mini-batches (`algorithm.ppo_mini_batch_size`, one optimizer
step each), so on the same data all make the same optimizer steps (`updates`); per seed `sync` also runs at a
rollout batch of twotier's mean harvest in that seed (`sync@b<B>`, B prompts; scheduler/sim/equal_footing.py).
Per seed a row per policy gives samples/s, `x_best_sync` (over the better of that seed's two sync rows),
`throughput_vs_sync` (over sync's at its recipe batch, in that seed), `max_staleness_steps` and `updates`;
the table reports the median over seeds with [min, max] (the `sync@b<B>` rows of all seeds pool as one,
`sync@b<lo>-<hi>` when B differs by seed), and `ratio_to_limit` (time per trained sample over
the scenario's physical limit, `scheduler/sim/limit.py`, tool latencies included). `<policy>@tokens_only` rows are references, not
baselines: the policy with its history predicting tokens alone (tool seconds weigh nothing: `tokens_per_tool_s`
0), to show what predicting the trajectory's cost buys. Also per policy: worker bubble, staleness share, wasted
tokens, harvests (`rounds`) and the trajectories' tool calls and tool seconds.

Writes docs/benchmarks/sim_agentic.json (every seed's rows and the summary), sim_agentic.md (the table) and
sim_agentic.png (throughput vs the better sync per policy, one dot per seed).

Left out: accuracy (the simulator has no model), tool-pool queueing and prefix-cache eviction during tool calls
(scheduler/sim/trajectory_sim.py says why).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.regime_grid import _stale_share  # noqa: E402
from scheduler.sim.equal_footing import compare, pooled_labels  # noqa: E402
from scheduler.sim.limit import physical_limit  # noqa: E402
from scheduler.sim.sim_config import load_sim_config  # noqa: E402
from scheduler.sim.simulator import simulate  # noqa: E402

CONFIG = "configs/sim_agentic_7b_8gpu.yaml"
POLICIES = ("sync", "tail", "twotier", "twotier+histospec", "tail@tokens_only", "twotier@tokens_only")
KEEP = ("policy", "total_s", "samples", "samples_per_s", "rounds", "long_rounds", "worker_bubble", "slot_bubble",
        "max_staleness", "staleness", "wasted_tokens", "tokens_trained", "preemptions", "x_best_sync", "best_sync",
        "updates", "harvests", "samples_per_update", "max_staleness_steps", "seed", "sim_wall_s", "stale_share",
        "trajectory")
SPREAD = ("x_best_sync", "throughput_vs_sync", "samples_per_s", "ratio_to_limit", "total_s", "worker_bubble",
          "stale_share", "wasted_tokens", "rounds", "updates", "max_staleness_steps")


def simulate_variant(sim, run, policy: str):
    """`<policy>@tokens_only`: the history's tool seconds weigh nothing in the predicted cost."""
    base, _, variant = policy.partition("@")
    if variant == "tokens_only":
        with mock.patch("scheduler.sim.simulator.tokens_per_tool_s", lambda *_: 0.0):
            return simulate(sim, run, base)
    return simulate(sim, run, policy)


def run_seed(config: str, seed: int) -> list[dict]:
    sim, run = load_sim_config(ROOT / config, [f"workload.seed={seed}"])

    def measured(label, result, row):
        row.update(seed=seed, stale_share=_stale_share(row), trajectory=result.policy_stats["trajectory"])

    rows, _ = compare(sim, run, list(POLICIES), simulate_variant, measured)
    rows = [{k: r[k] for k in KEEP if k in r} for r in rows]
    sync = next(r for r in rows if r["policy"] == "sync")
    limit = physical_limit(sim, run, speculation=True)  # tool latencies on the critical path included
    for r in rows:
        r["throughput_vs_sync"] = r["samples_per_s"] / sync["samples_per_s"]
        r["ratio_to_limit"] = r["total_s"] / r["samples"] / limit["s_per_sample"]
    return rows


def summarize_seeds(rows: list[dict]) -> list[dict]:
    """Median, min and max over seeds per policy (`sync@b<B>` rows pooled: scheduler.sim.equal_footing.pooled_labels)."""
    pooled = pooled_labels([r["policy"] for r in rows])
    out = []
    for policy in dict.fromkeys(pooled.values()):
        mine = [r for r in rows if pooled[r["policy"]] == policy]

        def spread(key: str) -> list[float]:
            vals = [r[key] for r in mine]
            return [statistics.median(vals), min(vals), max(vals)]

        out.append({"policy": policy, "seeds": len(mine), **{k: spread(k) for k in SPREAD}})
    return out


def fmt(v: list[float], f: str = "{:.2f}") -> str:
    return f"{f.format(v[0])} [{f.format(v[1])}, {f.format(v[2])}]"


def write_md(doc: dict, path: Path) -> None:
    t = doc["trajectories"]
    lines = ["# Multi-turn agent workload (simulated)", "",
             f"Generated by `benchmarks/simulate_agentic.py` on `{doc['config']}` ({doc['scenario']}); "
             f"seeds {', '.join(map(str, doc['seeds']))}: median [min, max] over seeds, ratios within each seed. "
             "Every policy trains the same mini-batches (`algorithm.ppo_mini_batch_size` samples per optimizer step), "
             "so all make the same optimizer steps on the same data (`updates`); `sync@b<B>` is sync with its rollout "
             "batch set to twotier's mean harvest in that seed (B prompts), the way a sync user amortises the long "
             "tail. `x best sync`: samples/s over the better of sync and sync@b<B> in the same seed; `x sync`: over "
             "sync at its recipe batch. `stale steps`: the most optimizer steps between a sample's weights and its "
             "step; `harvests`: rounds that trained. "
             f"Trajectories: {t['mean_turns']:.2f} assistant turns and {t['mean_tool_s']:.1f} tool seconds on average "
             f"(seed {doc['seeds'][0]}). See docs/scheduler.md, \"Multi-turn trajectories\".", "",
             "| policy | x best sync | x sync | x limit | samples/s | total s | worker bubble | stale share | stale steps "
             "| wasted tokens | updates | harvests |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in doc["summary"]:
        lines.append(f"| {r['policy']} | {fmt(r['x_best_sync'])} | {fmt(r['throughput_vs_sync'])} | {fmt(r['ratio_to_limit'])} | "
                     f"{fmt(r['samples_per_s'])} | {fmt(r['total_s'], '{:.0f}')} | {fmt(r['worker_bubble'], '{:.1%}')} | "
                     f"{fmt(r['stale_share'], '{:.0%}')} | {fmt(r['max_staleness_steps'], '{:.0f}')} | "
                     f"{fmt(r['wasted_tokens'], '{:.0f}')} | {fmt(r['updates'], '{:.0f}')} | {fmt(r['rounds'], '{:.0f}')} |")
    best = max(doc["summary"], key=lambda r: r["x_best_sync"][0])
    lines += ["", f"Fastest by median: `{best['policy']}` ({best['x_best_sync'][0]:.2f}x the better sync). `x limit`: time per "
              "trained sample over the physical limit's (scheduler/sim/limit.py, with tool latencies on the critical path "
              "and speculation at its best acceptance: a lower bound for every row). `@tokens_only` rows are references: "
              "the policy predicting tokens alone."]
    path.write_text("\n".join(lines) + "\n")


def plot(doc: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    pooled = pooled_labels([x["policy"] for x in doc["rows"]])
    for i, r in enumerate(doc["summary"]):
        dots = [x["x_best_sync"] for x in doc["rows"] if pooled[x["policy"]] == r["policy"]]
        ax[0].bar(i, r["x_best_sync"][0], color="tab:blue", alpha=0.6)
        ax[0].plot([i] * len(dots), dots, "k.", ms=6)
        ax[1].bar(i, r["worker_bubble"][0], color="tab:orange", alpha=0.6)
    for a in ax:
        a.set_xticks(range(len(doc["summary"])), [r["policy"] for r in doc["summary"]], rotation=30, ha="right", fontsize=8)
    ax[0].axhline(1.0, color="gray", lw=0.8)
    ax[0].set(ylabel="samples/s vs the better sync (dots: seeds)", title="Throughput, multi-turn agent workload")
    ax[1].set(ylabel="worker bubble (median)", title="Idle engine time in rollout")
    fig.suptitle(doc["scenario"], fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=CONFIG)
    ap.add_argument("--seeds", default="0,1,2", help="comma-separated workload seeds (at least 3 for the committed figures)")
    ap.add_argument("--out", default=str(ROOT / "docs" / "benchmarks"))
    args = ap.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",") if s]
    rows: list[dict] = []
    t0 = time.time()
    for seed in seeds:
        for r in run_seed(args.config, seed):
            rows.append(r)
            print(f"seed {seed}  {r['policy']:18s} x best sync {r['x_best_sync']:.2f}  x sync {r['throughput_vs_sync']:.2f}  "
                  f"{r['total_s']:.0f} s  {r['updates']} updates  "
                  f"wb {r['worker_bubble']:.3f}  stale {r['stale_share']:.0%}  ({r['sim_wall_s']} s)", flush=True)
    sim, _ = load_sim_config(ROOT / args.config)
    doc = {"scenario": sim.name, "config": args.config, "seeds": seeds, "wall_s": round(time.time() - t0, 1),
           "loadavg": " ".join(f"{x:.1f}" for x in os.getloadavg()),
           "trajectories": rows[0]["trajectory"], "summary": summarize_seeds(rows), "rows": rows}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sim_agentic.json").write_text(json.dumps(doc, indent=1))
    write_md(doc, out / "sim_agentic.md")
    plot(doc, out / "sim_agentic.png")
    print((out / "sim_agentic.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
