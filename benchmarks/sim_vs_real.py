"""Does the calibrated simulator predict real runs? Each policy runs for real (short CPU runs on the long-tail
preset, same warm start, prompts and sample budget) and in the simulator calibrated from a real run; per policy
the measured and predicted time per trained sample and worker bubble ratio, and their errors.

    PYTHONPATH=. .venv/bin/python benchmarks/sim_vs_real.py --work-dir /tmp/svr --repeats 3 --real-only   # real runs, ~35 min at load 35-100
    PYTHONPATH=. .venv/bin/python benchmarks/sim_vs_real.py --work-dir /tmp/svr --repeats 3 --skip-real   # simulate them, ~15 min
    PYTHONPATH=. .venv/bin/python benchmarks/sim_vs_real.py --render-only     # .md/.png again from the JSON + notes

Real runs: `configs/longtail_cpu.yaml` with `--prompts`, `--n`, `--epochs`, `--workers` (2 by default: with the
preset's one engine the worker bubble is 0 by definition) and `--set key=value` overrides, HistoSpec off (the
simulator's speculation model is not what is checked here), mid-run evals and checkpoints off. They go through
one driver (`policy_comparison.Session`: start-up once, every run reloads the same warm-start checkpoint, made
first unless `--warm-ckpt` has one) and per repeat the policies run back to back (interleaved), seed + repeat.
A finished run in the work dir is reused, so a stopped benchmark resumes (`--real-only` first, then
`--skip-real`, splits the slot time). `--process-per-run` runs one `train` process per run instead.

Each run is then simulated with its own config and its own response lengths replayed (`simulate
--calibrate-from`), with costs from (see `KINDS`): the same repeat's `sync` run, level-matched to that run's
rollout seconds (`predicted`, the prediction); the same plus a machine-speed probe (the identical pre-RL eval;
`probe`); the run itself without level matching (`self`, replay fidelity). Where the simulator's engines
jitter round to round (`cluster.engine_jitter`), a prediction is the mean over `DRAWS` draws. For every run
but sync the error is attributed to a cost group (`attribution`).

Measured figures come from the run's timeline with the functions the simulator's report uses: time per
trained sample = (end of the last rollout/train/sync/history phase - start of the first rollout) / samples
trained (phases that ended: the last, unclosed rollout phase of a run is not stretched over its final
eval); worker bubble = `worker_bubble_ratio` pooled over all rollout phases. Writes
docs/benchmarks/sim_vs_real.{json,md,png} (or under --out), with benchmarks/sim_vs_real_notes.md as the reading.

Left out: speculative decoding, GPU runs (the script runs there unchanged), engine re-layouts (the real
driver runs a fixed layout).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
POLICIES = ("sync", "tail", "sorted", "twotier")
TIME_TARGET, BUBBLE_TARGET = 0.15, 0.05
DRAWS = 8  # simulated replays per prediction when engines jitter (their mean is the prediction)
WORK_PHASES = ("rollout", "train", "sync", "history", "logprob", "reward")


def _policy_comparison():
    spec = importlib.util.spec_from_file_location("policy_comparison", ROOT / "benchmarks" / "policy_comparison.py")
    mod = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod


def real_overrides(args) -> list[str]:
    """The keys of a `--process-per-run` run (the session runs get the same through policy_comparison)."""
    keys = [f"seed={args.seed}", f"data.num_train_prompts={args.prompts}", f"data.num_eval_prompts={args.eval_prompts}",
            f"rollout.n_samples_per_prompt={args.n}", f"rollout.num_workers={args.workers}",
            "logging.tensorboard=false", "speculative.enabled=false", f"data.num_epochs={args.epochs}",
            f"trainer.total_steps={args.prompts * args.epochs}", "trainer.eval_interval=0",
            "checkpoint.save_interval=0", "checkpoint.resume=never", "trainer.warmup_sft_steps=0",
            "model.build_tiny_if_missing=false"]
    if args.max_difficulty:
        keys.append(f"data.max_difficulty={args.max_difficulty}")
    if args.max_response_length:
        keys.append(f"rollout.max_response_length={args.max_response_length}")
    return keys + list(args.set or [])


def _finished(run_dir: Path) -> bool:
    summary = run_dir / "summary.json"
    return summary.exists() and bool(json.loads(summary.read_text()).get("data_exhausted"))


class SessionRuns:
    """The real runs through one driver (`policy_comparison.Session`): engines, trainer and reward pool start
    once; before every run the trainer reloads the warm-start checkpoint and the engines get it as version 0,
    so each run is what a fresh `train` from the warm start would do, without minutes of start-up per run.
    The driver starts on the first run that is not already finished in the work dir."""

    def __init__(self, args, work: Path) -> None:
        self.args, self.work, self.session = args, work, None
        self.pc = _policy_comparison()
        base = self.pc.workload_overrides
        extra = [f"rollout.n_samples_per_prompt={args.n}", f"rollout.num_workers={args.workers}",
                 *(args.set or [])]
        self.pc.workload_overrides = lambda a: base(a) + extra  # the session's runs and warm-up share them
        self.ns = argparse.Namespace(config=args.config, prompts=args.prompts, eval_prompts=args.eval_prompts,
                                     max_difficulty=args.max_difficulty, max_response_length=args.max_response_length,
                                     seed=args.seed, epochs=args.epochs, warmup_steps=args.warmup_steps,
                                     sft_prompts=args.sft_prompts)
        self.ckpt = (args.warm_ckpt or work / "warm_start" / "ckpt").resolve()
        self.startup_s: float | None = None

    def run(self, policy: str, repeat: int) -> Path:
        run_dir = self.work / f"{policy}_r{repeat}"
        if _finished(run_dir):
            print(f"[real] {policy} r{repeat}: reusing the finished run in {run_dir}", flush=True)
            return run_dir
        if self.session is None:
            self.session = self.pc.Session(self.ns, False, self.work)
            self.startup_s = self.session.startup_s
            if not (self.ckpt.parent / "warm_start.json").is_file():
                print(f"[warm-up] {self.args.warmup_steps} supervised steps -> {self.ckpt}", flush=True)
                self.session.warm_start(self.ckpt)
        r = self.session.run(policy, repeat, self.ckpt)
        print(f"[real] {policy} r{repeat}: {r['steps']} steps, {1e3 * r['s_per_sample_steps']:.1f} ms/sample, "
              f"{r['process_s']:.0f}s, load {r['load_average'][0]:.1f}/{r['load_average'][1]:.1f}", flush=True)
        (run_dir / "load_average.json").write_text(json.dumps(r["load_average"]))
        return run_dir

    def close(self) -> None:
        if self.session is not None:
            self.session.close()


def run_real(policy: str, repeat: int, args, model_dir: Path, work: Path) -> Path:
    run_dir = work / f"{policy}_r{repeat}"
    cmd = [sys.executable, "-m", "megatron_sortedrl", "train", args.config, *real_overrides(args),
           f"model.path={model_dir}", f"logging.run_dir={run_dir}", f"scheduler.policy={policy}"]
    log = work / f"{run_dir.name}.log"
    summary = run_dir / "summary.json"
    if _finished(run_dir):
        print(f"[real] {policy} r{repeat}: reusing the finished run in {run_dir}", flush=True)
        return run_dir
    print(f"[real] {policy} r{repeat}: {shlex.join(cmd)}", flush=True)
    t0 = time.monotonic()
    for attempt in range(6):  # a busy machine can time out Ray's start-up; that is not the run's failure
        with open(log, "w") as fh:
            try:
                rc = subprocess.run(cmd, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT, timeout=args.run_timeout).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
        if rc == 0 or "timed out during startup" not in log.read_text(errors="replace"):
            break
        print(f"[real] {policy} r{repeat}: Ray start-up timed out, retrying", flush=True)
        time.sleep(20)
    if rc != 0 or not summary.exists():
        tail = "".join(log.read_text(errors="replace").splitlines(keepends=True)[-15:])
        raise RuntimeError(f"{policy} r{repeat}: rc={rc}; log {log}:\n{tail}")
    print(f"[real] {policy} r{repeat}: done in {time.monotonic() - t0:.0f}s", flush=True)
    return run_dir


def measured(run_dir: Path) -> dict:
    """Time per trained sample, worker bubble and phase seconds of a real run, from its timeline."""
    from megatron_sortedrl.telemetry.timeline import phase_intervals, read_run_timeline, worker_bubble_ratio
    from scheduler.sim.calibrate import probe_seconds

    events = read_run_timeline(run_dir)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    samples = sum(r.get("rollout/samples", 0) for r in rows if "time/step_s" in r)
    # Only phases that ended: run directories recorded before the driver closed its last (empty) rollout phase
    # have it open, and `phase_intervals` would stretch it over the post-RL evaluation.
    ended = {(e.step, e.phase) for e in events if e.kind == "phase" and e.event == "end"}
    spans = [(p, a, b) for s, p, a, b in phase_intervals(events) if p in WORK_PHASES and (s, p) in ended]
    t0 = min(a for p, a, _ in spans if p == "rollout")
    t1 = max(b for _, _, b in spans)
    phase = {k: sum(b - a for p, a, b in spans if p == k) for k in ("rollout", "train")}
    total = t1 - t0
    # Engine speed as the run saw it: per engine, its busy rollout seconds (first token to last end, per step)
    # per generated token; it shows how much the machine's load moved between and within runs.
    busy: dict = {}
    for step in {e.step for e in events if e.kind == "request"}:
        for w in {e.worker for e in events if e.kind == "request" and e.step == step}:
            evs = [e for e in events if e.kind == "request" and e.step == step and e.worker == w]
            firsts = [e.t for e in evs if e.event == "first_token"]
            ends = [e for e in evs if e.event in ("finish", "abort")]
            if firsts and ends:
                sec, tok = busy.get(w, (0.0, 0))
                busy[w] = (sec + max(e.t for e in ends) - min(firsts), tok + sum(e.tokens or 0 for e in ends))
    return {"samples": samples, "total_s": total, "s_per_sample": total / samples,
            "engine_ms_per_token": {str(w): round(1e3 * sec / max(1, tok), 3) for w, (sec, tok) in sorted(busy.items())},
            "worker_bubble": worker_bubble_ratio(events), "probe_s": probe_seconds(events), "rollout_s": phase["rollout"], "train_s": phase["train"],
            "other_s": total - phase["rollout"] - phase["train"],
            "steps": sum(1 for r in rows if "time/step_s" in r), "load_average": _load_of(run_dir)}


def _load_of(run_dir: Path) -> list | None:
    """1-minute load average at the run's start and end (written by the session runner), if known."""
    path = Path(run_dir) / "load_average.json"
    return json.loads(path.read_text()) if path.is_file() else None


# How a run is predicted: (key, costs from, scale engines by the pre-RL eval probe, description)
KINDS = (("predicted", "sync", False, "costs from the same repeat's sync run, engine speed level-matched to its rollout "
                                     "seconds (`match_rollout_level`)"),
         ("probe", "sync", True, "as `predicted`, engine speed scaled by the run's pre-RL eval against sync's (the "
                                 "same greedy work in every run: a probe of the machine's speed at the time)"),
         ("self", "self", False, "costs fitted on the run itself, no level matching (replay fidelity of the raw fit)"))


def predicted(run_dir: Path, costs_from: Path, policy: str, out: Path, probe: bool = False,
              match_level: bool = True) -> tuple[dict, dict]:
    """Simulated figures of `run_dir` (its config and lengths) with costs calibrated on `costs_from`."""
    from scheduler.sim.calibrate import calibrated_scenario
    from scheduler.sim.sim_config import load_sim_config

    base, _ = load_sim_config(ROOT / "configs" / "sim_tiny_cpu.yaml")
    sim, run, cal = calibrated_scenario(base, run_dir, out, costs_from=costs_from, probe=probe,
                                        match_level=match_level)
    return simulated(sim, run, policy), {"engine": cal.engine, "cluster": cal.cluster, "fit": cal.fit}


def simulated(sim, run, policy: str) -> dict:
    """Figures of the simulated replay, the mean over draws of the engines' round-to-round speeds."""
    import statistics

    from scheduler.sim.calibrate import draws_of
    from scheduler.sim.report import summarize
    from scheduler.sim.simulator import simulate

    rows = [summarize(simulate(x, run, policy)) for x in draws_of(sim, DRAWS)]
    m = {k: statistics.mean(r[k] for r in rows) for k in ("samples", "total_s", "worker_bubble", "rollout_s", "train_s", "rounds")}
    return {"samples": m["samples"], "total_s": m["total_s"], "s_per_sample": m["total_s"] / m["samples"],
            "worker_bubble": m["worker_bubble"], "rollout_s": m["rollout_s"], "train_s": m["train_s"],
            "other_s": m["total_s"] - m["rollout_s"] - m["train_s"], "steps": round(m["rounds"]),
            "draws": len(rows), "worker_bubble_draws": [r["worker_bubble"] for r in rows]}


def attribution(run_dir: Path, costs_from: Path, policy: str, real: dict, out: Path) -> dict:
    """Which modelled cost makes the prediction wrong: the time error when one group of sync's (level-matched)
    costs is replaced by the same group measured on the run itself (also level-matched), group by group."""
    from scheduler.sim.calibrate import COST_GROUPS, calibrate_run, match_rollout_level, replay_scenario, with_costs_of
    from scheduler.sim.sim_config import load_sim_config

    base, _ = load_sim_config(ROOT / "configs" / "sim_tiny_cpu.yaml")
    src = match_rollout_level(base, costs_from, calibrate_run(costs_from, base.workload.prompt_tokens), out)
    own = match_rollout_level(base, run_dir, calibrate_run(run_dir, base.workload.prompt_tokens), out)
    errs = {}
    for group, *_ in COST_GROUPS:
        sim, run = replay_scenario(base, run_dir, with_costs_of(src, own, group), out)
        errs[group] = simulated(sim, run, policy)["s_per_sample"] / real["s_per_sample"] - 1
    return errs


def compare(real: dict, sim: dict) -> dict:
    return {"time_rel_err": sim["s_per_sample"] / real["s_per_sample"] - 1,
            "bubble_abs_err": sim["worker_bubble"] - real["worker_bubble"]}


def within(err: dict) -> bool:
    return abs(err["time_rel_err"]) <= TIME_TARGET and abs(err["bubble_abs_err"]) <= BUBBLE_TARGET


def per_policy(rows: list[dict]) -> list[dict]:
    """Per policy over repeats: median (min, max) of measured and predicted figures and of the errors."""
    import statistics

    out = []
    for policy in dict.fromkeys(r["policy"] for r in rows):
        rs = [r for r in rows if r["policy"] == policy]
        row: dict = {"policy": policy, "repeats": len(rs)}
        for src in ("real",) + tuple(k for k, *_ in KINDS):
            for key, scale in (("s_per_sample", 1e3), ("worker_bubble", 1.0)):
                vals = [scale * r[src][key] for r in rs]
                name = "ms_per_sample" if key == "s_per_sample" else key
                row[f"{src}_{name}"] = {"median": statistics.median(vals), "min": min(vals), "max": max(vals)}
        for k, *_ in KINDS:
            t = [r[f"err_{k}"]["time_rel_err"] for r in rs]
            bub = [r[f"err_{k}"]["bubble_abs_err"] for r in rs]
            row[f"err_{k}"] = {"time_rel_err_median": statistics.median(t), "time_rel_err_worst": max(t, key=abs),
                               "bubble_abs_err_median": statistics.median(bub), "bubble_abs_err_worst": max(bub, key=abs),
                               "median_within_target": abs(statistics.median(t)) <= TIME_TARGET
                               and abs(statistics.median(bub)) <= BUBBLE_TARGET,
                               "repeats_within_target": sum(within(r[f"err_{k}"]) for r in rs)}
        out.append(row)
    return out


def markdown(result: dict) -> str:
    s = result["setup"]
    lines = [f"# Simulator vs real runs ({s['config']}, CPU)", "",
             f"Command: `{s['command']}`  ", f"Machine: {s['machine']}; the load during each real run is in the "
             "per-run table  ",
             f"Workload: {s['prompts']} prompts x n={s['n']} x {s['epochs']} epochs, {s['workers']} engines, "
             f"{s['repeats']} repeats; in each repeat the policies ran back to back through one driver.", "",
             "Predictions (each replays the run's own response lengths with the run's own config):", ""]
    lines += [f"- `{k}`: {d}" for k, _, _, d in KINDS]
    lines += ["", f"Targets: time per trained sample within {TIME_TARGET:.0%}, worker bubble within {BUBBLE_TARGET}.",
              "", "## Per policy (median over repeats, (min-max); err = median of the per-run errors)", "",
              "| policy | real ms/sample | predicted | err | probe | err | self | err | real bubble | predicted | probe | self |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def mm(d: dict, fmt: str) -> str:
        return f"{d['median']:{fmt}} ({d['min']:{fmt}}-{d['max']:{fmt}})"

    for r in result["per_policy"]:
        lines.append(f"| {r['policy']} | {mm(r['real_ms_per_sample'], '.1f')} | " + " | ".join(
            f"{r[f'{k}_ms_per_sample']['median']:.1f} | {r[f'err_{k}']['time_rel_err_median']:+.1%}" for k, *_ in KINDS)
            + f" | {mm(r['real_worker_bubble'], '.3f')} | " + " | ".join(
            f"{r[f'{k}_worker_bubble']['median']:.3f} ({r[f'err_{k}']['bubble_abs_err_median']:+.3f})" for k, *_ in KINDS) + " |")
    lines += ["", "## Per run", "",
              "| policy | repeat | real ms/sample | predicted | err | probe | err | self | err | real bubble | predicted | probe | self | probe x | load start/end |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        m = r["real"]
        lines.append(f"| {r['policy']} | {r['repeat']} | {1e3 * m['s_per_sample']:.1f} | " + " | ".join(
            f"{1e3 * r[k]['s_per_sample']:.1f} | {r[f'err_{k}']['time_rel_err']:+.1%}" for k, *_ in KINDS)
            + f" | {m['worker_bubble']:.3f} | " + " | ".join(f"{r[k]['worker_bubble']:.3f}" for k, *_ in KINDS)
            + f" | {r.get('probe_scale') or 0:.2f} | "
            + ("/".join(f"{x:.0f}" for x in m["load_average"]) if m.get("load_average") else "-") + " |")
    groups = list(next((r["error_with_own"] for r in result["rows"] if r.get("error_with_own")), {}))
    if groups:
        lines += ["", "Which modelled cost is wrong: the time error of `predicted` when one group of sync's costs is "
                  "replaced by the same group measured on the run itself (level-matched); the group whose swap "
                  "removes most of the error is the one sync's costs got wrong for this run:", "",
                  "| policy | repeat | predicted err | " + " | ".join(groups) + " |", "|---|---|---|" + "---|" * len(groups)]
        for r in result["rows"]:
            if r.get("error_with_own"):
                lines.append(f"| {r['policy']} | {r['repeat']} | {r['err_predicted']['time_rel_err']:+.1%} | "
                             + " | ".join(f"{r['error_with_own'][g]:+.1%}" for g in groups) + " |")
    lines += ["", "Where the time goes (seconds over the whole run: real / predicted / probe / self):", "",
              "| policy | repeat | steps | rollout | train | other (sync, history, driver gaps) |", "|---|---|---|---|---|---|"]
    for r in result["rows"]:
        srcs = ["real"] + [k for k, *_ in KINDS]
        cells = [" / ".join(f"{r[x][k]:.1f}" for x in srcs) for k in ("rollout_s", "train_s", "other_s")]
        lines.append(f"| {r['policy']} | {r['repeat']} | " + " / ".join(str(r[x]["steps"]) for x in srcs) + " | "
                     + " | ".join(cells) + " |")
    lines += ["", "Calibrated costs (per run, `self`):", "",
              "| policy | repeat | step overhead ms | ms per running seq | us per context token | prefill tok/s | "
              "decode fit rms | train fixed s | train tok/s | sync+other s | reward latency ms | round start ms | "
              "engine slowdown | pre-RL eval s |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        e, c, f = r["calibration_self"]["engine"], r["calibration_self"]["cluster"], r["calibration_self"]["fit"]
        lines.append(f"| {r['policy']} | {r['repeat']} | {1e3 * e['step_overhead_s']:.3f} | {1e3 * e['per_seq_s']:.4f} | "
                     f"{1e6 * e['kv_s_per_token']:.4f} | {e['prefill_tokens_per_s']:.0f} | {f['decode_rel_rms']:.1%} | "
                     f"{c['train_fixed_s']:.3f} | {min(c['train_tokens_per_s'], 1e9):.0f} | {c['weight_sync_s']:.3f} | "
                     f"{1e3 * c['reward_latency_s']:.1f} | {1e3 * c['round_start_s']:.1f} | "
                     f"{', '.join(f'{x:.2f}' for x in c.get('engine_slowdown') or [1.0])} | {f.get('probe_s') or 0:.2f} |")
    lines += ["", result.get("notes", "")]
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    labels = [f"{r['policy']}\nr{r['repeat']}" for r in rows]
    x = range(len(rows))
    fig, ax = plt.subplots(1, 2, figsize=(14, 4.8))
    srcs = (("real", "#636363"), ("predicted", "#e6550d"), ("probe", "#fdae6b"), ("self", "#3182bd"))
    for k, (key, scale, title) in enumerate([("s_per_sample", 1e3, "ms per trained sample"),
                                            ("worker_bubble", 1.0, "worker bubble ratio")]):
        for j, (name, color) in enumerate(srcs):
            ax[k].bar([i + (j - 1.5) * 0.2 for i in x], [scale * r[name][key] for r in rows], 0.2, label=name, color=color)
        ax[k].set_xticks(list(x), labels, fontsize=7)
        ax[k].set_title(title)
        ax[k].legend(fontsize=8)
    fig.suptitle("Calibrated simulator vs real CPU runs (predicted: sync's costs; probe: sync's costs x pre-RL eval "
                 "speed; self: the run's own costs)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/longtail_cpu.yaml", help="base run config (the preset; sizes below)")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--prompts", type=int, default=48)
    ap.add_argument("--eval-prompts", type=int, default=8, help="held-out prompts of the pre/post-RL evals (not timed)")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--workers", type=int, default=2, help="rollout engines (the worker bubble needs more than one)")
    ap.add_argument("--max-difficulty", type=int, default=None, help="default: the config's")
    ap.add_argument("--max-response-length", type=int, default=None, help="default: the config's")
    ap.add_argument("--warmup-steps", type=int, default=400)
    ap.add_argument("--sft-prompts", type=int, default=0,
                    help="fresh problems of the supervised warm-up (default: the config's, else 2048)")
    ap.add_argument("--warm-ckpt", type=Path, default=None,
                    help="warm-start trainer checkpoint to reuse (made there first unless warm_start.json is beside it)")
    ap.add_argument("--seed", type=int, default=0, help="seed of repeat 0; repeat r uses seed + r")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--set", action="append", help="extra key=value for every real run (repeatable)")
    ap.add_argument("--process-per-run", action="store_true",
                    help="one `train` process per run (start-up paid per run; needs --model-dir: a warm HF dir)")
    ap.add_argument("--model-dir", type=Path, default=None, help="with --process-per-run: warm-started HF dir")
    ap.add_argument("--work-dir", type=Path, default=None)
    ap.add_argument("--skip-real", action="store_true", help="reuse the run dirs under --work-dir")
    ap.add_argument("--real-only", action="store_true", help="make the real runs and stop (simulate later)")
    ap.add_argument("--render-only", action="store_true", help="rewrite the .md and .png from the JSON in --out "
                    "(after editing benchmarks/sim_vs_real_notes.md)")
    ap.add_argument("--run-timeout", type=int, default=900)
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks")
    args = ap.parse_args()
    notes = ROOT / "benchmarks" / "sim_vs_real_notes.md"
    if args.render_only:
        result = json.loads((args.out / "sim_vs_real.json").read_text())
        result["notes"] = notes.read_text() if notes.exists() else ""
        for r in result["rows"]:
            r["real"].setdefault("load_average", _load_of(Path(r["run_dir"])))
        (args.out / "sim_vs_real.json").write_text(json.dumps(result, indent=1))
        (args.out / "sim_vs_real.md").write_text(markdown(result))
        plot(result, args.out / "sim_vs_real.png")
        return 0
    policies = [p for p in args.policies.split(",") if p]
    work = (args.work_dir or Path(tempfile.mkdtemp(prefix="sim_vs_real_"))).resolve()
    work.mkdir(parents=True, exist_ok=True)
    t_start = time.monotonic()
    dirs: dict[tuple[str, int], Path] = {}
    if args.skip_real:
        dirs = {(p, rep): work / f"{p}_r{rep}" for rep in range(args.repeats) for p in policies}
    elif args.process_per_run:
        if args.model_dir is None:
            ap.error("--process-per-run needs --model-dir (a warm-started HF directory)")
        for rep in range(args.repeats):
            for p in policies:
                dirs[(p, rep)] = run_real(p, rep, args, args.model_dir, work)
    else:
        runner = SessionRuns(args, work)
        try:
            for rep in range(args.repeats):  # interleaved: every policy of a repeat back to back
                for p in policies:
                    dirs[(p, rep)] = runner.run(p, rep)
        finally:
            runner.close()
    if args.real_only:
        print(f"real runs done in {time.monotonic() - t_start:.0f}s under {work}")
        return 0
    rows = []
    for rep in range(args.repeats):
        base = dirs.get(("sync", rep), dirs[(policies[0], rep)])
        for policy in policies:
            run_dir = dirs[(policy, rep)]
            real = measured(run_dir)
            row: dict = {"policy": policy, "repeat": rep, "run_dir": str(run_dir), "real": real}
            for key, src, probe, _ in KINDS:
                fig, cal = predicted(run_dir, run_dir if src == "self" else base, policy,
                                     work / f"sim_{policy}_r{rep}", probe=probe, match_level=src != "self")
                row[key], row[f"err_{key}"] = fig, compare(real, fig)
                if key == "self":
                    row["calibration_self"] = cal
                if probe:
                    row["probe_scale"] = cal["fit"].get("probe_scale")
            if run_dir != base:
                row["error_with_own"] = attribution(run_dir, base, policy, real, work / f"sim_{policy}_r{rep}")
            rows.append(row)
            print(f"{policy} r{rep}: real {1e3 * real['s_per_sample']:.1f} ms/sample bubble {real['worker_bubble']:.3f} | "
                  + " | ".join(f"{k} {1e3 * row[k]['s_per_sample']:.1f} ({row[f'err_{k}']['time_rel_err']:+.1%}) "
                               f"bubble {row[k]['worker_bubble']:.3f}" for k, *_ in KINDS), flush=True)
    result = {
        "setup": {"config": args.config, "command": "python benchmarks/sim_vs_real.py " + shlex.join(sys.argv[1:]),
                  "policies": policies, "prompts": args.prompts, "epochs": args.epochs, "n": args.n,
                  "workers": args.workers, "max_difficulty": args.max_difficulty,
                  "max_response_length": args.max_response_length, "warmup_steps": args.warmup_steps,
                  "repeats": args.repeats, "real_overrides": real_overrides(args),
                  "machine": f"{platform.machine()}, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at the end "
                             "(shared with other jobs)", "wall_s": round(time.monotonic() - t_start, 1),
                  "targets": {"time_rel_err": TIME_TARGET, "bubble_abs_err": BUBBLE_TARGET}},
        "per_policy": per_policy(rows),
        "rows": rows,
    }
    result["notes"] = notes.read_text() if notes.exists() else ""
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "sim_vs_real.json").write_text(json.dumps(result, indent=1))
    (args.out / "sim_vs_real.md").write_text(markdown(result))
    plot(result, args.out / "sim_vs_real.png")
    print(f"wrote {args.out / 'sim_vs_real.json'}, .md and .png")
    for r in result["per_policy"]:
        print(f"{r['policy']}: " + ", ".join(f"{k} time {r[f'err_{k}']['time_rel_err_median']:+.1%} bubble "
                                            f"{r[f'err_{k}']['bubble_abs_err_median']:+.3f}" for k, *_ in KINDS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
