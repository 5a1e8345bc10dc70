"""Reward-stage benchmark: how much of an RL step waits on reward alone, for a fixed reward pool, a pool
that scales from its backlog, and a scaling pool with per-prompt timeouts learned from history.

    python benchmarks/reward_stage.py                  # ~10 min on 2 busy cores; writes docs/benchmarks/reward_stage.*
    python benchmarks/reward_stage.py --steps 2 --repeats 1 --out-dir /tmp/rs    # a quick look

What runs for real: the reward stage (`megatron_sortedrl/reward_stage.py`, process backend) and the code
reward, every program in the bubblewrap sandbox (or its fallback; the JSON says which) against its hidden
tests. What is replayed: generation. Each step, 32 samples (8 prompts x 4) finish at times drawn from a
heavy-tailed (log-normal, median 4 s, capped at 14 s) distribution, the same for every variant (seeded
by repeat and step), and are submitted to the stage at those times; the harvest needs the whole batch; then
a modelled training phase of `--train-s`. Scoring is heavy-tailed too: each prompt's tests take a
log-normal time (median 0.1 s, some prompts about 1 s; the programs sleep rather than spin, so the 2 shared
cores measure the stage's scheduling, not our neighbours), and one sample in 16 is an endless loop that
runs into its timeout. The same prompts come back every step (as epochs do), so history can learn them.

Variants (interleaved within each repeat, fresh workers each, started before the first step):
- `fixed`: 2 workers, every sample's limit `--timeout-s`, arrival order, batches of up to 64 per message,
  each program's sandbox started when the program arrives (the pool's previous behaviour);
- `scaling`: 1..6 workers sized from the backlog, one sample per message, harvest order, fixed limit, each
  worker's next sandbox started ahead while it waits (`reward.warm_sandbox`, the default);
- `scaling+history`: as scaling, with per-prompt limits of 3 x the slowest passing sample (>= 0.3 s);
- `scaling+history (cold sandbox)`: as scaling+history with `warm_sandbox=false`: what the warm start buys.

Per step: `reward_critical_path_s` = last reward of the batch minus last generation finish, its share of the
step, step time, timeouts. Rows: median (min, max) over repeats x steps. Writes JSON + MD + PNG.
Left out: a real rollout engine and trainer (the training run in docs/rewards.md has both).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from megatron_sortedrl.config import RewardConfig  # noqa: E402
from megatron_sortedrl.reward_stage import RewardStage  # noqa: E402
from megatron_sortedrl.sample import Sample  # noqa: E402

PROMPTS, PER_PROMPT = 8, 4
LOOP_EVERY = 16  # one sample in this many (2 a step, at random places) is an endless loop
MEDIAN_FINISH_S, MAX_FINISH_S = 4.0, 14.0  # generation finish times: log-normal, capped
TESTS = {"fn_name": "f", "inputs": [[1], [2], [3]], "outputs": [2, 3, 4]}

_SCALE = dict(autoscale=True, min_workers=1, max_workers=6, target_drain_s=0.5, scale_interval_s=0.2, idle_s=5.0,
              max_batch=1, order="harvest")
_HISTORY = dict(timeout="history", timeout_multiple=3.0, min_timeout_s=0.3)
VARIANTS = {
    "fixed": dict(autoscale=False, max_batch=64, order="fifo", timeout="fixed", warm_sandbox=False),
    "scaling": dict(_SCALE, timeout="fixed", warm_sandbox=True),
    "scaling+history": dict(_SCALE, **_HISTORY, warm_sandbox=True),
    "scaling+history (cold sandbox)": dict(_SCALE, **_HISTORY, warm_sandbox=False),
}


def prompt_cost(p: int) -> float:
    """Seconds of one prompt's tests: log-normal, median 0.1 s (fixed per prompt across steps)."""
    return min(1.5, 0.1 * math.exp(1.2 * random.Random(1000 + p).gauss(0, 1)))


def workload(repeat: int, step: int) -> list[tuple[float, Sample]]:
    """(finish offset s, sample) of one step, sorted by finish; identical for every variant."""
    rng = random.Random(repeat * 1000 + step)
    loops = set(rng.sample(range(PROMPTS * PER_PROMPT), PROMPTS * PER_PROMPT // LOOP_EVERY))
    out = []
    for p in range(PROMPTS):
        for i in range(PER_PROMPT):
            finish = min(MAX_FINISH_S, MEDIAN_FINISH_S * math.exp(0.5 * rng.gauss(0, 1)))
            if p * PER_PROMPT + i in loops:
                prog = "import time\ndef f(x):\n    while True:\n        time.sleep(0.05)\n"
            else:
                cost = prompt_cost(p) * rng.uniform(0.7, 1.3)
                prog = f"import time\ntime.sleep({cost:.3f})\ndef f(x):\n    return x + 1\n"
            s = Sample(prompt_id=f"prompt{p}", index=i, epoch=step, response_text=prog,
                       ground_truth=json.dumps(TESTS))
            out.append((finish, s))
    return sorted(out, key=lambda x: x[0])


def run_variant(name: str, repeat: int, steps: int, timeout_s: float, train_s: float) -> list[dict]:
    cfg = RewardConfig(**VARIANTS[name])
    stage = RewardStage("megatron_sortedrl.rewards.code.reward", cfg, workers=2, timeout_s=timeout_s,
                        group_size=PER_PROMPT, say=lambda _: None)
    try:
        # Start the workers (spawn + import) before the clock runs: a run pays this once, not per step.
        stage.score([Sample("warm", 0, response_text="def f(x):\n    return x + 1\n", ground_truth=json.dumps(TESTS))])
        stage.step_metrics([], 1.0)
        rows = []
        for step in range(steps):
            items = workload(repeat, step)
            t0 = time.monotonic()
            k, got = 0, 0
            while got < len(items):
                now = time.monotonic() - t0
                while k < len(items) and items[k][0] <= now:
                    stage.submit(items[k][1])
                    k += 1
                got += len(stage.poll())
                time.sleep(0.005)
            time.sleep(train_s)  # the modelled training phase
            step_s = time.monotonic() - t0
            batch = [s for _, s in items]
            m = stage.step_metrics(batch, step_s)
            rows.append({"variant": name, "repeat": repeat, "step": step, "step_s": step_s,
                         "critical_path_s": m["reward/critical_path_s"],
                         "critical_path_share": m["reward/critical_path_share"],
                         "timeouts": int(m["reward/timeouts"]), "workers_max": m["reward/workers_max"],
                         "workers_active": m["reward/workers_active"], "scoring_s": m["reward/scoring_s"],
                         "queue_wait_s": m["reward/queue_wait_s"],
                         "passed": sum(1 for s in batch if s.reward == 1.0)})
            print(f"{name:16s} r{repeat} step {step}: step {step_s:5.2f}s crit {m['reward/critical_path_s']:5.2f}s "
                  f"share {m['reward/critical_path_share']:.3f} timeouts {rows[-1]['timeouts']} "
                  f"workers<= {m['reward/workers_max']:.0f} busy {m['reward/workers_active']:.2f}", flush=True)
        return rows
    finally:
        stage.close()


def _mmm(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--timeout-s", type=float, default=4.0)
    ap.add_argument("--train-s", type=float, default=3.0)
    ap.add_argument("--out-dir", default=str(REPO / "docs" / "benchmarks"))
    ap.add_argument("--variants", default="", help="comma-separated subset of the variants (default: all)")
    args = ap.parse_args()
    from megatron_sortedrl.rewards.sandbox import Sandbox

    sandbox = Sandbox("auto").describe()
    print(sandbox)
    per_step: list[dict] = []
    names = [n for n in VARIANTS if not args.variants or n in args.variants.split(",")]
    for r in range(args.repeats):
        for name in names:  # interleaved, so machine load drifts hit every variant alike
            per_step += run_variant(name, r, args.steps, args.timeout_s, args.train_s)
    rows = []
    for name in VARIANTS:
        mine = [x for x in per_step if x["variant"] == name]
        share, step_s = [x["critical_path_share"] for x in mine], [x["step_s"] for x in mine]
        per_repeat_timeouts = [sum(x["timeouts"] for x in mine if x["repeat"] == r) for r in range(args.repeats)]
        if not mine:
            continue
        later = [x["critical_path_share"] for x in mine if x["step"] > 0]  # history has seen the prompts
        rows.append({"variant": name, "reward_critical_path_share": statistics.median(share),
                     "reward_critical_path_share_after_first_step": statistics.median(later) if later else None,
                     "reward_critical_path_share_min": min(share), "reward_critical_path_share_max": max(share),
                     "reward_critical_path_s": _mmm([x["critical_path_s"] for x in mine]),
                     "step_s_median": statistics.median(step_s), "step_s_min": min(step_s), "step_s_max": max(step_s),
                     "timeouts": statistics.median(per_repeat_timeouts), "timeouts_per_repeat": per_repeat_timeouts,
                     "workers_max": max(x["workers_max"] for x in mine),
                     "workers_active_median": statistics.median(x["workers_active"] for x in mine)})
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"sandbox": sandbox, "repeats": args.repeats, "steps_per_repeat": args.steps,
            "samples_per_step": PROMPTS * PER_PROMPT, "timeout_s": args.timeout_s, "train_s": args.train_s,
            "machine": f"{platform.machine()}, {os.cpu_count()} cores shared with other jobs (up to two other "
                       f"benchmarks and nice'd tests; load average {os.getloadavg()[0]:.1f} at the end)",
            "variants": VARIANTS}
    (out / "reward_stage.json").write_text(json.dumps({"meta": meta, "rows": rows, "per_step": per_step}, indent=2))
    lines = ["# Reward stage: fixed pool vs scaling pool vs scaling pool with history timeouts", "",
             f"`python benchmarks/reward_stage.py` ({args.repeats} repeats x {args.steps} steps, "
             f"{PROMPTS * PER_PROMPT} code samples a step, sandbox: {sandbox.split(':', 1)[1].strip()}). "
             f"Machine: {meta['machine']}.", "",
             "| variant | reward critical-path share, median (min-max) | share, steps after the first | critical path s, "
             "median | step s, median (min-max) | timeouts per repeat, median | workers max | busy workers, median |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['variant']} | {r['reward_critical_path_share']:.3f} ({r['reward_critical_path_share_min']:.3f}"
                     f"-{r['reward_critical_path_share_max']:.3f}) | "
                     + (f"{r['reward_critical_path_share_after_first_step']:.3f}"
                        if r["reward_critical_path_share_after_first_step"] is not None else "-")
                     + f" | {r['reward_critical_path_s']['median']:.2f} | "
                     f"{r['step_s_median']:.2f} ({r['step_s_min']:.2f}-{r['step_s_max']:.2f}) | {r['timeouts']:.0f} | "
                     f"{r['workers_max']:.0f} | {r['workers_active_median']:.2f} |")
    lines += ["", "Generation is replayed (same finish times for every variant); scoring is real, in the sandbox. "
              "See the docstring of benchmarks/reward_stage.py for the workload."]
    (out / "reward_stage.md").write_text("\n".join(lines) + "\n")
    _plot(per_step, out / "reward_stage.png")
    print("\n".join(lines))


def _plot(per_step: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.2))
    names = [n for n in VARIANTS if any(x["variant"] == n for x in per_step)]
    data = [[x["critical_path_share"] for x in per_step if x["variant"] == n] for n in names]
    ax.boxplot(data)
    ax.set_xticks(range(1, len(names) + 1), [n.replace(" (", "\n(") for n in names], fontsize=8)
    ax.axhline(0.05, color="#C44E52", linestyle="--", linewidth=1, label="target 0.05")
    ax.set_ylabel("reward critical path / step")
    ax.set_title("Share of each step waiting on reward alone (all repeats x steps)", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


if __name__ == "__main__":
    main()
