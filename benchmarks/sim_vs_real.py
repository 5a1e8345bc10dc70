"""Does the calibrated simulator predict real runs? Each policy runs for real (short CPU runs, same warm start,
same prompts and sample budget) and in the simulator calibrated from a real run; per policy the measured
and predicted time per trained sample and worker bubble ratio, and their errors.

    .venv/bin/python benchmarks/sim_vs_real.py                          # warm-up + 4 real runs, ~15 min on 2 busy cores
    .venv/bin/python benchmarks/sim_vs_real.py --model-dir /tmp/svr_warm --work-dir /tmp/svr   # reuse both
    .venv/bin/python benchmarks/sim_vs_real.py --work-dir /tmp/svr --skip-real                # re-simulate only

A finished run already in the work dir (its summary.json says the data was used up) is reused, so an
interrupted benchmark resumes where it stopped.

What it does: one supervised warm-up (`benchmarks/policy_comparison.warm_start`), exported as a HF directory;
then per repeat and policy (interleaved) one `python -m megatron_sortedrl train` run with HistoSpec off (the
simulator does not model speculation), mid-run evals and checkpoints off, `data.num_epochs` passes over the
same prompts. Each run is then simulated twice with the run's own config and its own response lengths
replayed (`simulate --calibrate-from`):
- "predicted": costs calibrated on the `sync` run of the same repeat (for `sync` itself this is a fit);
- "self": costs calibrated on the run itself (separates cost-model error from scheduling-model error).

Measured figures come from the run's timeline with the functions the simulator's report uses: time per
trained sample = (end of the last rollout/train/sync/history phase - start of the first rollout) / samples
trained; worker bubble = `worker_bubble_ratio` pooled over all rollout phases. The per-phase seconds
(rollout, train, everything else) of both are in the JSON and the .md, which is where a wrong modelled
cost shows. Writes docs/benchmarks/sim_vs_real.{json,md,png} (or under --out).

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
WORK_PHASES = ("rollout", "train", "sync", "history", "logprob", "reward")


def _policy_comparison():
    spec = importlib.util.spec_from_file_location("policy_comparison", ROOT / "benchmarks" / "policy_comparison.py")
    mod = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod


def real_overrides(args) -> list[str]:
    return [f"seed={args.seed}", "data.task=arithmetic", f"data.num_train_prompts={args.prompts}",
            f"data.num_eval_prompts={args.eval_prompts}", f"data.max_difficulty={args.max_difficulty}",
            f"rollout.max_response_length={args.max_response_length}", f"rollout.n_samples_per_prompt={args.n}",
            f"rollout.num_workers={args.workers}", "logging.tensorboard=false", "speculative.enabled=false",
            f"data.num_epochs={args.epochs}", f"trainer.total_steps={args.prompts * args.epochs}",
            "trainer.eval_interval=0", "checkpoint.save_interval=0", "checkpoint.resume=never",
            "trainer.warmup_sft_steps=0", "model.build_tiny_if_missing=false"] + list(args.set or [])


def run_real(policy: str, repeat: int, args, model_dir: Path, work: Path) -> Path:
    run_dir = work / f"{policy}_r{repeat}"
    cmd = [sys.executable, "-m", "megatron_sortedrl", "train", args.config, *real_overrides(args),
           f"model.path={model_dir}", f"logging.run_dir={run_dir}", f"scheduler.policy={policy}"]
    log = work / f"{run_dir.name}.log"
    summary = run_dir / "summary.json"
    if summary.exists() and json.loads(summary.read_text()).get("data_exhausted"):
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

    events = read_run_timeline(run_dir)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    samples = sum(r.get("rollout/samples", 0) for r in rows if "time/step_s" in r)
    spans = [(p, a, b) for _, p, a, b in phase_intervals(events) if p in WORK_PHASES]
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
            "worker_bubble": worker_bubble_ratio(events), "rollout_s": phase["rollout"], "train_s": phase["train"],
            "other_s": total - phase["rollout"] - phase["train"],
            "steps": sum(1 for r in rows if "time/step_s" in r)}


def predicted(run_dir: Path, costs_from: Path, policy: str, out: Path) -> tuple[dict, dict]:
    """Simulated figures of `run_dir` (its config and lengths) with costs calibrated on `costs_from`."""
    from scheduler.calibrate import calibrated_scenario
    from scheduler.report import summarize
    from scheduler.sim_config import load_sim_config
    from scheduler.simulator import simulate

    base, _ = load_sim_config(ROOT / "configs" / "sim_tiny_cpu.yaml")
    sim, run, cal = calibrated_scenario(base, run_dir, out, costs_from=costs_from)
    row = summarize(simulate(sim, run, policy))
    other = row["total_s"] - row["rollout_s"] - row["train_s"]
    fig = {"samples": row["samples"], "total_s": row["total_s"], "s_per_sample": row["total_s"] / row["samples"],
           "worker_bubble": row["worker_bubble"], "rollout_s": row["rollout_s"], "train_s": row["train_s"],
           "other_s": other, "steps": row["rounds"]}
    return fig, {"engine": cal.engine, "cluster": cal.cluster, "fit": cal.fit}


def compare(real: dict, sim: dict) -> dict:
    return {"time_rel_err": sim["s_per_sample"] / real["s_per_sample"] - 1,
            "bubble_abs_err": sim["worker_bubble"] - real["worker_bubble"]}


def markdown(result: dict) -> str:
    lines = [f"# Simulator vs real runs ({result['setup']['config']}, CPU)", "",
             f"Command: `{result['setup']['command']}`  ", f"Machine: {result['setup']['machine']}", "",
             "Time per trained sample (ms) and pooled worker bubble ratio; `predicted`: simulator calibrated on "
             "the sync run of the same repeat, each run's own response lengths replayed; `self`: calibrated on "
             f"the run itself. Targets: time within {TIME_TARGET:.0%}, bubble within {BUBBLE_TARGET}.", "",
             "| policy | repeat | real ms/sample | predicted | err | self | err | real bubble | predicted | err | self | err | ok |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        p, s, m = r["predicted"], r["self"], r["real"]
        ok = abs(r["err_predicted"]["time_rel_err"]) <= TIME_TARGET and abs(r["err_predicted"]["bubble_abs_err"]) <= BUBBLE_TARGET
        lines.append(f"| {r['policy']} | {r['repeat']} | {1e3 * m['s_per_sample']:.1f} | {1e3 * p['s_per_sample']:.1f} | "
                     f"{r['err_predicted']['time_rel_err']:+.1%} | {1e3 * s['s_per_sample']:.1f} | "
                     f"{r['err_self']['time_rel_err']:+.1%} | {m['worker_bubble']:.3f} | {p['worker_bubble']:.3f} | "
                     f"{r['err_predicted']['bubble_abs_err']:+.3f} | {s['worker_bubble']:.3f} | "
                     f"{r['err_self']['bubble_abs_err']:+.3f} | {'yes' if ok else 'no'} |")
    lines += ["", "Where the time goes (seconds over the whole run: real / predicted / self):", "",
              "| policy | repeat | steps | rollout | train | other (sync, history, driver gaps) |", "|---|---|---|---|---|---|"]
    for r in result["rows"]:
        m, p, s = r["real"], r["predicted"], r["self"]
        cells = [f"{m[k]:.1f} / {p[k]:.1f} / {s[k]:.1f}" for k in ("rollout_s", "train_s", "other_s")]
        lines.append(f"| {r['policy']} | {r['repeat']} | {m['steps']} / {p['steps']} / {s['steps']} | " + " | ".join(cells) + " |")
    lines += ["", "Calibrated costs (per run, `self`):", "",
              "| policy | repeat | step overhead ms | ms per running seq | us per context token | prefill tok/s | "
              "decode fit rms | train fixed s | train tok/s | sync+other s | reward latency ms |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        e, c, f = r["calibration_self"]["engine"], r["calibration_self"]["cluster"], r["calibration_self"]["fit"]
        lines.append(f"| {r['policy']} | {r['repeat']} | {1e3 * e['step_overhead_s']:.3f} | {1e3 * e['per_seq_s']:.4f} | "
                     f"{1e6 * e['kv_s_per_token']:.4f} | {e['prefill_tokens_per_s']:.0f} | {f['decode_rel_rms']:.1%} | "
                     f"{c['train_fixed_s']:.3f} | {c['train_tokens_per_s']:.0f} | {c['weight_sync_s']:.3f} | "
                     f"{1e3 * c['reward_latency_s']:.1f} |")
    lines += ["", result.get("notes", "")]
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    labels = [f"{r['policy']}\nr{r['repeat']}" for r in rows]
    x = range(len(rows))
    fig, ax = plt.subplots(1, 2, figsize=(12, 4.5))
    for k, (key, scale, title) in enumerate([("s_per_sample", 1e3, "ms per trained sample"),
                                            ("worker_bubble", 1.0, "worker bubble ratio")]):
        for off, name, color in ((-0.27, "real", "#636363"), (0.0, "predicted", "#e6550d"), (0.27, "self", "#3182bd")):
            ax[k].bar([i + off for i in x], [scale * r[name][key] for r in rows], 0.27, label=name, color=color)
        ax[k].set_xticks(list(x), labels, fontsize=8)
        ax[k].set_title(title)
        ax[k].legend(fontsize=8)
    fig.suptitle("Calibrated simulator vs real CPU runs (predicted: costs from the sync run; self: from the run itself)",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/tiny_cpu.yaml", help="base run config (e.g. configs/longtail_cpu.yaml)")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--eval-prompts", type=int, default=16)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--workers", type=int, default=2, help="rollout engines (the worker bubble needs more than one)")
    ap.add_argument("--max-difficulty", type=int, default=6)
    ap.add_argument("--max-response-length", type=int, default=256)
    ap.add_argument("--warmup-steps", type=int, default=400)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--set", action="append", help="extra key=value for every real run (repeatable)")
    ap.add_argument("--model-dir", type=Path, default=None, help="warm-started HF dir (made here if missing)")
    ap.add_argument("--work-dir", type=Path, default=None)
    ap.add_argument("--skip-real", action="store_true", help="reuse the run dirs under --work-dir")
    ap.add_argument("--run-timeout", type=int, default=900)
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks")
    args = ap.parse_args()
    policies = [p for p in args.policies.split(",") if p]
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="sim_vs_real_"))
    work.mkdir(parents=True, exist_ok=True)
    model_dir = args.model_dir or work / "warm_model"
    t_start = time.monotonic()
    if not args.skip_real and not (model_dir / "config.json").exists():
        pc = _policy_comparison()
        ns = argparse.Namespace(seed=args.seed, prompts=args.prompts, eval_prompts=args.eval_prompts,
                                max_difficulty=args.max_difficulty, max_response_length=args.max_response_length,
                                n=args.n, warmup_steps=args.warmup_steps)
        print(f"[warm-up] {args.warmup_steps} supervised steps -> {model_dir}", flush=True)
        pc.warm_start(ns, model_dir, work)
    rows = []
    for rep in range(args.repeats):
        dirs = {}
        for policy in policies:
            dirs[policy] = work / f"{policy}_r{rep}" if args.skip_real else run_real(policy, rep, args, model_dir, work)
        base = dirs.get("sync", dirs[policies[0]])
        for policy in policies:
            real = measured(dirs[policy])
            pred, _ = predicted(dirs[policy], base, policy, work / f"sim_{policy}_r{rep}")
            own, cal = predicted(dirs[policy], dirs[policy], policy, work / f"sim_{policy}_r{rep}")
            rows.append({"policy": policy, "repeat": rep, "run_dir": str(dirs[policy]), "real": real,
                         "predicted": pred, "self": own, "err_predicted": compare(real, pred),
                         "err_self": compare(real, own), "calibration_self": cal})
            print(f"{policy} r{rep}: real {1e3 * real['s_per_sample']:.1f} ms/sample bubble {real['worker_bubble']:.3f} | "
                  f"predicted {1e3 * pred['s_per_sample']:.1f} ({rows[-1]['err_predicted']['time_rel_err']:+.1%}) "
                  f"bubble {pred['worker_bubble']:.3f} | self {1e3 * own['s_per_sample']:.1f} "
                  f"({rows[-1]['err_self']['time_rel_err']:+.1%}) bubble {own['worker_bubble']:.3f}", flush=True)
    result = {
        "setup": {"config": args.config, "command": "python benchmarks/sim_vs_real.py " + shlex.join(sys.argv[1:]),
                  "policies": policies, "prompts": args.prompts, "epochs": args.epochs, "n": args.n,
                  "workers": args.workers, "max_difficulty": args.max_difficulty,
                  "max_response_length": args.max_response_length, "warmup_steps": args.warmup_steps,
                  "repeats": args.repeats, "real_overrides": real_overrides(args),
                  "machine": f"{platform.machine()}, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at the end "
                             "(shared with other jobs)", "wall_s": round(time.monotonic() - t_start, 1),
                  "targets": {"time_rel_err": TIME_TARGET, "bubble_abs_err": BUBBLE_TARGET}},
        "rows": rows,
    }
    notes = ROOT / "benchmarks" / "sim_vs_real_notes.md"
    result["notes"] = notes.read_text() if notes.exists() else ""
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "sim_vs_real.json").write_text(json.dumps(result, indent=1))
    (args.out / "sim_vs_real.md").write_text(markdown(result))
    plot(result, args.out / "sim_vs_real.png")
    print(f"wrote {args.out / 'sim_vs_real.json'}, .md and .png")
    worst_t = max(abs(r["err_predicted"]["time_rel_err"]) for r in rows)
    worst_b = max(abs(r["err_predicted"]["bubble_abs_err"]) for r in rows)
    print(f"worst predicted error: time {worst_t:.1%} (target {TIME_TARGET:.0%}), bubble {worst_b:.3f} (target {BUBBLE_TARGET})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
