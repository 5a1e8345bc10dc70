"""Simulated selective rollout at cluster scale: every tier-1 policy with no filter, dynamic sampling (DS), and
DS with reward-history skip, on a DAPO-like pass-rate process; figures committed to docs/benchmarks/.

    .venv/bin/python benchmarks/selective_rollout_sim.py --epochs 6    # 32B, 128 GPUs; sorted alone takes > 30 min
    .venv/bin/python benchmarks/selective_rollout_sim.py --epochs 6 --policies sync,tail,twotier,sync_gen3x --cache /tmp/c --no-write
    .venv/bin/python benchmarks/selective_rollout_sim.py --epochs 6 --policies sorted --cache /tmp/c --no-write  # a part
    .venv/bin/python benchmarks/selective_rollout_sim.py --epochs 6 --policies sync,sorted,tail,twotier,sync_gen3x --cache /tmp/c
    .venv/bin/python benchmarks/selective_rollout_sim.py --config configs/sim_paper_rollpacker_7b_8k.yaml --epochs 6 \
        --policies sync,twotier,sync_gen3x --name selective_rollout_sim_7b                  # the second workload
    .venv/bin/python benchmarks/selective_rollout_sim.py --config configs/sim_tiny_cpu.yaml --out /tmp/x
    .venv/bin/python benchmarks/selective_rollout_sim.py --epochs 6 --policies sync,twotier,sync_gen3x \
        --reuse sorted,tail         # rerun only what a change touches; the rest is taken from the committed JSON
    .venv/bin/python benchmarks/selective_rollout_sim.py --epochs 6 --policies sync,tail,twotier,sync_gen3x \
        --reuse sorted --seeds 1,2  # and the headline ratios' spread over three workload seeds

Scenario: configs/sim_qwen32b_128gpu.yaml (Qwen2.5-32B, 128 GPUs, 16 responses per prompt, 32k tails) with
the workload's pass-rate process (scheduler/sim/workload.py: per-prompt pass rates that persist across epochs and
drift, about 30% of groups informative in the first epoch and 20% in the last; the realised shares are in the
JSON) over `--epochs` passes. Each variant runs the real policy objects (`scheduler/selective.py` wraps them).

Figures per (policy, filter): wall time per trained *informative* group (a group whose rewards differ: the only
kind that moves a group-relative advantage), its ratio to sync + DS from the same run
(`time_per_informative_group_vs_sync_ds`, lower is faster), generated response tokens per trained token
(no filter: trained + wasted; DS: trained + filtered + wasted), the pooled worker bubble, updates, prompts
skipped, prompts per round. `sync_gen3x` is sync + DS the way verl's DAPO recipe runs it: each round generates
three updates' prompts (`gen_batch_size = 3 x train_batch_size`) and the update trains `rollout_batch_size`
informative groups; the headline compares twotier + DS + skip with it too. Writes `--name`.{json,md,png}
(default selective_rollout_sim); `--cache DIR` keeps each simulation's row, so a long grid runs in parts.
`--reuse POLICIES` takes those policies' rows from the committed `--name`.json instead of simulating them (for a
change that cannot affect them: sorted alone takes over 30 minutes); each such row is marked `reused_from` (the
file and the commit it was last committed in) in the JSON and with * in the table.

Left out: the learning effect of training only on informative groups (the simulator has no model); DAPO reports
equal or better accuracy with the filter, GRESO with the skip.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import multiprocessing
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from scheduler.sim.report import bubble_ratios  # noqa: E402
from scheduler.selective import SkipGate  # noqa: E402
from scheduler.sim.sim_config import load_sim_config  # noqa: E402
from scheduler.sim.simulator import simulate  # noqa: E402
from scheduler.sim.workload import PassRates  # noqa: E402

POLICIES = ("sync", "sorted", "tail", "twotier")
# sync + DS the way verl's DAPO recipe runs it (gen_batch_size = 3 x train_batch_size): each round generates
# three updates' worth of prompts, so it needs fewer tail-bound rounds per update than a round of one update.
GEN3X = "sync_gen3x"
FILTERS = {"none": [], "ds": ["run.sampling.dynamic=true"],
           "ds+skip": ["run.sampling.dynamic=true", "run.sampling.history_skip=true"]}
# Upper bounds for the skip (`--bounds`, twotier only; diagnostics, not policies: both read the workload's rewards).
# `skip_fresh`: the same streak rule, floor, adaptive probability and seeded draws, but the streak is read from the
# prompt's earlier *generated* groups as if each had completed before the decision (the causal rule can only read
# groups that have completed; epochs in which the prompt was skipped add nothing, as in the real history).
# `skip_oracle`: a prompt is generated exactly when its group will be informative.
BOUNDS = {"ds+skip_fresh": FILTERS["ds+skip"], "ds+skip_oracle": FILTERS["ds+skip"]}


def bound_gate(filt: str, sim, n: int):
    """A replacement for `SkipGate.tried` that decides with knowledge of the workload (see BOUNDS)."""
    rates = PassRates(sim.workload)

    def uninformative(pid: str, epoch: int) -> bool:
        return len({rates.reward(pid, epoch, i) for i in range(n)}) == 1

    decided: dict[tuple[str, int], bool] = {}  # (prompt, epoch) -> generated; a decision stands once taken

    def tried(gate, pid: str, epoch: int) -> bool:
        if (pid, epoch) in decided:
            return decided[(pid, epoch)]
        if filt == "ds+skip_oracle":
            go = not uninformative(pid, epoch)
        else:
            streak = 0
            for earlier in range(epoch - 1, -1, -1):
                if not decided.get((pid, earlier), True):
                    continue  # skipped then: no group, the history did not change
                if not uninformative(pid, earlier):
                    break
                streak += 1
            go = gate.draw(pid, epoch) < gate.probability(streak)
        decided[(pid, epoch)] = go
        return go

    return tried


def row_of(result, policy: str, filt: str, wall: float) -> dict:
    rounds = result.rounds
    trained_tokens = sum(sum(r["response_lengths"]) for r in rounds)
    informative = sum(r["informative_groups"] for r in rounds)
    groups = sum(len(set(r["trained"])) for r in rounds)
    stats = result.policy_stats.get("sampling") or {}
    generated = stats.get("generated_tokens") or trained_tokens + result.policy_stats.get("wasted_tokens", 0)
    return {"policy": policy, "filter": filt, "total_s": result.total_s, "informative_groups": informative,
            "trained_groups": groups, "time_per_informative_group_s": result.total_s / max(1, informative),
            "generated_tokens_per_trained_token": generated / max(1, trained_tokens),
            "updates": sum(r["update"] for r in rounds), "rounds": len(rounds),
            "filtered_groups": stats.get("filtered", 0), "skipped_prompts": stats.get("skipped", 0),
            "worker_bubble": bubble_ratios(result.events, result.max_num_seqs)["worker_bubble"],
            # per round: where the time goes (a round waiting on a 32k tail takes ~400-500 s) and what it yields
            "per_round": [{"rollout_s": round(r["rollout_s"], 1), "update": r["update"],
                           "informative_groups": r["informative_groups"],
                           "longest_trained": max(r["response_lengths"] or [0]),
                           "skip_probability": r["sampling"].get("sampling/skip_probability")} for r in rounds],
            "sim_wall_s": round(wall, 1)}


def one(config: str, epochs: int, policy: str, filt: str, overrides: list[str], cache: Path | None = None) -> dict:
    logging.disable(logging.WARNING)  # the per-update "cap hit" lines of dynamic sampling
    key = {"config": config, "epochs": epochs, "policy": policy, "filter": filt, "overrides": overrides}
    tag = "_" + hashlib.sha1(json.dumps(overrides).encode()).hexdigest()[:8] if overrides else ""  # (--seeds)
    path = cache / f"{policy}_{filt.replace('+', '_')}{tag}.json" if cache else None
    if path and path.is_file() and json.loads(path.read_text())["key"] == key:  # a part run earlier (--cache)
        return json.loads(path.read_text())["row"]
    label, gen = policy, []
    if policy == GEN3X:  # DAPO's own recipe: generate 3x the update's prompts per round, train the informative ones
        sim0, run0 = load_sim_config(ROOT / config, overrides)
        update = run0.scheduler.rollout_batch_size
        policy, gen = "sync", [f"run.scheduler.rollout_batch_size={3 * update}",
                               f"run.sampling.min_informative_groups={update}"]
    sim, run = load_sim_config(ROOT / config, [f"workload.num_epochs={epochs}", *{**FILTERS, **BOUNDS}[filt], *overrides, *gen])
    t0 = time.time()
    gate_tried = SkipGate.tried
    if filt in BOUNDS:  # (restored below: a pool worker runs other simulations after this one)
        SkipGate.tried = bound_gate(filt, sim, run.rollout.n_samples_per_prompt)  # type: ignore[method-assign]
    try:
        row = row_of(simulate(sim, run, policy), label, filt, time.time() - t0)
    finally:
        SkipGate.tried = gate_tried  # type: ignore[method-assign]
    row["prompts_per_round"] = run.scheduler.group_size if policy in ("sorted", "twotier") else run.scheduler.rollout_batch_size
    if path:
        path.write_text(json.dumps({"key": key, "row": row}))
    print(f"{label:10s} {filt:8s} {row['time_per_informative_group_s']:8.2f} s/group  "
          f"gen/trained {row['generated_tokens_per_trained_token']:.2f}  informative {row['informative_groups']}  "
          f"updates {row['updates']}  skipped {row['skipped_prompts']}  ({row['sim_wall_s']}s)", flush=True)
    return row


def reused_rows(path: Path, reuse: list[str], simulated: set[str]) -> list[dict] | None:
    """The rows of `reuse` policies from the committed JSON at `path`, each marked with the file and commit."""
    if set(reuse) & simulated or set(reuse) - set(POLICIES + (GEN3X,)) or {"sync", "twotier"} & set(reuse):
        print(f"error: --reuse takes policies not in --policies, other than sync and twotier: {','.join(reuse)}",
              file=sys.stderr)
        return None
    rel = path.resolve().relative_to(ROOT) if path.resolve().is_relative_to(ROOT) else path
    commit = subprocess.run(["git", "log", "-1", "--format=%h", "--", str(rel)], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    if not path.is_file() or not commit:
        print(f"error: --reuse needs {path} committed in git; run those policies instead", file=sys.stderr)
        return None
    rows = [dict(r, reused_from=f"{rel} at {commit}") for r in json.loads(path.read_text())["rows"]
            if r["policy"] in reuse]
    missing = set(reuse) - {r["policy"] for r in rows}
    if missing:
        print(f"error: {path} has no rows for {','.join(sorted(missing))}; run them instead", file=sys.stderr)
        return None
    return rows


# (policy, filter) simulated again per extra seed (--seeds): what the two headline ratios need
SPREAD = (("sync", "ds"), ("twotier", "ds"), ("twotier", "ds+skip"))
RATIOS = {"twotier_ds_skip_speedup_vs_sync_ds": ("sync", "ds"), "twotier_ds_skip_speedup_vs_twotier_ds": ("twotier", "ds")}


def seed_spread(rows: list[dict], spread_rows: list[dict], seeds: list[int], sim_seed: int) -> dict:
    """The headline ratios per workload seed (the rows' own seed first) and their median, min and max."""
    per_seed = [rows] + [spread_rows[i * len(SPREAD):(i + 1) * len(SPREAD)] for i in range(len(seeds))]
    out: dict = {"seeds": [sim_seed, *seeds]}
    for name, base in RATIOS.items():
        values = []
        for group in per_seed:
            pick = {(r["policy"], r["filter"]): r["time_per_informative_group_s"] for r in group}
            values.append(pick[base] / pick[("twotier", "ds+skip")])
        out[name] = {"per_seed": values, "median": statistics.median(values), "min": min(values), "max": max(values)}
    return out


def spread_text(spread: dict) -> str:
    return "; ".join(f"{name.replace('twotier_ds_skip_speedup_', '').replace('_', ' ')} median "
                     f"{v['median']:.2f}x ({v['min']:.2f}-{v['max']:.2f})"
                     for name, v in spread.items() if name != "seeds")


def markdown(rows: list[dict], head: str) -> str:
    lines = [head, "", "| policy | filter | prompts / round | s / informative group | vs sync+DS | gen tok / trained tok | "
             "informative groups | rounds | updates | skipped | worker bubble |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['policy']}{'*' if r.get('reused_from') else ''} | {r['filter']} | {r['prompts_per_round']} | {r['time_per_informative_group_s']:.1f} | "
                     f"{r['time_per_informative_group_vs_sync_ds']:.3f} | {r['generated_tokens_per_trained_token']:.2f} | "
                     f"{r['informative_groups']} | {r['rounds']} | {r['updates']} | {r['skipped_prompts']} | "
                     f"{r['worker_bubble']:.1%} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(12, 4.2))
    width = 0.27
    policies = [p for p in POLICIES + (GEN3X,) if any(r["policy"] == p for r in rows)]
    for j, filt in enumerate(FILTERS):
        sel = [(i + (j - 1) * width, r) for i, p in enumerate(policies) for r in rows
               if r["policy"] == p and r["filter"] == filt]
        xs = [x for x, _ in sel]
        ax[0].bar(xs, [1.0 / r["time_per_informative_group_vs_sync_ds"] for _, r in sel], width, label=filt)
        ax[1].bar(xs, [r["generated_tokens_per_trained_token"] for _, r in sel], width, label=filt)
    ax[0].axhline(1.0, color="gray", lw=0.8)
    ax[0].set(xticks=range(len(policies)), xticklabels=policies, ylabel="informative groups per second vs sync + DS",
              title="Speed per trained informative group")
    ax[1].set(xticks=range(len(policies)), xticklabels=policies, ylabel="tokens", title="Generated per trained token")
    ax[0].legend(title="filter")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/sim_qwen32b_128gpu.yaml")
    ap.add_argument("--epochs", type=int, default=3, help="workload.num_epochs")
    ap.add_argument("--policies", default=",".join(POLICIES + (GEN3X,)),
                    help=f"comma list (sync and twotier needed; {GEN3X}: sync generating 3 updates' prompts per round)")
    ap.add_argument("--name", default="selective_rollout_sim", help="output file stem under --out")
    ap.add_argument("--cache", type=Path, default=None,
                    help="keep each simulation's row here and reuse it (a long grid can run in parts: --policies)")
    ap.add_argument("--no-write", action="store_true", help="simulate (into --cache) without writing the outputs")
    ap.add_argument("--jobs", type=int, default=3, help="simulations run in parallel")
    ap.add_argument("--reuse", default="", help="comma list of policies whose rows are taken from the committed "
                    "--name.json instead of simulated (marked reused_from)")
    ap.add_argument("--seeds", default="",
                    help="comma list of further workload seeds: sync + DS, twotier + DS and twotier + DS + skip are "
                    "simulated again on each, and the headline ratios' median, min and max over all seeds are "
                    "written (`seed_spread`); the rows stay those of the config's own seed")
    ap.add_argument("--bounds", action="store_true",
                    help="also simulate twotier with two upper bounds of the skip that read the workload's rewards "
                    "(fresh history; an oracle) and write them as `bounds` (not rows)")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks")
    ap.add_argument("overrides", nargs="*", help="extra sim overrides (key=value; run.* for the run config)")
    args = ap.parse_args()
    t_all = time.time()
    policies = [p for p in args.policies.split(",") if p]
    reuse = [p for p in args.reuse.split(",") if p]
    if not (args.no_write or {"sync", "twotier"} <= set(policies)) or set(policies) - set(POLICIES + (GEN3X,)):
        print(f"error: --policies must include sync and twotier, from {', '.join(POLICIES + (GEN3X,))}", file=sys.stderr)
        return 2
    old_rows = reused_rows(args.out / f"{args.name}.json", reuse, set(policies)) if reuse else []
    if old_rows is None:
        return 2
    if args.cache:
        args.cache.mkdir(parents=True, exist_ok=True)
    jobs = [(args.config, args.epochs, policy, filt, args.overrides, args.cache) for policy in policies for filt in FILTERS
            if not (policy == GEN3X and filt == "none")]  # without the filter it is just a bigger sync batch
    seeds = [int(x) for x in args.seeds.split(",") if x]
    spread_jobs = [(args.config, args.epochs, policy, filt, [*args.overrides, f"workload.seed={seed}"], args.cache)
                   for seed in seeds for policy, filt in SPREAD]
    bound_jobs = [(args.config, args.epochs, "twotier", filt, args.overrides, args.cache) for filt in BOUNDS] \
        if args.bounds else []
    with multiprocessing.Pool(args.jobs) as pool:  # independent simulations; each is single-threaded
        done = pool.starmap(one, jobs + spread_jobs + bound_jobs, chunksize=1)
    rows, spread_rows = done[: len(jobs)], done[len(jobs): len(jobs) + len(spread_jobs)]
    bounds = done[len(jobs) + len(spread_jobs):]
    if args.no_write:
        return 0
    rows += old_rows
    rows.sort(key=lambda r: ((POLICIES + (GEN3X,)).index(r["policy"]), list(FILTERS).index(r["filter"])))
    base = next(r for r in rows if r["policy"] == "sync" and r["filter"] == "ds")
    for r in rows:
        r["time_per_informative_group_vs_sync_ds"] = r["time_per_informative_group_s"] / base["time_per_informative_group_s"]
    pick = {(r["policy"], r["filter"]): r for r in rows}
    headline = {
        "twotier_ds_skip_speedup_vs_sync_ds": 1.0 / pick[("twotier", "ds+skip")]["time_per_informative_group_vs_sync_ds"],
        "twotier_ds_skip_speedup_vs_twotier_ds": pick[("twotier", "ds")]["time_per_informative_group_s"]
        / pick[("twotier", "ds+skip")]["time_per_informative_group_s"]}
    if (GEN3X, "ds") in pick:
        headline["twotier_ds_skip_speedup_vs_sync_gen3x_ds"] = (pick[(GEN3X, "ds")]["time_per_informative_group_s"]
                                                               / pick[("twotier", "ds+skip")]["time_per_informative_group_s"])
    headline["targets_met"] = (headline["twotier_ds_skip_speedup_vs_sync_ds"] >= 3.0
                               and headline["twotier_ds_skip_speedup_vs_twotier_ds"] >= 1.4)
    sim, run = load_sim_config(ROOT / args.config, [f"workload.num_epochs={args.epochs}", *args.overrides])
    if seeds:
        headline["seed_spread"] = seed_spread(rows, spread_rows, seeds, sim_seed=sim.workload.seed)
    rates, n = PassRates(sim.workload), run.rollout.n_samples_per_prompt
    share = [sum(1 - r ** n - (1 - r) ** n for r in (rates.rate(p, e) for p in
                 (f"p{i}" for i in range(sim.workload.num_prompts)))) / sim.workload.num_prompts
             for e in range(args.epochs)]
    result = {"scenario": sim.name, "config": args.config, "epochs": args.epochs, "n": n,
              "command": "python benchmarks/selective_rollout_sim.py " + " ".join(sys.argv[1:]),
              "expected_informative_share_per_epoch": share, "headline": headline,
              "bench_wall_s": round(time.time() - t_all, 1), "rows": rows}
    if bounds:
        for b in bounds:
            b["speedup_vs_twotier_ds"] = pick[("twotier", "ds")]["time_per_informative_group_s"] / b["time_per_informative_group_s"]
        result["bounds"] = bounds
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps(result, indent=1) + "\n")
    head = (f"# Selective rollout in the simulator: {sim.name}, {args.epochs} epochs\n\n`{result['command']}`. "
            f"Expected informative share of groups per epoch (n = {n}): "
            f"{', '.join(f'{s:.0%}' for s in share)}. twotier + DS + skip is "
            f"{headline['twotier_ds_skip_speedup_vs_sync_ds']:.2f}x sync + DS and "
            f"{headline['twotier_ds_skip_speedup_vs_twotier_ds']:.2f}x twotier + DS per trained informative group "
            f"(targets 3x and 1.4x: {'met' if headline['targets_met'] else 'NOT met'})"
            + (f"; over workload seeds {headline['seed_spread']['seeds']}: {spread_text(headline['seed_spread'])}"
               if seeds else "")
            + (f"; {headline['twotier_ds_skip_speedup_vs_sync_gen3x_ds']:.2f}x sync + DS generating 3 updates' "
               f"prompts per round ({GEN3X}, as verl's DAPO recipe)" if (GEN3X, "ds") in pick else "") + ".")
    table = markdown(rows, head)
    if bounds:
        table += ("\n\nUpper bounds of the skip (`--bounds`; they read the workload's rewards, so no policy can run them): "
                  "`skip_fresh` is the same rule reading the prompt's earlier generated groups as if each had completed "
                  "before the decision (no latency); `skip_oracle` generates exactly the prompts whose group will be "
                  "informative.\n\n"
                  "| policy | bound | s / informative group | vs twotier + DS | informative groups | rounds | skipped |\n"
                  "|---|---|---|---|---|---|---|\n" + "\n".join(
                      f"| {b['policy']} | {b['filter']} | {b['time_per_informative_group_s']:.2f} | "
                      f"{b['speedup_vs_twotier_ds']:.2f}x | {b['informative_groups']} | {b['rounds']} | {b['skipped_prompts']} |"
                      for b in bounds))
    sources = sorted({r["reused_from"] for r in rows if r.get("reused_from")})
    if sources:  # honest about what was not rerun: its ratio divides by this run's sync + DS
        table += (f"\n\n\\* Reused from {', '.join(sources)} (`--reuse`), not simulated in this run: the change since "
                  "does not touch these policies, but their rows predate any simulator change made since that commit; "
                  "their `vs sync+DS` divides by this run's sync + DS row.")
    (args.out / f"{args.name}.md").write_text(table + "\n")
    plot(rows, args.out / f"{args.name}.png", f"{sim.name}: selective rollout")
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
