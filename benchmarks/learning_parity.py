"""Learning parity: does a scheduling policy's speed cost learning? Held-out accuracy per trained sample and per
wall-clock hour, policy by policy, on real RL runs (CPU) where RL clearly learns.

    PYTHONPATH=. .venv/bin/python benchmarks/learning_parity.py                      # ~80 min on 2 cores
    PYTHONPATH=. .venv/bin/python benchmarks/learning_parity.py --repeats 1 --variants sync,twotier --prompts 32
    PYTHONPATH=. .venv/bin/python benchmarks/learning_parity.py --config configs/longtail_cpu.yaml --stem lp_longtail

The workload is `configs/learning_cpu.yaml` unless `--config` names another (any preset of a procedural task or
of jsonl/parquet files runs unchanged). Every run starts from one shared supervised warm start (written once per
benchmark, on fresh problems of the task: learned, not memorized), sees the same prompts for the same number of
epochs, and is evaluated greedily on the same held-out prompts every `--eval-every` samples drawn from the data
(for every variant but the dynamic-sampling one that is the trained sample count; there it also counts the
groups the filter dropped and the prompts the skip consumed, so all variants are compared at the same data).

Variants (`VARIANTS`): `sync`, `sorted`, `tail`, `twotier` (the default) and `twotier+histospec+ds+skip` (the
default with HistoSpec, DAPO dynamic sampling and the reward-history skip), each over `--repeats` seeds
(seed + r: sampling and data order), interleaved repeat by repeat within one driver per speculative setting
(the drivers, engines and warm start are the policy-comparison benchmark's `Session`, reused).

Recorded per run (JSON): the accuracy curve (samples drawn, samples trained, wall-clock seconds of RL steps,
updates, accuracy, KL to the warm start) at every evaluation; train reward; staleness; updates; final accuracy.
Wall-clock is the sum of the RL steps' `time/step_s` (rollout, reward, train, weight sync, history):
evaluations, start-up and the warm start are excluded for every variant alike. KL to the warm start is
KL(warm start || policy) per response token, estimated on a fixed probe (`--kl-probe-samples` responses per
held-out prompt sampled once from the warm start at the training temperature): mean over tokens of
log p_warm - log p_policy, the k1 estimator, unbiased because the probe is drawn from the warm start.

The verdict (`verdict` in the JSON, the table of the .md): per variant against `sync`, the difference in final
accuracy and in area under the accuracy-vs-samples curve (the curve's mean over the sample budget), paired by
seed (repeat r of both shares seed and data order), with a two-sided 95% t interval over the seeds' differences
(df = repeats - 1); "resolved" when the interval excludes 0, otherwise the seeds cannot tell the two apart at
that size. Per wall-clock hour: accuracy at the same RL time (the fastest variant's median run time, each run's
curve interpolated there) and gain per hour.

Left out: GPUs (the script runs there unchanged, with the figures of that machine); the held-out eval's own
sampling noise (greedy decoding, fixed prompts: deterministic given the weights).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.policy_comparison import RunFailed, Session  # noqa: E402
from benchmarks.run_log import RunLog  # noqa: E402

# name -> (scheduler.policy, speculative.enabled, trainer.stream, extra config keys). `sync` is the baseline.
VARIANTS = {
    "sync": ("sync", False, False, ()),
    "sorted": ("sorted", False, False, ()),
    "tail": ("tail", False, False, ()),
    "twotier": ("twotier", False, False, ()),
    "twotier+histospec+ds+skip": ("twotier", True, False, ("sampling.dynamic=true", "sampling.history_skip=true")),
    # Equal footing (docs/trainer.md, mini-batches): run every variant with `--set algorithm.ppo_mini_batch_size=M`
    # so all make the same optimizer steps; `twotier@onestep` is the default with one step per harvest (the clip
    # never binds), and `--sync-harvest-prompts B` adds `sync@harvest`, sync at a rollout batch of B prompts (the
    # default's mean harvest, from `simulate` or a twotier run's `rollout/samples`).
    "twotier@onestep": ("twotier", False, False, ("algorithm.ppo_mini_batch_size=0",)),
}
BASELINE, DEFAULT = "sync", "twotier"
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}  # t(0.975, df)


def workload_overrides(args) -> list[str]:
    keys = [f"data.num_train_prompts={args.prompts}", f"data.num_eval_prompts={args.eval_prompts}",
            "logging.tensorboard=false"]
    return keys + list(args.set or [])


class Curve:
    """The per-step hook: counts the samples drawn from the data and evaluates at every `every` of them."""

    def __init__(self, every: int, n: int, probe: dict | None) -> None:
        self.every, self.n, self.probe = every, n, probe
        self.drawn = self.trained = self.updates = 0
        self.wall = 0.0
        self.points: list[dict] = []
        self.next_at = every

    def start(self, d, accuracy: float) -> None:
        self.points.append(self.point(d, accuracy, kl=0.0))

    def point(self, d, accuracy: float, kl: float | None) -> dict:
        return {"drawn": self.drawn, "trained": self.trained, "wall_s": round(self.wall, 3), "updates": self.updates,
                "version": d.version, "accuracy": accuracy, "kl_to_warm": kl}

    def __call__(self, d, result) -> None:
        row = result.metrics
        self.trained += len(result.batch)
        groups = row.get("sampling/trained_groups")
        if groups is None:
            self.drawn += len(result.batch)
        else:  # dynamic sampling: dropped groups and skipped prompts were drawn from the data too
            self.drawn += self.n * (groups + row.get("sampling/filtered_groups", 0) + row.get("sampling/skipped_prompts", 0))
        self.wall += row["time/step_s"]
        self.updates += int(row.get("train/optimizer_steps", 1))  # optimizer steps (mini-batches x epochs)
        if self.drawn >= self.next_at:
            while self.next_at <= self.drawn:
                self.next_at += self.every
            self.points.append(self.point(d, d.evaluate()["eval/accuracy"], kl_to_warm(d, self.probe)))

    def finish(self, d, accuracy: float) -> None:
        if self.points[-1]["drawn"] != self.drawn:
            self.points.append(self.point(d, accuracy, kl_to_warm(d, self.probe)))
        else:  # the last step's evaluation is the final one
            self.points[-1]["accuracy"] = accuracy


def kl_probe(d, per_prompt: int) -> dict | None:
    """Responses sampled once from the warm start (engines at version 0) for the held-out prompts, with the warm
    start's per-token log-probs: the fixed probe of `kl_to_warm`."""
    from megatron_sortedrl.rollout import GenRequest
    from megatron_sortedrl.sample import Sample

    if per_prompt <= 0:
        return None
    reqs, by_id = [], {}
    for p in d.eval_prompts:
        for k in range(per_prompt):
            rid = f"klprobe/{p.prompt_id}/{k}"
            by_id[rid] = p
            reqs.append((GenRequest(rid, d._tokens(p), d._sampling(d.cfg.rollout.max_response_length)),
                         len(reqs) % d.pool.layout[0]))
    d.pool.submit_many(reqs)
    samples = []
    for c in d.pool.completions():
        p = by_id[c.request_id]
        s = Sample(prompt_id=p.prompt_id, index=0, epoch=-1, prompt_tokens=d._tokens(p), ground_truth=p.ground_truth)
        c.to_sample(s)
        if s.response_tokens:
            samples.append(s)
    samples.sort(key=lambda s: (s.prompt_id, s.response_tokens))
    return {"samples": samples, "warm_logprobs": d.trainer.compute_logprobs(samples)}


def kl_to_warm(d, probe: dict | None) -> float | None:
    if not probe:
        return None
    cur = d.trainer.compute_logprobs(probe["samples"])
    diffs = [w - c for ws, cs in zip(probe["warm_logprobs"], cur) for w, c in zip(ws, cs)]
    return statistics.fmean(diffs) if diffs else None


def interp(points: list[dict], x_key: str, x: float) -> float:
    """Accuracy at `x` on a run's curve (linear between evaluations; the last value past the end)."""
    pts = [(p[x_key], p["accuracy"]) for p in points]
    if x >= pts[-1][0]:
        return pts[-1][1]
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if x0 <= x <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return pts[0][1]


def area_under_curve(points: list[dict], budget: int) -> float:
    """Mean accuracy over the sample budget: the trapezoid area under accuracy-vs-drawn-samples / budget."""
    xs = [p["drawn"] for p in points]
    ys = [p["accuracy"] for p in points]
    area = sum((x1 - x0) * (y0 + y1) / 2 for x0, x1, y0, y1 in zip(xs, xs[1:], ys, ys[1:]))
    if xs[-1] < budget:  # (cannot happen with equal budgets; kept so a short run is not flattered)
        area += (budget - xs[-1]) * ys[-1]
    return area / budget


def paired_interval(diffs: list[float]) -> dict:
    """Mean of per-seed differences with a two-sided 95% t interval (df = n - 1)."""
    n = len(diffs)
    mean = statistics.fmean(diffs)
    if n < 2:
        return {"mean": mean, "low": None, "high": None, "n": n, "resolved": False}
    half = T95.get(n - 1, 1.96) * statistics.stdev(diffs) / math.sqrt(n)
    return {"mean": mean, "low": mean - half, "high": mean + half, "n": n, "resolved": not (mean - half <= 0 <= mean + half)}


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarize(runs: dict[str, list[dict]], budget: int, every: int) -> dict:
    """Per-variant rows, the common sample grid, the equal-time comparison and the verdict against sync."""
    grid = list(range(0, budget + 1, every))
    if grid[-1] != budget:
        grid.append(budget)
    t_ref = min(statistics.median(r["curve"][-1]["wall_s"] for r in rs) for rs in runs.values())
    rows, verdict = [], {}
    base = runs[BASELINE]
    for name, rs in runs.items():
        finals = [r["curve"][-1]["accuracy"] for r in rs]
        aucs = [area_under_curve(r["curve"], budget) for r in rs]
        hours = [r["curve"][-1]["wall_s"] / 3600 for r in rs]
        at_t = [interp(r["curve"], "wall_s", t_ref) for r in rs]
        gains = [f - r["curve"][0]["accuracy"] for f, r in zip(finals, rs)]
        rows.append({
            "variant": name, "final_accuracy": spread(finals), "auc": spread(aucs),
            "gain": spread(gains), "gain_per_hour": spread([g / h for g, h in zip(gains, hours)]),
            "accuracy_at_equal_time": spread(at_t), "rl_hours": spread(hours),
            "updates": spread([r["curve"][-1]["updates"] for r in rs]),
            "trained_samples": spread([r["curve"][-1]["trained"] for r in rs]),
            "train_reward": spread([r["figures"]["reward_mean"] for r in rs]),
            "staleness_mean": spread([r["figures"]["staleness_mean"] or 0.0 for r in rs]),
            "stale_share": spread([1 - r["figures"]["staleness_hist"].get("0", 0)
                                   / max(1, sum(r["figures"]["staleness_hist"].values())) for r in rs]),
            "kl_to_warm_final": spread([r["curve"][-1]["kl_to_warm"] or 0.0 for r in rs]),
            "ms_per_sample": spread([1e3 * r["curve"][-1]["wall_s"] / r["curve"][-1]["drawn"] for r in rs]),
            "accuracy_at_samples": {str(x): spread([interp(r["curve"], "drawn", x) for r in rs]) for x in grid},
        })
        if name != BASELINE:
            pairs = list(zip(rs, base))
            verdict[name] = {
                "final_accuracy_diff": paired_interval([r["curve"][-1]["accuracy"] - b["curve"][-1]["accuracy"]
                                                        for r, b in pairs]),
                "auc_diff": paired_interval([area_under_curve(r["curve"], budget) - area_under_curve(b["curve"], budget)
                                             for r, b in pairs]),
                "accuracy_at_equal_time_diff": paired_interval([interp(r["curve"], "wall_s", t_ref)
                                                                - interp(b["curve"], "wall_s", t_ref) for r, b in pairs]),
            }
            v = verdict[name]
            v["learns_as_well"] = all(v[k]["low"] is None or v[k]["low"] <= 0 <= v[k]["high"] or v[k]["mean"] > 0
                                      for k in ("final_accuracy_diff", "auc_diff"))
    return {"rows": rows, "verdict": verdict, "grid": grid, "equal_time_s": t_ref}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (name, rs) in enumerate(result["runs"].items()):
        c = colors[i % len(colors)]
        grid = result["summary"]["grid"]
        per = [[interp(r["curve"], "drawn", x) for r in rs] for x in grid]
        axes[0].plot(grid, [statistics.median(v) for v in per], color=c, label=name)
        axes[0].fill_between(grid, [min(v) for v in per], [max(v) for v in per], color=c, alpha=0.15)
        t_end = max(r["curve"][-1]["wall_s"] for r in rs)
        ts = [t_end * k / 40 for k in range(41)]
        per_t = [[interp(r["curve"], "wall_s", t) for r in rs] for t in ts]
        hours = [t / 3600 for t in ts]
        axes[1].plot(hours, [statistics.median(v) for v in per_t], color=c, label=name)
        axes[1].fill_between(hours, [min(v) for v in per_t], [max(v) for v in per_t], color=c, alpha=0.15)
    axes[0].set_xlabel("samples drawn from the data")
    axes[1].set_xlabel("wall-clock hours of RL steps")
    for ax in axes:
        ax.set_ylabel("greedy held-out accuracy")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    s = result["setup"]
    fig.suptitle(f"Learning parity on {s['config']} ({s['task']}): median and range over {s['repeats']} seeds, "
                 f"{s['machine']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _ci(v: dict) -> str:
    if v["low"] is None:
        return f"{v['mean']:+.3f}"
    return f"{v['mean']:+.3f} [{v['low']:+.3f}, {v['high']:+.3f}]" + (" resolved" if v["resolved"] else "")


def markdown(result: dict, stem: str) -> str:
    s, summ = result["setup"], result["summary"]
    rows = {r["variant"]: r for r in summ["rows"]}

    def m(d: dict, fmt: str = ".3f") -> str:
        return f"{d['median']:{fmt}} ({d['min']:{fmt}}-{d['max']:{fmt}})"

    lines = [f"# Learning parity: {s['config']}", "",
             f"Generated by `{s['command']}` ({s['machine']}, {s['date']}, {s['benchmark_s'] / 60:.0f} minutes); "
             f"figures in [{stem}.json]({stem}.json), plot in [{stem}.png]({stem}.png).", "",
             (f"Workload: {s['task']} (difficulty {s['min_difficulty']}..{s['max_difficulty']}), {s['prompts']} "
              f"training prompts x n={s['n']} x {s['epochs']} epochs = {s['budget']} samples drawn per run, "
              f"{s['eval_prompts']} held-out prompts evaluated greedily every {s['eval_every']} samples. One "
              f"{s['warm_start'].get('steps')}-step supervised warm start on {s['warm_start'].get('sft_problems')} fresh "
              f"problems (held-out accuracy {', '.join(f'{a:.3f}' for a in result['checks']['accuracy_before_rl'])} "
              f"before RL). Seeds {s['seeds']}, interleaved; medians with (min-max)."), "",
             f"Machine: {s['machine_note']} Load average at run starts and ends: median {s['load_average']['median']:.1f}.", "",
             "| variant | final acc | gain | AUC (acc over samples) | acc at equal time | gain/hour | RL hours | updates "
             "| stale share | train reward | KL to warm |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        lines.append(f"| {name} | {m(r['final_accuracy'])} | {m(r['gain'], '+.3f')} | {m(r['auc'])} | "
                     f"{m(r['accuracy_at_equal_time'])} | {m(r['gain_per_hour'], '.2f')} | {m(r['rl_hours'], '.3f')} | "
                     f"{m(r['updates'], '.0f')} | {m(r['stale_share'], '.2f')} | {m(r['train_reward'])} | "
                     f"{m(r['kl_to_warm_final'], '.4f')} |")
    lines += ["", f"## Against `{BASELINE}`, paired by seed (mean difference, 95% t interval over {s['repeats']} seeds)", "",
              "| variant | final accuracy | AUC | accuracy at equal time | learns as well |", "|---|---|---|---|---|"]
    for name, v in summ["verdict"].items():
        lines.append(f"| {name} | {_ci(v['final_accuracy_diff'])} | {_ci(v['auc_diff'])} | "
                     f"{_ci(v['accuracy_at_equal_time_diff'])} | {'yes' if v['learns_as_well'] else 'no'} |")
    lines += ["", ("\"resolved\": the interval excludes 0, the seeds tell the variant from sync at that size; otherwise "
                   "the difference is within what the seeds can resolve. \"learns as well\": neither final accuracy nor "
                   "AUC is worse than sync beyond the interval. Accuracy at equal time: each run's accuracy after "
                   f"{summ['equal_time_s']:.0f} s of RL steps (the fastest variant's median run)."), ""]
    lines += ["## Speed and learning side by side", "", result["side_by_side"], ""]
    if result.get("reading"):
        lines += ["## Reading", "", result["reading"], ""]
    return "\n".join(lines)


def side_by_side(result: dict, sim_path: Path) -> str:
    """One table per policy: the simulator's speed at scale (`x_best_sync` of the committed 128-GPU scenario, at
    equal optimizer steps against the better sync) beside this benchmark's measured speed and learning on CPU."""
    sim = {r["policy"]: r for r in json.loads(sim_path.read_text())["rows"]} if sim_path.is_file() else {}
    sim_name = {"twotier+histospec+ds+skip": "twotier+histospec", "twotier@onestep": ""}  # no dynamic sampling rows
    rows = {r["variant"]: r for r in result["summary"]["rows"]}
    base = rows[BASELINE]
    lines = [f"| policy | simulated x best sync ({sim_path.stem}) | measured x sync (ms/sample, CPU) | final accuracy | "
             "gain over warm start | AUC | vs sync: final, AUC (95% CI) | updates | stale share |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        srow = sim.get(sim_name.get(name, name), {})
        speed = base["ms_per_sample"]["median"] / r["ms_per_sample"]["median"]
        v = result["summary"]["verdict"].get(name)
        vs = f"{_ci(v['final_accuracy_diff'])}; {_ci(v['auc_diff'])}" if v else "-"
        simx = f"{srow['x_best_sync']:.2f}" if srow.get("x_best_sync") else "-"
        lines.append(f"| {name} | {simx} | {speed:.2f} | {r['final_accuracy']['median']:.3f} | "
                     f"{r['gain']['median']:+.3f} | {r['auc']['median']:.3f} | {vs} | {r['updates']['median']:.0f} | "
                     f"{r['stale_share']['median']:.2f} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/learning_cpu.yaml")
    ap.add_argument("--stem", default="learning_parity", help="output files docs/benchmarks/<stem>.{json,md,png}")
    ap.add_argument("--variants", default=",".join(v for v in VARIANTS if v != "twotier@onestep"))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prompts", type=int, default=None, help="training prompts (default: the config's)")
    ap.add_argument("--eval-prompts", type=int, default=None, help="held-out prompts (default: the config's)")
    ap.add_argument("--epochs", type=int, default=None, help="data.num_epochs (default: the config's)")
    ap.add_argument("--eval-every", type=int, default=0, help="samples drawn between evaluations (default: budget/8)")
    ap.add_argument("--warmup-steps", type=int, default=None, help="supervised warm-up steps (default: the config's)")
    ap.add_argument("--sft-prompts", type=int, default=0, help="fresh warm-up problems (default: the config's)")
    ap.add_argument("--kl-probe-samples", type=int, default=2, help="warm-start responses per held-out prompt for KL")
    ap.add_argument("--set", action="append", help="extra config key=value for every run (repeatable)")
    ap.add_argument("--sync-harvest-prompts", type=int, default=0,
                    help="add the variant sync@harvest: sync at this rollout batch (prompts), the default's mean harvest")
    ap.add_argument("--work-dir", type=Path, default=None)
    ap.add_argument("--machine-note", default="")
    ap.add_argument("--reading", type=Path, default=None, help="a markdown file with the reading, put into the .md")
    ap.add_argument("--sim-json", type=Path, default=ROOT / "docs" / "benchmarks" / "simulation_qwen32b_128gpu.json",
                    help="the simulator's committed scenario whose speed figures go beside the learning figures")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks")
    args = ap.parse_args()

    from megatron_sortedrl.config import load_config
    from megatron_sortedrl.errors import UserError

    if args.sync_harvest_prompts:
        VARIANTS["sync@harvest"] = ("sync", False, False, (f"scheduler.rollout_batch_size={args.sync_harvest_prompts}",))
    names = args.variants.split(",")
    if BASELINE not in names or any(n not in VARIANTS for n in names) or args.repeats < 1:
        print(f"error: --variants must name {BASELINE} and only {', '.join(VARIANTS)} (got {args.variants}); "
              "--repeats must be >= 1", file=sys.stderr)
        return 2
    try:
        base = load_config(ROOT / args.config, list(args.set or []))
    except (UserError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    args.prompts = args.prompts or base.data.num_train_prompts
    args.eval_prompts = args.eval_prompts or base.data.num_eval_prompts
    args.epochs = args.epochs or base.data.num_epochs or 1
    n = base.rollout.n_samples_per_prompt
    budget = args.prompts * n * args.epochs
    every = args.eval_every or max(n, budget // 8)

    work = (args.work_dir or Path(tempfile.mkdtemp(prefix="learning_parity_"))).resolve()
    work.mkdir(parents=True, exist_ok=True)
    ckpt = work / "warm_start" / "ckpt"
    done = RunLog(work, ("variant", "repeat"), "python benchmarks/learning_parity.py " + " ".join(sys.argv[1:]))
    print(f"work dir {work}; budget {budget} samples per run, evaluation every {every}", flush=True)
    warm = json.loads((ckpt.parent / "warm_start.json").read_text()) if (ckpt.parent / "warm_start.json").is_file() else {}
    loads, startups = [], {}
    probe = None
    groups = [[x for x in names if VARIANTS[x][1] == spec] for spec in (False, True)]
    try:
        for group in groups:
            todo = [(rep, x) for rep in range(args.repeats) for x in group if (x, rep) not in done]
            if not todo:
                continue
            session = Session(args, VARIANTS[group[0]][1], work, overrides=workload_overrides)
            startups["speculative" if session.spec else "plain"] = round(session.startup_s, 1)
            try:
                if not warm:
                    warm = session.warm_start(ckpt)
                    print(f"warm-up done in {warm['seconds']:.0f}s, loss {warm['final_loss']:.3f}", flush=True)
                d = session.driver
                if probe is None:
                    d.trainer.load_checkpoint(ckpt)
                    d.pool.sync_weights(d.trainer, version=0)
                    probe = kl_probe(d, args.kl_probe_samples)
                for rep, name in todo:
                    curve = Curve(every, n, probe)
                    orig = d.evaluate

                    def evaluate_once(curve=curve, orig=orig):  # the driver's pre-RL eval starts the curve
                        out = orig()
                        if not curve.points:
                            curve.start(d, out["eval/accuracy"])
                        return out
                    d.evaluate = evaluate_once
                    try:
                        fig_run = session.run(name, rep, ckpt, variant=VARIANTS[name], on_step=curve, replay=False)
                    finally:
                        d.evaluate = orig
                    run_dir = Path(fig_run["run_dir"])
                    final = json.loads((run_dir / "summary.json").read_text())["accuracy_after_rl"]
                    curve.finish(d, final)
                    loads += fig_run["load_average"]
                    rec = {"variant": name, "repeat": rep, "seed": args.seed + rep, "curve": curve.points,
                           "figures": {k: fig_run[k] for k in ("reward_mean", "staleness_mean", "staleness_hist", "steps",
                                                               "trained_samples", "step_s_total", "spec_tokens_per_forward",
                                                               "accuracy_before_rl", "load_average")}}
                    done.add(rec)
                    c = curve.points
                    print(f"{name:26s} r{rep}: acc {c[0]['accuracy']:.3f} -> {c[-1]['accuracy']:.3f}  "
                          f"{c[-1]['updates']} updates  {c[-1]['trained']} trained  {c[-1]['wall_s']:.0f}s  "
                          f"KL {c[-1]['kl_to_warm'] or 0:.4f}  reward {rec['figures']['reward_mean']:.3f}", flush=True)
            finally:
                session.close()
    except RunFailed as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        done.finish()
    runs = {x: [done[(x, rep)] for rep in range(args.repeats)] for x in names}
    befores = sorted({round(r["curve"][0]["accuracy"], 6) for rs in runs.values() for r in rs})
    drawn = {f"{x}/r{i}": r["curve"][-1]["drawn"] for x, rs in runs.items() for i, r in enumerate(rs)}
    loads = loads or [x for rs in runs.values() for r in rs for x in r["figures"]["load_average"]]
    cfg = load_config(ROOT / args.config, workload_overrides(args))
    result = {
        "setup": {"command": done.setup()["command"], "starts": done.setup()["starts"], "config": args.config,
                  "task": cfg.data.task, "min_difficulty": cfg.data.min_difficulty, "max_difficulty": cfg.data.max_difficulty,
                  "prompts": args.prompts, "eval_prompts": args.eval_prompts, "n": n, "epochs": args.epochs,
                  "budget": budget, "eval_every": every, "repeats": args.repeats,
                  "seeds": [args.seed + r for r in range(args.repeats)], "warm_start": warm,
                  "kl_probe_samples": len(probe["samples"]) if probe else None,
                  "driver_startup_s": startups, "machine": f"{platform.machine()} {os.cpu_count()} CPUs",
                  "machine_note": args.machine_note or "not given.",
                  "load_average": {"min": min(loads), "median": statistics.median(loads), "max": max(loads)},
                  "date": done.setup()["date"], "benchmark_s": done.setup()["benchmark_s"]},
        "checks": {"accuracy_before_rl": befores, "identical_start": len(befores) == 1, "drawn_samples": drawn,
                   "equal_data_budget": all(v == budget for v in drawn.values())},
        "summary": summarize(runs, budget, every),
        "runs": runs,
    }
    result["side_by_side"] = side_by_side(result, args.sim_json)
    if args.reading and args.reading.is_file():
        result["reading"] = args.reading.read_text().strip()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.stem}.json").write_text(json.dumps(result, indent=1) + "\n")
    (args.out / f"{args.stem}.md").write_text(markdown(result, args.stem))
    plot(result, args.out / f"{args.stem}.png")
    print((args.out / f"{args.stem}.md").read_text())
    for k, ok in (("identical_start", result["checks"]["identical_start"]),
                  ("equal_data_budget", result["checks"]["equal_data_budget"])):
        if not ok:
            print(f"warning: check {k} failed: {result['checks']}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
