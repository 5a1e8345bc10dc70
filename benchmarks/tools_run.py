"""The tools run over several seeds: held-out accuracy before and after RL, and the tool metrics per step.

    RAY_TMPDIR=/tmp/x PYTHONPATH=$PWD python benchmarks/tools_run.py --seeds 0 1 2 --work-dir runs/bench_tools
    python benchmarks/tools_run.py --work-dir runs/bench_tools --summary-only     # redraw from finished runs

Each seed is one `python -m megatron_sortedrl train configs/tools_cpu.yaml seed=S` (the warm start's draws, the
model's RL sampling and the data order follow it; the tiny model is built once in the work directory). Per
seed it records held-out accuracy before RL (after the warm start) and after, the same for the share of
held-out trajectories that call a tool, and per RL step the tool-call rate (calls per trajectory), the tool
error rate (errors per call), the share of trajectories that called and turns per trajectory, from the run's
`tools/*` metrics. The load average before and after each run is recorded: other work shares the machine.
Writes docs/benchmarks/tools_run.{json,md,png}; finished seeds are kept in the work directory (run_log.py), so a
stopped benchmark goes on where it stopped.

Left out: a separate run without tools (the held-out accuracy before RL is one: greedy decoding after the warm
start answers without the calculator, and scores about 0) and timing figures (docs/benchmarks has them).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.run_log import RunLog  # noqa: E402

OUT = ROOT / "docs" / "benchmarks"


def run_seed(work: Path, seed: int, extra: list[str]) -> dict:
    run_dir = work / f"seed{seed}"
    cmd = [sys.executable, "-m", "megatron_sortedrl", "train", "configs/tools_cpu.yaml", f"seed={seed}",
           f"logging.run_dir={run_dir}", f"model.path={work / 'tools_tiny_model'}", *extra]
    load0, t0 = os.getloadavg(), time.monotonic()
    with open(work / f"seed{seed}.log", "w") as log:
        rc = subprocess.call(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    if rc != 0:
        raise SystemExit(f"seed {seed}: train exited {rc}; see {work / f'seed{seed}.log'}")
    return {"seed": seed, **summarize(run_dir), "wall_s": round(time.monotonic() - t0, 1),
            "load_before": [round(x, 2) for x in load0], "load_after": [round(x, 2) for x in os.getloadavg()]}


def summarize(run_dir: Path) -> dict:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    evals = [r for r in rows if "eval/accuracy" in r]
    steps = [r for r in rows if "tools/calls" in r]
    per_step = [{"step": r["step"], "samples": r["rollout/samples"],
                 "tool_call_rate": r["tools/calls"] / max(1, r["rollout/samples"]),
                 "tool_error_rate": r["tools/errors"] / max(1.0, r["tools/calls"]),
                 "calling_share": r["tools/calling_share"], "turns": r["tools/turns_per_trajectory"],
                 "reward": r["reward/mean"]} for r in steps]
    return {"accuracy_before": evals[0]["eval/accuracy"], "accuracy_after": evals[-1]["eval/accuracy"],
            "eval_calling_share_before": evals[0].get("eval/tools/calling_share"),
            "eval_calling_share_after": evals[-1].get("eval/tools/calling_share"),
            "steps": len(steps), "per_step": per_step}


def med(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def write(runs: list[dict], setup: dict) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    gain = [r["accuracy_after"] - r["accuracy_before"] for r in runs]
    summary = {"accuracy_before": med([r["accuracy_before"] for r in runs]),
               "accuracy_after": med([r["accuracy_after"] for r in runs]), "gain": med(gain),
               "wall_s": med([r["wall_s"] for r in runs])}
    (OUT / "tools_run.json").write_text(json.dumps({"setup": setup, "summary": summary, "runs": runs}, indent=1))
    lines = ["# The tools run (configs/tools_cpu.yaml)", "",
             f"Command: `{setup['command']}`; {setup.get('date', '')}; load average (1, 5, 15 min) before/after "
             "each run in the table: other work shared the 2 cores.", "",
             "| seed | accuracy before RL | after RL | held-out calling share before | after | RL steps | "
             "tool calls/trajectory, first -> last step | train reward, first -> last step | tool errors/call, mean | "
             "wall s | load before -> after |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        ps = r["per_step"]
        err = statistics.mean(p["tool_error_rate"] for p in ps) if ps else 0.0
        lines.append(f"| {r['seed']} | {r['accuracy_before']:.3f} | {r['accuracy_after']:.3f} | "
                     f"{r['eval_calling_share_before']:.2f} | {r['eval_calling_share_after']:.2f} | {r['steps']} | "
                     f"{ps[0]['tool_call_rate']:.2f} -> {ps[-1]['tool_call_rate']:.2f} | "
                     f"{ps[0]['reward']:.2f} -> {ps[-1]['reward']:.2f} | {err:.3f} | "
                     f"{r['wall_s']:.0f} | {r['load_before'][0]:.1f} -> {r['load_after'][0]:.1f} |")
    s = summary
    lines += ["", f"Median over {len(runs)} seeds (min, max): accuracy {s['accuracy_before']['median']:.3f} "
              f"({s['accuracy_before']['min']:.3f}, {s['accuracy_before']['max']:.3f}) before RL -> "
              f"{s['accuracy_after']['median']:.3f} ({s['accuracy_after']['min']:.3f}, "
              f"{s['accuracy_after']['max']:.3f}) after; gain {s['gain']['median']:+.3f} "
              f"({s['gain']['min']:+.3f}, {s['gain']['max']:+.3f}).", "",
              "Per step, per seed: `tools_run.json` (`runs[].per_step`: tool_call_rate = tool calls per trajectory, "
              "tool_error_rate = errors per call, calling_share, turns per trajectory, reward)."]
    (OUT / "tools_run.md").write_text("\n".join(lines) + "\n")
    plot(runs)


def plot(runs: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 4, figsize=(18, 3.8))
    for r in runs:
        st = [p["step"] for p in r["per_step"]]
        ax[0].plot(st, [p["tool_call_rate"] for p in r["per_step"]], label=f"seed {r['seed']}")
        ax[1].plot(st, [p["reward"] for p in r["per_step"]], label=f"seed {r['seed']}")
        ax[2].plot(st, [p["tool_error_rate"] for p in r["per_step"]], label=f"seed {r['seed']}")
        ax[3].plot([0, 1], [r["accuracy_before"], r["accuracy_after"]], marker="o", label=f"seed {r['seed']}")
    ax[0].set(xlabel="RL step", ylabel="tool calls per trajectory", title="Tool-call rate")
    ax[1].set(xlabel="RL step", ylabel="reward (share right)", title="Train reward (sampled, T=1)")
    ax[2].set(xlabel="RL step", ylabel="errors per call", title="Tool error rate")
    ax[3].set(xticks=[0, 1], xticklabels=["before RL", "after RL"], ylabel="held-out accuracy (greedy, with tools)",
              title="Held-out accuracy")
    for a in ax:
        a.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(OUT / "tools_run.png", dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--work-dir", type=Path, default=ROOT / "runs" / "bench_tools")
    ap.add_argument("--summary-only", action="store_true", help="redraw from the finished runs in --work-dir")
    ap.add_argument("overrides", nargs="*", help="key=value overrides passed to every train")
    a = ap.parse_args()
    a.work_dir.mkdir(parents=True, exist_ok=True)
    log = RunLog(a.work_dir, key=("seed",))
    if not a.summary_only:
        for seed in a.seeds:
            if (seed,) not in log:
                log.add(run_seed(a.work_dir, seed, a.overrides))
                print(f"seed {seed}: accuracy {log[(seed,)]['accuracy_before']:.3f} -> "
                      f"{log[(seed,)]['accuracy_after']:.3f} ({log[(seed,)]['wall_s']:.0f}s)", flush=True)
    runs = [log[(s,)] for s in a.seeds if (s,) in log]
    if not runs:
        raise SystemExit(f"no finished run in {a.work_dir}; run without --summary-only first")
    log.finish()
    write(runs, {**log.setup(), "config": "configs/tools_cpu.yaml", "overrides": a.overrides, "cpus": os.cpu_count()})


if __name__ == "__main__":
    main()
