"""HistoSpec on real RL runs (CPU): several epochs with policy updates, no speculation vs vLLM's `ngram`
and `suffix` vs HistoSpec, same workload and seed, interleaved repeats.

    python benchmarks/histospec_rl.py                       # 12 driver runs (4 methods x 3 repeats) + one warm-up
    python benchmarks/histospec_rl.py --methods none,suffix,histospec,histospec_nogate   # the gate on and off
    python benchmarks/histospec_rl.py --repeats 1 --epochs 2 --model-dir /tmp/hsrl_warm   # a quick look
    python benchmarks/histospec_rl.py --from-runs /tmp/hsrl/work/runs.json   # outputs of an interrupted run
    python benchmarks/histospec_rl.py --preset longtail     # the long-tail preset under `tail`: long rounds too
    python benchmarks/histospec_rl.py --preset tools --methods none,suffix,histospec   # the tools run

Presets (`--preset`): `arithmetic` (configs/tiny_cpu.yaml, twotier, short responses; every round is short)
and `longtail` (configs/longtail_cpu.yaml, the binary column task with responses up to 481 tokens, under
RollPacker's `tail` policy, whose long rounds run the prompts aborted from short rounds at full length with
few sequences per engine: the rounds where a verified draft token is nearly free). twotier has no long rounds
(it carries the slow half of a window into the next round instead), so the long-round figures need `tail`.
`tools` (configs/tools_cpu.yaml, the tools run: multi-turn trajectories with calculator calls, twotier; HistoSpec
drafts each assistant turn from the same turn of the prompt's previous trajectories).
Outputs are `<stem>.{json,md,png}`: `histospec_rl` for arithmetic, `histospec_rl_longtail` for longtail,
`histospec_rl_tools` for tools.

What it does: starts one Ray head for all runs (a loaded machine can miss Ray's start-up window when
every run starts its own), one supervised warm-up with the driver's own `warm_start`, exported to a HF
directory; then, for each repeat and each method in a rotated
order, a real `python -m megatron_sortedrl train configs/tiny_cpu.yaml` run from those weights (twotier
scheduler, GRPO updates after every round, weight sync to the engine, so the policy moves between epochs)
over `--epochs` passes of `--prompts` prompts. The method is the only difference between runs:
`speculative.enabled=false` (none), `speculative.method=ngram` (k=5, as in histospec_benchmark),
`suffix` (vLLM's suffix decoding, arctic-inference's tree; k=16) and `histospec` (k=16, all draft
sources, sibling drafts shipped during the round). The upper bound with frozen weights is
`benchmarks/histospec_benchmark.py` (docs/benchmarks/histospec_benchmark.json).

Figures, from each run's metrics.jsonl (`spec/step/*`: vLLM's own counters per step, the same for every
method; `spec/round_long` gives the round kind; the epoch of a step is the epoch most of its trained
samples belong to): tokens per target forward (generated tokens / (tokens - accepted draft tokens)),
acceptance rate, mean accepted length, HistoSpec's drafter time per engine step, and the rollout wall
clock (`time/rollout_s`) per generated token, whose ratio to no speculation's in the same repeat is
`rollout_speedup_vs_none` (per token, because runs that sample differently generate different lengths).
Each figure is given overall, per round kind (short/long) and per epoch, as the median over repeats with
min and max. Writes docs/benchmarks/histospec_rl.{json,md,png} (or under --out).

Left out: GPUs (where a verified draft token is nearly free and the long rounds gain most), several
engines, and accuracy comparisons (speculation is lossless; the JSON lists rewards only as a sanity check).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.ray_head import stop_ray_head  # noqa: E402

BASE_CONFIG = "configs/tiny_cpu.yaml"
PRESETS = {  # name -> workload defaults (flags given on the command line win)
    "arithmetic": {"config": BASE_CONFIG, "task": "arithmetic", "policy": "twotier", "stem": "histospec_rl",
                   "prompts": 32, "epochs": 4, "max_difficulty": 4, "max_response_length": 192, "warmup_steps": 200},
    "longtail": {"config": "configs/longtail_cpu.yaml", "task": "column_addition", "policy": "tail",
                 "stem": "histospec_rl_longtail", "prompts": 48, "epochs": 3, "max_difficulty": 48,
                 "max_response_length": 512, "warmup_steps": 400},
    # The tools run (multi-turn trajectories: call, calculator message, answer; HistoSpec drafts each assistant
    # turn from the same turn of the prompt's earlier trajectories, speculative/history.py).
    "tools": {"config": "configs/tools_cpu.yaml", "task": "tool_multiplication", "policy": "twotier",
              "stem": "histospec_rl_tools", "prompts": 64, "epochs": 4, "max_difficulty": 2,
              "max_response_length": 160, "warmup_steps": 1600},
}
METHODS = {  # name -> overrides
    "none": ["speculative.enabled=false"],
    "ngram": ["speculative.enabled=true", "speculative.method=ngram", "speculative.max_draft_tokens=5"],
    "suffix": ["speculative.enabled=true", "speculative.method=suffix", "speculative.max_draft_tokens=16"],
    # Drafts as long as the history is confident (up to 16; the default): the tree's path frequency
    # (min_confidence) alone ends a draft, as in `suffix`. The first measurement ran this as
    # min_draft_tokens=16 (the adaptive rule pinned at the cap), which is the same drafting.
    "histospec": ["speculative.enabled=true", "speculative.method=histospec", "speculative.max_draft_tokens=16",
                  "speculative.adaptive_draft_length=false"],
    # The same drafting with the step cost gate off: drafts proposed in every step, full batches included
    # (`histospec` runs with the gate on, the default, which decodes a step plainly where drafting measured slower).
    "histospec_nogate": ["speculative.enabled=true", "speculative.method=histospec", "speculative.max_draft_tokens=16",
                         "speculative.adaptive_draft_length=false", "speculative.cost_gate=false"],
    # HistoSpec engines from epoch 0 on (no round switch, speculative/fast_path.py): epoch 0 drafts from siblings,
    # own text and other requests on the speculative path; `histospec` runs epoch 0 on plain engines.
    "histospec_epoch0": ["speculative.enabled=true", "speculative.method=histospec", "speculative.max_draft_tokens=16",
                         "speculative.adaptive_draft_length=false", "speculative.min_history_share=0"],
    # The adaptive length rule (start at 2, x2 after a full accept, /2 after a miss) on top of the confidence.
    "histospec_adaptive": ["speculative.enabled=true", "speculative.method=histospec",
                           "speculative.max_draft_tokens=16", "speculative.adaptive_draft_length=true",
                           "speculative.min_draft_tokens=2"],
}
DEFAULT_METHODS = ("none", "ngram", "suffix", "histospec")
KINDS = ("all", "short", "long")
DEFINITIONS = {
    "tokens_per_forward": "generated tokens / target forwards, target forwards = tokens - accepted draft tokens "
                          "(vLLM's counters; 1.0 without speculation)",
    "acceptance_rate": "accepted / verified draft tokens", "mean_accepted_length": "accepted tokens / verified drafts",
    "drafter_ms_per_engine_step": "HistoSpec proposer time / engine steps (vLLM's iteration count)",
    "rollout_ms_per_token": "sum of time/rollout_s / generated tokens",
    "rollout_speedup_vs_none": "none's rollout_ms_per_token / this method's, same repeat, then median",
    "epoch": "the data epoch most of a step's trained samples belong to",
}


def workload_overrides(args) -> list[str]:
    return [f"seed={args.seed}", f"data.task={args.task}", f"scheduler.policy={args.policy}",
            f"data.num_train_prompts={args.prompts}",
            f"data.num_eval_prompts={args.eval_prompts}", f"data.max_difficulty={args.max_difficulty}",
            f"rollout.max_response_length={args.max_response_length}",
            f"rollout.n_samples_per_prompt={args.n}", "logging.tensorboard=false",
            *([f"cluster.ray_address={args.ray_address}"] if args.ray_address else [])]


def ray_env() -> dict:
    """The environment of the head and of every run: Ray's token authentication off (`ray start` turns it on
    when a token file exists on the machine, and the runs' `ray.init` (auth disabled) are then refused), and
    the workers' niceness."""
    # Workers at niceness 0, as the CPU presets' own local Ray would start them (`cluster.worker_niceness`);
    # the runs attach to this head, so the preset's setting does not reach them.
    return {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_worker_niceness": "0"}


def start_ray_head(work: Path, tries: int = 10) -> tuple[subprocess.Popen, str]:
    """One Ray head for the whole benchmark (runs attach with cluster.ray_address), so that a loaded machine
    pays Ray's start-up once; on a busy machine a fresh `ray.init` per run can miss Ray's 30 s start window."""
    import socket

    def free_port() -> int:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            return sock.getsockname()[1]

    for attempt in range(tries):
        port = free_port()
        # Every agent port too: the fixed defaults (e.g. 52365) collide with other Ray clusters on the machine.
        ports = [f"--{name}={free_port()}" for name in ("dashboard-agent-listen-port", "dashboard-agent-grpc-port",
                                                        "metrics-export-port", "runtime-env-agent-port",
                                                        "node-manager-port", "object-manager-port")]
        log = open(work / f"ray_head_{attempt}.log", "w")
        proc = subprocess.Popen([str(Path(sys.executable).parent / "ray"), "start", "--head", f"--port={port}", "--node-ip-address=127.0.0.1",
                                 "--num-cpus=8", "--include-dashboard=false", "--disable-usage-stats", "--block", *ports],
                                stdout=log, stderr=subprocess.STDOUT, env=ray_env())
        address = f"127.0.0.1:{port}"
        for _ in range(300):  # `ray start` prints this line once the node registered; it exits if it did not
            time.sleep(2)
            if "Ray runtime started" in (work / f"ray_head_{attempt}.log").read_text(errors="replace"):
                return proc, address
            if proc.poll() is not None:
                break
        proc.terminate()
        proc.wait(60)
    raise RuntimeError(f"no Ray head came up in {tries} tries; see {work}/ray_head_*.log")


def warm_start(args, model_dir: Path, work: Path) -> dict:
    """The driver's own supervised warm-up, once, exported as a HF directory at `model_dir`."""
    from megatron_sortedrl.config import load_config
    from megatron_sortedrl.driver import Driver

    cfg = load_config(ROOT / args.config, workload_overrides(args) + [
        f"model.path={work / 'base_model'}", "model.build_tiny_if_missing=true", f"logging.run_dir={work / 'warmup'}",
        f"trainer.warmup_sft_steps={args.warmup_steps}", "checkpoint.resume=never", "speculative.enabled=false"])
    t0 = time.monotonic()
    driver = Driver(cfg, printer=lambda line: print(f"  [warm-up] {line}", flush=True))
    try:
        if args.warm_ckpt:  # another benchmark's warm start (policy_comparison's --warm-ckpt): same weights
            driver.trainer.load_checkpoint(args.warm_ckpt)
            out = json.loads((args.warm_ckpt.parent / "warm_start.json").read_text())
            out["loss"] = out.get("final_loss")
        else:
            out = driver.warm_start()
        driver.trainer.export_hf_weights(model_dir)
    finally:
        driver.close()
    info = {"steps": out.get("steps", args.warmup_steps), "final_loss": out.get("loss"),
            "seconds": out.get("seconds", round(time.monotonic() - t0, 1)),
            **({"from_checkpoint": str(args.warm_ckpt)} if args.warm_ckpt else {})}
    (model_dir / "warm_start.json").write_text(json.dumps(info, indent=1))
    return info


def run_one(method: str, repeat: int, args, model_dir: Path, work: Path) -> dict:
    run_dir = work / f"{method}_r{repeat}"
    cmd = [sys.executable, "-m", "megatron_sortedrl", "train", args.config, *workload_overrides(args),
           f"model.path={model_dir}", "model.build_tiny_if_missing=false", "trainer.warmup_sft_steps=0",
           f"data.num_epochs={args.epochs}", f"trainer.total_steps={args.prompts * args.epochs}",
           "trainer.eval_interval=0", "checkpoint.save_interval=0", "checkpoint.resume=never",
           f"logging.run_dir={run_dir}", *METHODS[method]]
    log = work / f"{run_dir.name}.log"
    t0 = time.monotonic()
    env = {**ray_env(), "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    with open(log, "w") as fh:
        rc = subprocess.run(cmd, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT, env=env,
                            timeout=args.run_timeout).returncode
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    if rc != 0 or not summary.get("data_exhausted"):
        tail = "".join(log.read_text(errors="replace").splitlines(keepends=True)[-15:])
        raise RuntimeError(f"{method} (repeat {repeat}) ended with rc={rc}\ncommand: cd {ROOT} && {shlex.join(cmd)}\n"
                           f"log {log}:\n{tail}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [step_figures(r) for r in rows if "time/step_s" in r]
    return {"method": method, "repeat": repeat, "process_s": time.monotonic() - t0, "steps": steps,
            "summary": summary, "run_dir": str(run_dir)}


def step_figures(r: dict) -> dict:
    epochs = [int(sid.rsplit("/e", 1)[1].split("/")[0]) for sid in r.get("reward/per_sample", {}) if "/e" in sid]
    return {"step": r["step"], "epoch": statistics.mode(epochs) if epochs else -1,
            "kind": "long" if r.get("spec/round_long") else "short", "rollout_s": r.get("time/rollout_s", 0.0),
            "tokens": r.get("spec/step/tokens", 0.0), "forwards": r.get("spec/step/target_forwards", 0.0),
            "accepted": r.get("spec/step/accepted_tokens", 0.0), "verified": r.get("spec/step/draft_tokens", 0.0),
            "drafts": r.get("spec/step/drafts", 0.0), "engine_steps": r.get("spec/step/engine_steps", 0.0),
            "drafter_s": r.get("spec/step/drafter_s", 0.0), "reward": r.get("reward/mean", 0.0)}


def aggregate(steps: list[dict]) -> dict:
    tok = sum(s["tokens"] for s in steps)
    fwd = sum(s["forwards"] for s in steps)
    ver = sum(s["verified"] for s in steps)
    drafts = sum(s["drafts"] for s in steps)
    esteps = sum(s["engine_steps"] for s in steps)
    roll = sum(s["rollout_s"] for s in steps)
    return {"steps": len(steps), "tokens": tok, "target_forwards": fwd,
            "tokens_per_forward": tok / fwd if fwd else None,
            "acceptance_rate": sum(s["accepted"] for s in steps) / ver if ver else None,
            "mean_accepted_length": sum(s["accepted"] for s in steps) / drafts if drafts else None,
            "drafter_ms_per_engine_step": 1e3 * sum(s["drafter_s"] for s in steps) / esteps if esteps else None,
            "rollout_s": roll, "rollout_ms_per_token": 1e3 * roll / tok if tok else None}


def per_run(run: dict) -> dict:
    steps = run["steps"]
    out = {k: aggregate([s for s in steps if k == "all" or s["kind"] == k]) for k in KINDS}
    out["epochs"] = {str(e): aggregate([s for s in steps if s["epoch"] == e])
                     for e in sorted({s["epoch"] for s in steps})}
    return out


def _stat(values: list) -> dict | None:
    vals = [v for v in values if v is not None]
    if not vals:
        return None
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals)}


def method_row(method: str, runs: list[dict], baseline: dict[int, dict]) -> dict:
    figs = [per_run(r) for r in runs]
    row: dict = {"method": method, "repeats": len(runs)}
    for kind in KINDS:
        part = {key: _stat([f[kind][key] for f in figs]) for key in
                ("tokens_per_forward", "acceptance_rate", "mean_accepted_length", "drafter_ms_per_engine_step",
                 "rollout_s", "rollout_ms_per_token", "steps")}
        speed = []
        for r, f in zip(runs, figs):
            base = baseline.get(r["repeat"])
            if base and f[kind]["rollout_ms_per_token"] and base[kind]["rollout_ms_per_token"]:
                speed.append(base[kind]["rollout_ms_per_token"] / f[kind]["rollout_ms_per_token"])
        part["rollout_speedup_vs_none"] = _stat(speed)
        row[kind] = part
    epochs = sorted({e for f in figs for e in f["epochs"]}, key=int)
    row["per_epoch"] = {e: {key: _stat([f["epochs"][e][key] for f in figs if e in f["epochs"]])
                            for key in ("tokens_per_forward", "acceptance_rate", "mean_accepted_length",
                                        "rollout_ms_per_token")} for e in epochs}
    row["tokens_per_forward"] = row["all"]["tokens_per_forward"]["median"] if row["all"]["tokens_per_forward"] else None
    sp = row["all"]["rollout_speedup_vs_none"]
    row["rollout_speedup_vs_none"] = sp["median"] if sp else None
    row["mean_reward_per_repeat"] = [statistics.fmean([s["reward"] for s in r["steps"]]) for r in runs]
    row["process_s_per_repeat"] = [round(r["process_s"], 1) for r in runs]
    return row


def _fmt(x: dict | None, f: str = "{:.2f}") -> str:
    if not x:
        return "-"
    return f"{f.format(x['median'])} [{f.format(x['min'])}, {f.format(x['max'])}]"


def write_markdown(result: dict, path: Path) -> None:
    s = result["setup"]
    lines = ["# HistoSpec on real RL runs (CPU)", "",
             f"Generated by `{s['command']}` ({s['machine']}, {s['date']}; {s['load_note']}). Figures in "
             f"[{s['stem']}.json]({s['stem']}.json), plot in [{s['stem']}.png]({s['stem']}.png). The frozen-weights "
             "upper bound is [histospec_benchmark.json](histospec_benchmark.json).", "",
             f"Workload: {s['task']} ({s['config']}, difficulty up to {s['max_difficulty']}), {s['prompts']} prompts x "
             f"{s['epochs']} epochs, n={s['n']}, max response {s['max_response_length']}, {s['policy']} scheduler, GRPO update and weight sync every round, from one "
             f"{s['warmup_steps']}-step supervised warm start; seed {s['seed']}; methods interleaved over "
             f"{s['repeats']} repeat(s); median [min, max] over repeats.", ""]
    for kind in KINDS:
        lines += [f"## {'All rounds' if kind == 'all' else kind.capitalize() + ' rounds'}", "",
                  "| method | tokens / target forward | acceptance | accepted length | drafter ms / engine step "
                  "| rollout ms / token | rollout speed-up vs none |", "|---|---|---|---|---|---|---|"]
        for r in result["rows"]:
            p = r[kind]
            lines.append(f"| {r['method']} | {_fmt(p['tokens_per_forward'])} | {_fmt(p['acceptance_rate'])} | "
                         f"{_fmt(p['mean_accepted_length'])} | {_fmt(p['drafter_ms_per_engine_step'], '{:.3f}')} | "
                         f"{_fmt(p['rollout_ms_per_token'], '{:.3f}')} | {_fmt(p['rollout_speedup_vs_none'])} |")
        lines.append("")
    lines += ["## Per epoch (tokens / target forward, all rounds)", "",
              "| method | " + " | ".join(f"epoch {e}" for e in result["rows"][0]["per_epoch"]) + " |",
              "|---|" + "---|" * len(result["rows"][0]["per_epoch"])]
    for r in result["rows"]:
        lines.append(f"| {r['method']} | " + " | ".join(_fmt(v["tokens_per_forward"]) for v in r["per_epoch"].values()) + " |")
    lines += ["", result.get("notes", "")]
    path.write_text("\n".join(lines) + "\n")


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    ax = axes[0]
    width = 0.8 / len(KINDS)
    for j, kind in enumerate(KINDS):
        ys = [(r[kind]["tokens_per_forward"] or {}).get("median", 0) for r in rows]
        ax.bar([i + j * width for i in range(len(rows))], ys, width, label=kind)
    ax.set_xticks([i + width for i in range(len(rows))], [r["method"] for r in rows])
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_ylabel("tokens / target forward")
    ax.set_title("Tokens per target forward (median of repeats)", fontsize=10)
    ax.legend(fontsize=8)
    ax = axes[1]
    for r in rows:
        eps = list(r["per_epoch"])
        ax.plot([int(e) for e in eps], [(r["per_epoch"][e]["tokens_per_forward"] or {}).get("median", 0) for e in eps],
                marker="o", label=r["method"])
    ax.set_xlabel("epoch")
    ax.set_ylabel("tokens / target forward")
    ax.set_title("Per epoch (the policy moves between epochs)", fontsize=10)
    ax.legend(fontsize=8)
    ax = axes[2]
    for j, kind in enumerate(KINDS):
        meds = [(r[kind]["rollout_speedup_vs_none"] or {}) for r in rows]
        xs = [i + j * width for i in range(len(rows))]
        ax.bar(xs, [m.get("median", 0) for m in meds], width, label=kind)
        ax.errorbar(xs, [m.get("median", 0) for m in meds],
                    yerr=[[m.get("median", 0) - m.get("min", 0) for m in meds],
                          [m.get("max", 0) - m.get("median", 0) for m in meds]], fmt="none", color="black", lw=0.8)
    ax.set_xticks([i + width for i in range(len(rows))], [r["method"] for r in rows])
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_ylabel("rollout speed-up vs none (per token)")
    ax.set_title("Rollout wall clock per token vs no speculation", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="arithmetic", help="workload defaults (see above)")
    ap.add_argument("--config", default=None, help="base run config (default: the preset's)")
    ap.add_argument("--task", default=None, help="data.task (default: the preset's)")
    ap.add_argument("--policy", default=None, help="scheduler.policy (default: the preset's)")
    ap.add_argument("--stem", default=None, help="output file stem (default: the preset's)")
    ap.add_argument("--warm-ckpt", type=Path, default=None,
                    help="a trainer checkpoint with warm_start.json beside it (policy_comparison's) to export "
                         "instead of running the warm-up")
    ap.add_argument("--prompts", type=int, default=None, help="training prompts (data.num_train_prompts)")
    ap.add_argument("--eval-prompts", type=int, default=16, help="held-out prompts (evaluated before and after)")
    ap.add_argument("--epochs", type=int, default=None, help="data.num_epochs: passes over the prompts")
    ap.add_argument("--n", type=int, default=4, help="samples per prompt")
    ap.add_argument("--max-difficulty", type=int, default=None)
    ap.add_argument("--max-response-length", type=int, default=None)
    # 1000 steps memorise 32 prompts (reward 1.0 everywhere: zero GRPO advantages, a policy that never moves);
    # 200 leave a loss of about 0.15 and mixed rewards, so the updates move the policy between epochs.
    ap.add_argument("--warmup-steps", type=int, default=None, help="supervised warm-up steps, run once")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--methods", default=",".join(DEFAULT_METHODS),
                    help=f"comma-separated, of {', '.join(METHODS)}; rows of methods already in the work dir's "
                         "runs.json are reported too")
    ap.add_argument("--model-dir", type=Path, default=None, help="warm-started HF dir to reuse (written if missing)")
    ap.add_argument("--work-dir", type=Path, default=None)
    ap.add_argument("--run-timeout", type=int, default=900)
    ap.add_argument("--load-note", default="2 cores shared with other jobs; see the load average in the JSON")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks")
    ap.add_argument("--ray-address", default="", help="an existing Ray cluster for every run (default: start one)")
    ap.add_argument("--max-runs", type=int, default=0,
                    help="driver runs in this invocation (0: all); with --work-dir, the next invocation goes on")
    ap.add_argument("--from-runs", type=Path, default=None,
                    help="only write the outputs from a work dir's runs.json (e.g. of an interrupted benchmark)")
    args = ap.parse_args()
    for key, value in PRESETS[args.preset].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    methods = args.methods.split(",")
    if "none" not in methods or any(m not in METHODS for m in methods) or args.repeats < 1 or args.epochs < 2:
        print(f"error: --methods must include none and only {', '.join(METHODS)}; --repeats >= 1; --epochs >= 2",
              file=sys.stderr)
        return 2
    if args.from_runs:
        runs = json.loads(args.from_runs.read_text())
        warm_path = args.model_dir / "warm_start.json" if args.model_dir else None
        warm = json.loads(warm_path.read_text()) if warm_path and warm_path.is_file() else {}
        return write_outputs(args, methods, runs, warm)
    os.environ.update(ray_env())  # the warm-up's driver runs in this process
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so `finally` stops the Ray head on a kill too
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="histospec_rl_"))
    work.mkdir(parents=True, exist_ok=True)
    head = None
    if not args.ray_address:
        head, args.ray_address = start_ray_head(work)
        print(f"ray head at {args.ray_address}", flush=True)
    try:
        return _benchmark(args, methods, work)
    finally:
        if head is not None:  # only the head this script started, and its bootstrap file (ray_head.py)
            stop_ray_head(head, args.ray_address)


def _benchmark(args, methods: list[str], work: Path) -> int:
    model_dir = (args.model_dir or work / "warm_model").resolve()
    print(f"work dir {work}", flush=True)
    if (model_dir / "warm_start.json").is_file():
        warm = json.loads((model_dir / "warm_start.json").read_text())
    else:
        warm = warm_start(args, model_dir, work)
    print(f"warm start: {warm}", flush=True)
    # Resumable: runs already in the work dir's runs.json are kept and not run again, and --max-runs bounds
    # one invocation, so the benchmark can be split into parts that each hold a benchmark slot briefly.
    runs_path = work / "runs.json"
    runs: list[dict] = json.loads(runs_path.read_text()) if runs_path.is_file() else []
    done = {(r["method"], r["repeat"]) for r in runs}
    started = 0
    for repeat in range(args.repeats):
        order = methods[repeat % len(methods):] + methods[:repeat % len(methods)]  # rotate: no method always first
        for method in order:
            if (method, repeat) in done:
                continue
            if args.max_runs and started >= args.max_runs:
                print(f"stopping after {started} runs (--max-runs); run the same command again to go on", flush=True)
                return write_outputs(args, methods, runs, warm)
            started += 1
            load = os.getloadavg()[0]
            run = run_one(method, repeat, args, model_dir, work)
            run["load_at_start"] = round(load, 1)
            f = per_run(run)["all"]
            print(f"repeat {repeat} {method}: {len(run['steps'])} steps, tokens/forward "
                  f"{f['tokens_per_forward'] or 0:.2f}, rollout {f['rollout_s']:.1f}s "
                  f"({f['rollout_ms_per_token'] or 0:.3f} ms/token), process {run['process_s']:.0f}s", flush=True)
            runs.append(run)
            runs_path.write_text(json.dumps(runs))
    return write_outputs(args, methods, runs, warm)


def write_outputs(args, methods: list[str], runs: list[dict], warm: dict) -> int:
    done = {r["repeat"] for r in runs if r["method"] == "none"}
    runs = [r for r in runs if r["repeat"] in done]  # a repeat counts only with its baseline
    if not runs:
        return 0
    load = [r.get("load_at_start") for r in runs]
    methods = [m for m in METHODS if any(r["method"] == m for r in runs)]  # every method run in this work dir
    baseline = {r["repeat"]: per_run(r) for r in runs if r["method"] == "none"}
    rows = [method_row(m, [r for r in runs if r["method"] == m], baseline) for m in methods]
    result = {"setup": {"command": "python benchmarks/histospec_rl.py " + shlex.join(sys.argv[1:]),
                        "machine": f"{platform.machine()}, {os.cpu_count()} cores", "date": time.strftime("%Y-%m-%d"),
                        "load_average_at_run_starts": load, "load_note": args.load_note,
                        "preset": args.preset, "config": args.config, "task": args.task, "policy": args.policy,
                        "stem": args.stem, "prompts": args.prompts, "epochs": args.epochs, "n": args.n,
                        "max_response_length": args.max_response_length, "max_difficulty": args.max_difficulty,
                        "warmup_steps": args.warmup_steps, "warm_start": warm, "seed": args.seed,
                        "repeats": len(done), "methods": {m: METHODS[m] for m in methods},
                        "definitions": DEFINITIONS},
              "rows": rows, "runs": [{k: v for k, v in r.items() if k != "summary"} for r in runs]}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.stem}.json").write_text(json.dumps(result, indent=1))
    write_markdown(result, args.out / f"{args.stem}.md")
    plot(result, args.out / f"{args.stem}.png")
    for r in rows:
        print(f"{r['method']:>10}: tokens/forward {r['tokens_per_forward']}, rollout speed-up vs none "
              f"{r['rollout_speedup_vs_none']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
