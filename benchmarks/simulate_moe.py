"""MoE simulation benchmark: Qwen3-235B-A22B on 128 GPUs through every tier-1 policy, with and without HistoSpec,
over three seeds; and the same scenario on a dense-equivalent engine, to show what active-parameter decode
changes. Figures committed to docs/benchmarks/.

    PYTHONPATH=. nice -n 19 .venv/bin/python benchmarks/simulate_moe.py          # about 17 minutes on 2 shared CPU cores
    PYTHONPATH=. nice -n 19 .venv/bin/python benchmarks/simulate_moe.py --seeds 0,1,2,3,4 --jobs 1

The scenario is configs/sim_qwen3_235b_128gpu.yaml (MoE engine costs: memory follows the 438 GiB of total
weights, decode reads the shared weights plus the experts a step's tokens are routed to;
`scheduler/cost_model.py`). A seed sets the synthetic lengths (`workload.seed`) and the run's seed
(`run.seed`). Every policy trains the scenario's mini-batches (`algorithm.ppo_mini_batch_size`, one optimizer
step each), so all make the same optimizer steps on the same data (`updates`); per seed, sync and
sync+histospec also run at a rollout batch of twotier's mean harvest in that seed (`sync@b<B>`, B prompts;
scheduler/sim/equal_footing.py). Writes docs/benchmarks/simulation_qwen3_235b_128gpu.json, .md and .png:

- `rows`: per policy the median and [min, max] over seeds of total time, samples/s, `x_best_sync` (samples/s
  over the better of the seed's sync and sync@b<B>; `x_best_sync_histospec` for +histospec rows, against the
  better sync+histospec), throughput relative to sync of the same seed, worker and slot bubble, rounds
  (harvests), `updates` (optimizer steps), `max_staleness_steps`, preemptions, and the ratio to the physical
  limit (`scheduler/sim/limit.py`, with speculation at its best acceptance, so a lower bound for every row); the
  `sync@b<B>` rows of all seeds pool as one (`sync@b<lo>-<hi>` when B differs by seed);
- `runs`: every (policy, seed) summary as `scheduler/report.summarize` writes it;
- `dense_equivalent`: sync, twotier(+histospec) and sync@b<B> with `engine.expert_weight_gib=0`, i.e. a dense model of the
  same total size whose every decode step reads all 438 GiB (the old cost model's view of this model);
- `decode_by_batch`: one TP=4 engine's decode tokens/s by running sequences, MoE against dense-equivalent,
  with and without HistoSpec at history age 0 (drafts touch more experts, so they pay less on MoE).

The simulator is deterministic per seed; seeds differ in the lengths drawn. Left out: accuracy (no model in
the simulator), expert-parallel engines, routing skew (see the cost model's docstring).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from scheduler.sim.equal_footing import compare, pooled_labels  # noqa: E402
from scheduler.sim.limit import physical_limit  # noqa: E402
from scheduler.sim.sim_config import load_sim_config  # noqa: E402
from scheduler.sim.simulator import simulate  # noqa: E402
from scheduler.sim.speculation_model import HistoSpecSim, chain  # noqa: E402

CONFIG = "configs/sim_qwen3_235b_128gpu.yaml"
NAME = "qwen3_235b_128gpu"
POLICIES = ("sync", "sorted", "tail", "twotier", "sync+histospec", "sorted+histospec", "tail+histospec",
            "twotier+histospec")
DENSE_POLICIES = ("sync", "twotier", "twotier+histospec")
STATS = ("total_s", "samples_per_s", "throughput_vs_sync", "worker_bubble", "slot_bubble", "rounds", "preemptions",
         "ratio_to_limit", "max_staleness", "wasted_tokens", "x_best_sync", "updates", "harvests",
         "max_staleness_steps", "x_best_sync_histospec")


def _load(seed: int, dense: bool):
    sim, run = load_sim_config(ROOT / CONFIG, [f"workload.seed={seed}", f"run.seed={seed}"])
    if dense:
        sim = replace(sim, engine=replace(sim.engine, expert_weight_gib=0.0))
    return sim, run


def run_seed(job: tuple[int, bool]) -> list[dict]:
    """One seed on one engine: its policies, then sync at twotier's mean harvest (scheduler/sim/equal_footing.py)."""
    seed, dense = job
    sim, run = _load(seed, dense)
    rows, _ = compare(sim, run, list(DENSE_POLICIES if dense else POLICIES), simulate)
    for row in rows:
        row.update(seed=seed, engine="dense-equivalent" if dense else "moe")
    return rows


def aggregate(runs: list[dict], limits: dict[int, float]) -> list[dict]:
    """Median and [min, max] over seeds per policy; throughput vs sync is taken within each seed first."""
    sync = {r["seed"]: r for r in runs if r["policy"] == "sync"}
    for r in runs:
        r["throughput_vs_sync"] = r["samples_per_s"] / sync[r["seed"]]["samples_per_s"]
        r["ratio_to_limit"] = r["total_s"] / r["samples"] / limits[r["seed"]]
    pooled = pooled_labels([r["policy"] for r in runs])
    rows = []
    for policy in dict.fromkeys(pooled.values()):
        mine = [r for r in runs if pooled[r["policy"]] == policy]
        row = {"policy": policy, "seeds": sorted(r["seed"] for r in mine)}
        for k in STATS:
            vals = [float(r[k]) for r in mine if k in r]
            if not vals:
                continue
            row[k] = {"median": statistics.median(vals), "min": min(vals), "max": max(vals)}
        rows.append(row)
    return rows


def decode_by_batch(sim, tp: int) -> list[dict]:
    """Tokens/s of one engine by running sequences (3k context each): MoE vs dense-equivalent, with and
    without HistoSpec at history age 0."""
    dense = replace(sim.engine, expert_weight_gib=0.0)
    spec = HistoSpecSim(sim.speculation)
    c = sim.speculation
    rate, drafted, _ = chain(round(c.alpha(0.0), 3), c.min_draft_tokens, c.max_draft_tokens)
    out = []
    for b in (1, 4, 16, 64, 256):
        ctx = b * 3000.0
        row = {"batch": b, "tp": tp}
        for label, engine in (("moe", sim.engine), ("dense_equivalent", dense)):
            plain = b / engine.decode_step_s(tp, b, ctx)
            fast = b * rate / spec.step_s(engine, tp, b, b * (1 + drafted), ctx)
            row[f"{label}_tokens_per_s"] = plain
            row[f"{label}_weights_read_gib"] = engine.weight_read_gib(b)
            row[f"{label}_histospec_speedup"] = fast / plain
        out.append(row)
    return out


def plot(doc: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 3, figsize=(15, 4.6))
    rows = doc["rows"]
    names = [r["policy"] for r in rows]
    x = list(range(len(rows)))
    for a, key, label in ((ax[0], "x_best_sync", "samples/s over the better sync (same seed)"),
                          (ax[1], "worker_bubble", "worker bubble ratio")):
        med = [r[key]["median"] for r in rows]
        err = [[m - r[key]["min"] for m, r in zip(med, rows)], [r[key]["max"] - m for m, r in zip(med, rows)]]
        colors = ["tab:orange" if "histospec" in n else "tab:blue" for n in names]
        a.bar(x, med, color=colors, yerr=err, capsize=3)
        a.set(xticks=x, ylabel=label)
        a.set_xticklabels([n.replace("+histospec", "\n+histospec") for n in names], fontsize=7, rotation=35, ha="right")
    ax[0].axhline(1.0, color="gray", lw=0.8)
    ax[0].set_title(f"{doc['scenario']}: median, min-max over {len(doc['seeds'])} seeds", fontsize=9)
    ax[1].set_title("rollout bubble (blue: plain, orange: HistoSpec)", fontsize=9)
    d = doc["decode_by_batch"]
    bs = [r["batch"] for r in d]
    for label, style in (("moe", "-"), ("dense_equivalent", "--")):
        ax[2].plot(bs, [r[f"{label}_tokens_per_s"] for r in d], style, marker="o", label=f"{label}, plain")
        ax[2].plot(bs, [r[f"{label}_tokens_per_s"] * r[f"{label}_histospec_speedup"] for r in d], style, marker="x",
                   label=f"{label}, HistoSpec (age 0)")
    ax[2].set(xscale="log", yscale="log", xlabel="running sequences per engine (TP=4)", ylabel="decode tokens/s",
              title="one engine: decode follows active parameters")
    ax[2].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown(doc: dict) -> str:
    def cell(s: dict, fmt: str) -> str:
        return f"{fmt.format(s['median'])} [{fmt.format(s['min'])}, {fmt.format(s['max'])}]"

    lines = [f"# {doc['scenario']}: every policy, with and without HistoSpec", "",
             f"`{doc['command']}` ({doc['config']}; seeds {', '.join(map(str, doc['seeds']))}; median [min, max]).",
             "Written by benchmarks/simulate_moe.py; the JSON beside this file has every run.", "",
             "Every policy trains the same mini-batches (`algorithm.ppo_mini_batch_size` samples per optimizer step), "
             "so all make the same optimizer steps on the same data (`updates`). `sync@b<B>` is sync (and "
             "sync+histospec) with its rollout batch set to twotier's mean harvest in that seed (B prompts), the way "
             "a sync user amortises the long tail. `x best sync`: samples/s over the better of sync and sync@b<B> in "
             "the same seed; `x sync`: over sync at its recipe batch. `harvests`: rounds that trained; `stale steps`: "
             "the most optimizer steps between a sample's weights and its step.", "",
             "| policy | x best sync | x sync | samples/s | worker bubble | slot bubble | x limit | updates | harvests "
             "| stale steps | preemptions |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in doc["rows"]:
        lines.append(f"| {r['policy']} | {cell(r['x_best_sync'], '{:.2f}')} | {cell(r['throughput_vs_sync'], '{:.2f}')} | "
                     f"{cell(r['samples_per_s'], '{:.2f}')} | "
                     f"{cell(r['worker_bubble'], '{:.3f}')} | {cell(r['slot_bubble'], '{:.3f}')} | "
                     f"{cell(r['ratio_to_limit'], '{:.2f}')} | {cell(r['updates'], '{:.0f}')} | "
                     f"{cell(r['harvests'], '{:.0f}')} | {cell(r['max_staleness_steps'], '{:.0f}')} | "
                     f"{cell(r['preemptions'], '{:.0f}')} |")
    spec = [r for r in doc["rows"] if "x_best_sync_histospec" in r]
    if spec:
        lines += ["", "HistoSpec rows against the better of sync+histospec and sync+histospec@b<B>: " + "; ".join(
            f"{r['policy']} {cell(r['x_best_sync_histospec'], '{:.2f}')}" for r in spec) + "."]
    lines += ["", "Dense-equivalent engine (every decode step reads all 438 GiB; `engine.expert_weight_gib=0`):", "",
              "| policy | x best sync (dense-equivalent) | x sync (dense-equivalent sync) | samples/s | worker bubble |",
              "|---|---|---|---|---|"]
    for r in doc["dense_equivalent"]["rows"]:
        lines.append(f"| {r['policy']} | {cell(r['x_best_sync'], '{:.2f}')} | {cell(r['throughput_vs_sync'], '{:.2f}')} | "
                     f"{cell(r['samples_per_s'], '{:.2f}')} | {cell(r['worker_bubble'], '{:.3f}')} |")
    lines += ["", "One TP=4 engine, decode tokens/s by running sequences (3k context each):", "",
              "| sequences | MoE tokens/s | MoE GiB read/step | MoE HistoSpec x | dense-eq. tokens/s | dense-eq. HistoSpec x |",
              "|---|---|---|---|---|---|"]
    for r in doc["decode_by_batch"]:
        lines.append(f"| {r['batch']} | {r['moe_tokens_per_s']:.0f} | {r['moe_weights_read_gib']:.0f} | "
                     f"{r['moe_histospec_speedup']:.2f} | {r['dense_equivalent_tokens_per_s']:.0f} | "
                     f"{r['dense_equivalent_histospec_speedup']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--jobs", type=int, default=2, help="simulations in parallel (processes)")
    ap.add_argument("--out", default=str(ROOT / "docs" / "benchmarks"))
    args = ap.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")]
    jobs = [(s, False) for s in seeds] + [(s, True) for s in seeds]
    t0 = time.time()
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        results = [row for rows in pool.map(run_seed, jobs) for row in rows]
    for r in results:
        print(f"  {r['engine']:>16} {r['policy']:>18} seed {r['seed']}: {r['total_s']:.0f} s simulated "
              f"({r['sim_wall_s']} s)", flush=True)
    moe = [r for r in results if r["engine"] == "moe"]
    dense = [r for r in results if r["engine"] != "moe"]
    limits, dense_limits = {}, {}
    limit_docs = {}
    for s in seeds:
        sim, run = _load(s, False)
        lim = physical_limit(sim, run, speculation=True)
        limits[s], limit_docs[s] = lim["s_per_sample"], lim
        dsim, drun = _load(s, True)
        dense_limits[s] = physical_limit(dsim, drun, speculation=True)["s_per_sample"]
    sim, run = _load(seeds[0], False)
    doc = {"scenario": sim.name, "config": CONFIG, "seeds": seeds,
           "command": "PYTHONPATH=. nice -n 19 .venv/bin/python benchmarks/simulate_moe.py",
           "engine": {k: getattr(sim.engine, k) for k in sim.engine.__dataclass_fields__},
           "rows": aggregate(moe, limits),
           "dense_equivalent": {"what": "engine.expert_weight_gib=0: decode reads every weight, as for a dense model",
                                "rows": aggregate(dense, dense_limits)},
           "decode_by_batch": decode_by_batch(sim, run.rollout.tensor_parallel_size),
           "limit": {str(s): limit_docs[s] for s in seeds},
           "runs": results, "wall_s": round(time.time() - t0, 1)}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"simulation_{NAME}.json").write_text(json.dumps(doc, indent=1))
    (out / f"simulation_{NAME}.md").write_text(markdown(doc))
    plot(doc, out / f"simulation_{NAME}.png")
    print(markdown(doc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
