"""Regime grid: every tier-1 policy on a grid of workloads and clusters, simulated; the evidence that the
default (`twotier`) is the right choice everywhere, not only on the scenario it was designed on.

    PYTHONPATH=. .venv/bin/python benchmarks/regime_grid.py   # 16 min on the shared 2-core machine (load ~15); the 32B row is half
    PYTHONPATH=. .venv/bin/python benchmarks/regime_grid.py --only light,heavy --no-32b   # a quick subset

Each regime is `configs/sim_regime_base.yaml` (the committed 32B engine and trainer costs on a 16-GPU
slice) with a few keys overridden: tail weight (log-normal sigma), how much of the length belongs to the
prompt and how much carries across epochs (history that predicts, and history that does not), the length
cap relative to the median (many responses truncated), cluster size, trainer cost relative to rollout,
and the number of epochs (one epoch: no history at all). Three rows replay length tables
(`workload.kind=replay`) that reconstruct published shapes of RL length distributions; they are generated
here from a seeded model, labelled `reconstructed`, because no per-sample RL length logs are available
offline and this repository holds no recorded real-run timeline yet (`runs/*/timeline.jsonl` replays the
same way: add it with `--replay NAME=PATH`). The committed 32B, 128-GPU scenario is one more row. The
`agent_*` regimes, last, are multi-turn trajectories with tool calls between turns (scheduler/sim/trajectory_sim.py,
`AGENT_REGIMES`): the same base, sessions of 1-8 assistant turns, tool latencies log-normal per kind.

Every policy trains the scenario's mini-batches (`algorithm.ppo_mini_batch_size`, one optimizer step each), so
all make the same optimizer steps on the same data (`updates`). One more row per regime, `sync_at_harvest`, is
sync with `rollout_batch_size` set to twotier's mean harvest (in prompts; `rollout_batch_size` says which): the
way a sync user amortises the tail, and a baseline like the others (scheduler/sim/equal_footing.py).

Writes docs/benchmarks/regime_grid.json (one row per regime and policy: `x_best_sync` against the better of
sync and sync_at_harvest, `throughput_vs_sync`, `throughput_vs_best` against the best of sync, sync_at_harvest,
sorted and tail in that regime, `worker_bubble`, `slot_bubble`, `waste_ratio` = wasted / trained response tokens,
`max_staleness` (policy versions) and `max_staleness_steps` (optimizer steps), the staleness histogram, `updates`
= optimizer steps, `rounds` = harvests, and twotier's logged round decisions summarised), regime_grid.md (the
table and whether the targets hold) and regime_grid.png.

`held_out` marks the regimes that were not looked at while the default's rules were designed (the
design used `light`, `medium`, `heavy` and the 32B scenario only).

Left out: accuracy (the simulator has no model) and asynchronous RL.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from scheduler.sim.equal_footing import compare  # noqa: E402
from scheduler.sim.sim_config import load_sim_config  # noqa: E402

POLICIES = ("sync", "sorted", "tail", "twotier")
BASELINES = ("sync", "sorted", "tail", "sync_at_harvest")
BASE = "configs/sim_regime_base.yaml"
TARGETS = {"throughput_vs_best": 0.95, "throughput_vs_sync": 0.95, "waste_ratio": 0.10}
DESIGNED_ON = {"light", "medium", "heavy", "qwen32b_128gpu"}

# name -> (what it is, overrides of the base scenario). Base: median 1k, cap 16k, sigma 1.0, share 0.6,
# persistence 0.8, 16 GPUs (TP4 short, TP8 long), 128 prompts x 8 responses x 3 epochs.
REGIMES: dict[str, tuple[str, list[str]]] = {
    "light": ("light tail (sigma 0.5): few responses run long", ["workload.sigma=0.5"]),
    "medium": ("the base: sigma 1.0, median:cap 1:16", []),
    "heavy": ("heavy tail (sigma 1.5): long-CoT-like", ["workload.sigma=1.5"]),
    "flat": ("almost no spread (sigma 0.2): sync has no bubble to lose", ["workload.sigma=0.2"]),
    "sample_noise": ("length is mostly the sample's (prompt share 0.1): per-prompt history says little",
                     ["workload.prompt_share=0.1", "workload.sigma=1.2"]),
    "no_persistence": ("prompt levels redrawn every epoch (persistence 0): history predicts nothing",
                       ["workload.persistence=0.0", "workload.prompt_share=0.9", "workload.sigma=1.2"]),
    "predictable": ("history predicts well (share 0.9, persistence 0.95)",
                    ["workload.persistence=0.95", "workload.prompt_share=0.9", "workload.sigma=1.2"]),
    "capped": ("cap at 2x the median: about a third of responses truncated",
               ["workload.median_response=2048", "run.rollout.max_response_length=4096", "workload.sigma=1.0"]),
    "short_cap": ("cap 4x the median, light tail (short answers)", ["run.rollout.max_response_length=4096",
                                                                      "workload.sigma=0.7"]),
    "one_epoch": ("a single epoch: cold history throughout", ["workload.num_epochs=1", "workload.num_prompts=256"]),
    "gpus_8": ("8 GPUs: engines full, throughput bound", ["cluster.gpus=8", "cluster.train_tokens_per_s=6250"]),
    "gpus_64": ("64 GPUs, same batch: engines half empty, latency bound",
                ["cluster.gpus=64", "cluster.train_tokens_per_s=50000"]),
    "slow_trainer": ("trainer 4x slower (training dominates the step)", ["cluster.train_tokens_per_s=3125",
                                                                         "cluster.train_fixed_s=20"]),
    "fast_trainer": ("trainer 4x faster, no fixed costs", ["cluster.train_tokens_per_s=50000", "cluster.train_fixed_s=0",
                                                           "cluster.weight_sync_s=1"]),
    "small_batch": ("rollout batch of 8 prompts (update 64 samples)", ["run.scheduler.rollout_batch_size=8",
                                                                        "run.scheduler.update_batch_size=64",
                                                                        "run.scheduler.group_size=32"]),
}


# Multi-turn regimes (scheduler/sim/trajectory_sim.py), appended after every other row so those keep their places.
# Tools as configs/sim_agentic_7b_8gpu.yaml: calculator 0.1 s, sandboxed python 2 s, search 5 s, test runs 15 s
# (medians; log-normal sigma 0.5-1.2, cut at 120 s); median_response is then the median tokens of one turn.
AGENT_TOOLS = ("[{name: calculator, weight: 3, median_s: 0.1, sigma: 0.5, tokens: 16}, "
               "{name: python, weight: 3, median_s: 2.0, sigma: 1.0, tokens: 200}, "
               "{name: search, weight: 2, median_s: 5.0, sigma: 1.2, tokens: 400}, "
               "{name: tests, weight: 1, median_s: 15.0, sigma: 1.0, tokens: 300}]")
AGENT = ["workload.turns_max=8", "workload.turns_median=3", "workload.turns_sigma=0.7", "workload.median_response=400",
         f"workload.tool_kinds={AGENT_TOOLS}"]
AGENT_REGIMES: dict[str, tuple[str, list[str]]] = {
    "agent_tools": ("multi-turn: 1-8 turns (median 3) of ~400 tokens, tools from 0.1 s to tens of seconds", AGENT),
    "agent_slow_tools": ("multi-turn, slow tools: every latency 10x (median 1-150 s, cut at 120 s): tool time dominates",
                         AGENT[:-1] + ["workload.tool_kinds=" + AGENT_TOOLS.replace("0.1,", "1.0,").replace(
                             "2.0,", "20.0,").replace("5.0,", "50.0,").replace("15.0,", "150.0,")]),
    "agent_many_turns": ("multi-turn, long sessions: median 6 turns of ~150 tokens, up to 8",
                         AGENT[:1] + ["workload.turns_median=6", "workload.turns_sigma=0.4",
                                      "workload.median_response=150", f"workload.tool_kinds={AGENT_TOOLS}"]),
}


# -- reconstructed replays ----------------------------------------------------------------------------------

def _replay_table(kind: str, prompts: int = 128, epochs: int = 3, n: int = 8, seed: int = 1) -> dict:
    """{prompt: {epoch: [n lengths]}} with the shape of a published RL length distribution (reconstructed).

    - math_longcot: long chain-of-thought math (DAPO / DeepSeek-R1-Zero style curves): median about 1/8 of
      the 16k cap early, growing about 25% per epoch as the policy learns to think longer, heavy right tail
      (sigma 1.1), a few percent truncated; harder prompts run long for every sample.
    - code_capped: code RL near its length cap (DeepCoder-style 16k runs): median about half the cap,
      light tail (sigma 0.6) squeezed against the cap, 15-20% of responses truncated.
    - vl_short: vision-language QA: short answers (median 1/32 of the cap), moderate tail, rare long
      reasoning traces; prompt difficulty persists weakly.
    """
    shapes = {"math_longcot": (2048, 1.1, 0.6, 0.8, 1.25), "code_capped": (8192, 0.6, 0.5, 0.7, 1.05),
              "vl_short": (512, 0.9, 0.4, 0.5, 1.0)}
    median, sigma, share, rho, growth = shapes[kind]
    rng = random.Random(f"{kind}:{seed}")
    table: dict[str, dict[str, list[int]]] = {}
    for p in range(prompts):
        z = rng.gauss(0, 1)
        per: dict[str, list[int]] = {}
        for e in range(epochs):
            if e:
                z = rho * z + math.sqrt(1 - rho * rho) * rng.gauss(0, 1)
            med = median * growth**e
            per[str(e)] = [int(min(16384, max(8, round(math.exp(math.log(med) + sigma * (
                math.sqrt(share) * z + math.sqrt(1 - share) * rng.gauss(0, 1))))))) for _ in range(2 * n)]
        table[f"q{p}"] = per
    return table


REPLAYS = {
    "replay_math_longcot": "reconstructed: long-CoT math, heavy tail growing over epochs",
    "replay_code_capped": "reconstructed: code RL near its 16k cap",
    "replay_vl_short": "reconstructed: vision-language QA, short answers",
}


def run_regime(name: str, path: str, overrides: list[str]) -> list[dict]:
    """Every policy at the scenario's mini-batch (equal optimizer steps), then sync at twotier's mean harvest
    (`sync_at_harvest`, a baseline since every policy trains the same mini-batches; scheduler/sim/equal_footing.py)."""
    sim, run = load_sim_config(ROOT / path, overrides)

    def measured(label, result, row):  # (compare() records each row's sim_wall_s)
        row["waste_ratio"] = row["wasted_tokens"] / max(1, sum(sum(r["response_lengths"]) for r in result.rounds))
        decisions = [d for d in result.policy_stats.get("decisions", [])]
        if decisions:
            row["decisions"] = {"rounds": len(decisions), "first": decisions[0], "last": decisions[-1],
                                "max_carried": max(d.get("carried", 0) for d in decisions),
                                "mean_trained_prompts": sum(d.get("trained", 0) for d in decisions) / len(decisions)}

    rows, _ = compare(sim, run, list(POLICIES), on_result=measured)
    for r in rows:
        if r["policy"].startswith("sync@b"):  # one stable name across regimes; the batch is kept beside it
            r["rollout_batch_size"] = int(r["policy"].removeprefix("sync@b"))
            r["policy"] = "sync_at_harvest"
    by = {r["policy"]: r for r in rows}
    best = max(by[p]["samples_per_s"] for p in BASELINES if p in by)
    for r in rows:
        r["throughput_vs_sync"] = r["samples_per_s"] / by["sync"]["samples_per_s"]
        r["throughput_vs_best"] = r["samples_per_s"] / best
    return rows


def check(row: dict) -> bool:
    return (row["throughput_vs_best"] >= TARGETS["throughput_vs_best"]
            and row["throughput_vs_sync"] >= TARGETS["throughput_vs_sync"] and row["waste_ratio"] <= TARGETS["waste_ratio"])


def _stale_share(row: dict) -> float:
    """Share of the trained samples generated at least partly under an older policy version."""
    hist = {int(k): v for k, v in row["staleness"].items()}
    return sum(v for k, v in hist.items() if k > 0) / max(1, sum(hist.values()))


def write_md(rows: list[dict], path: Path, wall_s: float) -> None:
    lines = ["# Regime grid (simulated)", "",
             "Generated by `benchmarks/regime_grid.py`; see docs/scheduler.md for how to read it. "
             f"Targets for `twotier` in every regime: throughput vs best of sync/sorted/tail >= "
             f"{TARGETS['throughput_vs_best']}, vs sync >= {TARGETS['throughput_vs_sync']}, wasted / trained tokens "
             f"<= {TARGETS['waste_ratio']}. Whole grid: {wall_s:.0f} s of simulation on a shared 2-core machine.", "",
             "Every policy trains the same mini-batches, so all make the same optimizer steps (`updates`). "
             "`sync_at_harvest` is sync with its rollout batch set to twotier's mean harvest, a baseline; `x best "
             "sync` is the ratio to the better of the two sync rows. `stale share`: trained samples holding tokens "
             "of an older policy version; `stale steps`: the most optimizer steps between a sample's weights and "
             "its step.", "",
             "| regime | policy | x best sync | x sync | x best | worker bubble | slot bubble | waste | max stale | stale steps | stale share | updates | held out |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        mark = (" ok" if check(r) else " MISSED") if r["policy"] == "twotier" else ""
        lines.append(f"| {r['regime']} | {r['policy']}{mark} | {r['x_best_sync']:.2f} | {r['throughput_vs_sync']:.2f} | "
                     f"{r['throughput_vs_best']:.2f} | {r['worker_bubble']:.1%} | {r['slot_bubble']:.1%} | "
                     f"{r['waste_ratio']:.2f} | {r['max_staleness']} | {r['max_staleness_steps']} | {_stale_share(r):.0%} | "
                     f"{r['updates']} | {'yes' if r['held_out'] else 'no'} |")
    lines += ["", "Regimes:", ""]
    seen = set()
    for r in rows:
        if r["regime"] not in seen:
            seen.add(r["regime"])
            lines.append(f"- `{r['regime']}`: {r['description']}")
    twotier = [r for r in rows if r["policy"] == "twotier"]
    missed = [r["regime"] for r in twotier if not check(r)]
    lines += ["", f"twotier meets all targets in {len(twotier) - len(missed)} of {len(twotier)} regimes"
              + (f"; missed: {', '.join(missed)}." if missed else ".")]
    path.write_text("\n".join(lines) + "\n")


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    regimes = list(dict.fromkeys(r["regime"] for r in rows))
    by = {(r["regime"], r["policy"]): r for r in rows}
    fig, ax = plt.subplots(3, 1, figsize=(13, 11))
    width = 0.8 / len(POLICIES)
    for i, p in enumerate(POLICIES):  # sync_at_harvest is in the table and JSON, not the bars
        xs = [j + i * width for j in range(len(regimes))]
        ax[0].bar(xs, [by[(g, p)]["throughput_vs_sync"] for g in regimes], width, label=p)
        ax[1].bar(xs, [min(3.0, by[(g, p)]["waste_ratio"]) for g in regimes], width, label=p)
    ax[0].axhline(1.0, color="gray", lw=0.8)
    ax[0].set(ylabel="throughput vs sync", title="Samples/s relative to sync, per regime")
    ax[1].axhline(TARGETS["waste_ratio"], color="red", lw=0.8, ls="--")
    ax[1].set(ylabel="wasted / trained tokens (clipped at 3)", title="Waste")
    for a in ax[:2]:
        a.set_xticks([j + 0.4 - width / 2 for j in range(len(regimes))], regimes, rotation=30, ha="right", fontsize=8)
        a.legend(ncol=4, fontsize=8)
    vb = [by[(g, "twotier")]["throughput_vs_best"] for g in regimes]
    same = [by[(g, "twotier")]["x_best_sync"] for g in regimes]
    xs = list(range(len(regimes)))
    ax[2].bar([x - 0.2 for x in xs], vb, 0.4, color=["tab:green" if v >= 0.95 else "tab:red" for v in vb],
              label="twotier / best of sync, sync at twotier's harvest, sorted, tail (target >= 0.95)")
    ax[2].bar([x + 0.2 for x in xs], same, 0.4, color="tab:gray",
              label="twotier / the better sync (x_best_sync), same optimizer steps")
    ax[2].axhline(0.95, color="red", lw=0.8, ls="--")
    ax[2].set_xticks(xs, regimes, rotation=30, ha="right", fontsize=8)
    ax[2].set(ylabel="throughput ratio", title="twotier against the best baseline and the best sync, equal optimizer steps")
    ax[2].legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="", help="comma-separated regime names (default: all)")
    ap.add_argument("--no-32b", action="store_true", help="skip the committed 32B, 128-GPU scenario row")
    ap.add_argument("--replay", action="append", default=[], help="NAME=PATH: replay a recorded timeline or lengths JSON")
    ap.add_argument("--out", default=str(ROOT / "docs" / "benchmarks"), help="output directory")
    ap.add_argument("--replot", action="store_true", help="redraw regime_grid.png and .md from the JSON in --out")
    args = ap.parse_args(argv)
    if args.replot:
        data = json.loads((Path(args.out) / "regime_grid.json").read_text())
        write_md(data["rows"], Path(args.out) / "regime_grid.md", data["grid_wall_s"])
        plot(data["rows"], Path(args.out) / "regime_grid.png")
        return 0
    only = {x for x in args.only.split(",") if x}
    jobs: list[tuple[str, str, str, list[str], bool]] = []  # name, description, config, overrides, reconstructed
    tmp = Path(tempfile.mkdtemp(prefix="regime_grid_"))
    for name, (desc, over) in REGIMES.items():
        jobs.append((name, desc, BASE, over, False))
    for name, desc in REPLAYS.items():
        path = tmp / f"{name}.json"
        path.write_text(json.dumps(_replay_table(name.removeprefix("replay_"))))
        jobs.append((name, desc, BASE, ["workload.kind=replay", f"workload.replay_path={path}"], True))
    for item in args.replay:
        name, _, path = item.partition("=")
        jobs.append((name, f"replay of {path}", BASE, ["workload.kind=replay", f"workload.replay_path={path}"], False))
    if not args.no_32b:
        jobs.append(("qwen32b_128gpu", "the committed scenario: Qwen2.5-32B, 128 GPUs, 32k tails",
                     "configs/sim_qwen32b_128gpu.yaml", [], False))
    for name, (desc, over) in AGENT_REGIMES.items():
        jobs.append((name, desc, BASE, over, False))
    rows: list[dict] = []
    t0 = time.time()
    for name, desc, path, over, reconstructed in jobs:
        if only and name not in only:
            continue
        for r in run_regime(name, path, over):
            rows.append({"regime": name, "description": desc, "reconstructed": reconstructed,
                         "held_out": name not in DESIGNED_ON, **r})
            print(f"{name:22s} {r['policy']:16s} x best sync {r['x_best_sync']:.2f}  x sync {r['throughput_vs_sync']:.2f}  "
                  f"x best {r['throughput_vs_best']:.2f}  "
                  f"waste {r['waste_ratio']:.2f}  stale {r['max_staleness']}  wb {r['worker_bubble']:.2f}  "
                  f"({r['sim_wall_s']} s)", flush=True)
    wall = time.time() - t0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    keep = ("regime", "description", "reconstructed", "held_out", "policy", "x_best_sync", "best_sync",
            "throughput_vs_sync", "throughput_vs_best", "worker_bubble", "slot_bubble", "waste_ratio", "max_staleness",
            "max_staleness_steps", "staleness", "samples_per_s", "total_s", "updates", "samples_per_update",
            "rounds", "rollout_batch_size", "long_rounds", "wasted_tokens", "tokens_trained", "preemptions", "decisions", "sim_wall_s")
    slim = [{k: r[k] for k in keep if k in r} for r in rows]
    (out / "regime_grid.json").write_text(json.dumps({"base_config": BASE, "targets": TARGETS, "baselines": list(BASELINES),
                                                      "grid_wall_s": round(wall, 1), "rows": slim}, indent=1))
    write_md(slim, out / "regime_grid.md", wall)
    plot(slim, out / "regime_grid.png")
    twotier = [r for r in slim if r["policy"] == "twotier"]
    print(f"twotier meets all targets in {sum(map(check, twotier))} of {len(twotier)} regimes ({wall:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
