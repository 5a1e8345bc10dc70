"""Simulation benchmark: the elastic layout planners (`fixed`, `preemption`, `cost_model`) side by side on one
scenario, per scheduling policy; figures committed to docs/benchmarks/layout_planners_sim_<scale>.{json,md,png}.

    nice .venv/bin/python benchmarks/layout_planners_sim.py                         # 32B, 128 GPUs, twotier
    nice .venv/bin/python benchmarks/layout_planners_sim.py --policies twotier,tail --scale paper_rollpacker_14b_16k

Each row is one deterministic simulation (no repeats needed) of `policy` with `run.scheduler.layout_planner` set
to the planner; everything else is the scenario as committed. Reported per row: samples per second relative to
the same policy with `fixed` (`throughput_vs_fixed`), the layouts each planner chose per round kind (TP and
engine count), the relayouts it paid for and their seconds, KV preemptions, and the bubbles. When `cost_model`
beats `fixed` it is because its engine model says a round kind runs faster at another TP (e.g. long,
latency-bound rounds on wider engines) and the switch pays for its `cluster.relayout_s`; when it loses, the
relayouts cost more than the model expected (its estimate ignores what the scheduler does within a round).

Left out: HistoSpec rows (its acceptance model does not depend on the layout) and repeats (deterministic).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from scheduler.layout import LAYOUT_PLANNERS  # noqa: E402
from scheduler.sim.report import summarize  # noqa: E402
from scheduler.sim.sim_config import load_sim_config  # noqa: E402
from scheduler.sim.simulator import simulate  # noqa: E402

SCALES = {"qwen32b_128gpu": "configs/sim_qwen32b_128gpu.yaml",
          "paper_rollpacker_14b_16k": "configs/sim_paper_rollpacker_14b_16k.yaml"}


def layouts_by_kind(result) -> dict[str, dict[str, int]]:
    """Per round kind, how many rounds ran on each layout ("<engines>xTP<tp>")."""
    out: dict[str, Counter] = {}
    for r in result.rounds:
        out.setdefault(str(r["kind"]), Counter())[f"{r['engines']}xTP{r['tp']}"] += 1
    return {k: dict(v) for k, v in out.items()}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scale", default="qwen32b_128gpu", choices=sorted(SCALES))
    ap.add_argument("--policies", default="twotier", help="comma-separated scheduling policies")
    ap.add_argument("--no-write", action="store_true", help="print only")
    args = ap.parse_args(argv)
    path = SCALES[args.scale]
    rows, t_all = [], time.monotonic()
    for policy in args.policies.split(","):
        for planner in LAYOUT_PLANNERS:
            sim, run = load_sim_config(ROOT / path, [f"run.scheduler.layout_planner={planner}"])
            t0 = time.monotonic()
            result = simulate(sim, run, policy)
            row = summarize(result)
            row.update(policy=policy, planner=planner, layouts=layouts_by_kind(result),
                       relayouts=sum(1 for a, b in zip(result.rounds, result.rounds[1:]) if (a["tp"], a["engines"]) != (b["tp"], b["engines"])),
                       sim_wall_s=time.monotonic() - t0)
            rows.append(row)
            print(f"{policy:>8} {planner:>10}: {row['samples_per_s']:.3f} samples/s, relayout {row['relayout_s']:.0f} s "
                  f"({row['relayouts']} switches), preemptions {row['preemptions']}, layouts {row['layouts']}",
                  flush=True)
    for r in rows:
        base = next(b for b in rows if b["policy"] == r["policy"] and b["planner"] == "fixed")
        r["throughput_vs_fixed"] = r["samples_per_s"] / base["samples_per_s"] if base["samples_per_s"] else 0.0
    keep = ("policy", "planner", "throughput_vs_fixed", "samples_per_s", "total_s", "rollout_s", "relayout_s",
            "relayouts", "preemptions", "worker_bubble", "slot_bubble", "layouts", "sim_wall_s")
    out = {"scenario": args.scale, "config": path,
           "command": f"python benchmarks/layout_planners_sim.py --scale {args.scale} --policies {args.policies}",
           "rows": [{k: r.get(k) for k in keep} for r in rows], "wall_s": time.monotonic() - t_all}
    lines = [f"# Layout planners in the simulator: {args.scale}", "",
             (f"`{out['command']}` (deterministic, one run per row). Samples per second relative to the same "
              "policy with `fixed`."), "",
             "| policy | planner | x fixed | relayouts (s) | preemptions | worker bubble | layouts per round kind |",
             "|---|---|---|---|---|---|---|"]
    for r in out["rows"]:
        lines.append(f"| {r['policy']} | {r['planner']} | {r['throughput_vs_fixed']:.3f} | {r['relayouts']} "
                     f"({r['relayout_s']:.0f}) | {r['preemptions']} | {r['worker_bubble']:.1%} | {r['layouts']} |")
    md = "\n".join(lines) + "\n"
    print(md)
    if args.no_write:
        return 0
    base = ROOT / "docs" / "benchmarks" / f"layout_planners_sim_{args.scale}"
    base.with_suffix(".json").write_text(json.dumps(out, indent=1) + "\n")
    base.with_suffix(".md").write_text(md)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3))
    labels = [f"{r['policy']}\n{r['planner']}" for r in out["rows"]]
    ax.bar(labels, [r["throughput_vs_fixed"] for r in out["rows"]], color="#4C72B0")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_ylabel("samples/s vs fixed")
    ax.set_title(f"Layout planners, {args.scale}", fontsize=10)
    fig.tight_layout()
    fig.savefig(base.with_suffix(".png"), dpi=110)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
