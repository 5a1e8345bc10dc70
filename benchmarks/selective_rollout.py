"""Selective rollout on real RL runs (CPU): dynamic sampling alone vs dynamic sampling with reward-history skip,
from identical warm-started weights, at the same number of updates of the same size.

    .venv/bin/python benchmarks/selective_rollout.py                      # ~40 minutes on 2 cores at load 50
    .venv/bin/python benchmarks/selective_rollout.py --work-dir W --model-dir M --warm-only      # resumable parts:
    .venv/bin/python benchmarks/selective_rollout.py --work-dir W --model-dir M --repeats 1     # finished runs in W
    .venv/bin/python benchmarks/selective_rollout.py --work-dir W --model-dir M --repeats 3     # are reused
    .venv/bin/python benchmarks/selective_rollout.py --model-dir /tmp/sr_warm --repeats 1 --steps 6   # quick look

What it does: one supervised warm-up (the driver's own `warm_start`), exported as a Hugging Face directory;
then a probe with the same engines: n sampled responses (temperature 1) to every training prompt, scored, to
check that the warm-started model solves some prompts always, some never and some sometimes (what the filter
and the skip act on; the shares are written to the JSON). Every variant is then one subprocess
`python -m megatron_sortedrl train configs/tiny_cpu.yaml ...` from that directory with
`trainer.warmup_sft_steps=0`, the same seed, prompts and `--steps` updates, each update needing
`rollout_batch_size` informative groups (`sampling.dynamic=true`); `data.num_epochs=0`, so a variant that skips
prompts simply reaches later epochs. Variants are interleaved over `--repeats`.

Figures per variant (from metrics.jsonl; median, min and max over repeats): generated response tokens per
trained token (`sampling/generated_tokens` over `sampling/trained_tokens`: trained, filtered and aborted
tokens over trained ones), milliseconds of step time (`time/step_s`: rollout, reward, training, weight sync)
per trained sample, the speed-up against dynamic sampling alone (ratio of medians), the share of generated
groups that were informative, prompts skipped, and the final greedy `eval/accuracy`. Writes
docs/benchmarks/selective_rollout.{json,md,png} (or under --out).

Left out: GPUs and large models (the simulator's `benchmarks/selective_rollout_sim.py` covers the 32B scale),
and a statistical test on accuracy (one seed; the spread over repeats is shown instead).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import socket
import shlex
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
VARIANTS = {
    "dynamic_sampling": ["sampling.dynamic=true"],
    "dynamic_sampling+history_skip": ["sampling.dynamic=true", "sampling.history_skip=true"],
}
BASELINE = "dynamic_sampling"
RAY_STARTUP_ERROR = "timed out during startup"
# Ray's start-up waits (node registration, dashboard-agent ports, worker registration) raised for a machine
# whose load average is far above its core count; they only matter while processes start.
RAY_PATIENCE = {"RAY_raylet_start_wait_time_s": "600", "RAY_agent_register_timeout_ms": "600000",
                "RAY_worker_register_timeout_seconds": "600",
                "RAY_AUTH_MODE": "disabled",  # a head on this machine only, shared by this benchmark's own runs
                # its workers at the driver's priority, as the CPU presets' own local Ray (cluster.worker_niceness)
                "RAY_worker_niceness": "0"}
STARTUP_RETRIES = 4


def workload_overrides(args) -> list[str]:
    return [f"seed={args.seed}", "data.task=arithmetic", f"data.num_train_prompts={args.prompts}",
            f"data.num_eval_prompts={args.eval_prompts}", f"data.max_difficulty={args.max_difficulty}",
            f"rollout.max_response_length={args.max_response_length}", f"rollout.n_samples_per_prompt={args.n}",
            "logging.tensorboard=false", "speculative.enabled=false"]


def free_ports(k: int) -> list[int]:
    socks = [socket.socket() for _ in range(k)]
    for sock in socks:
        sock.bind(("127.0.0.1", 0))
    ports = [sock.getsockname()[1] for sock in socks]
    for sock in socks:
        sock.close()
    return ports


def start_ray_head(work: Path) -> tuple[subprocess.Popen, str]:
    """One local Ray head for every run of the benchmark (`ray start --head --block`, ended by its pid at the end).
    On a crowded machine a fresh local Ray per run often misses Ray's fixed 30 s node start-up; attaching to a
    running head needs no node start-up. Retried until it comes up."""
    # Ray 2.60 waits a fixed 30 s for the new node to register (ray/_private/node.py); on a machine with a load
    # average of 50 that is not enough, so the head is started with that one constant raised to 600 s.
    launcher = ("import sys, ray._private.node as n; c = n.Node.__init__.__code__; "
                "n.Node.__init__.__code__ = c.replace(co_consts=tuple(600 if k == 30 else k for k in c.co_consts)); "
                "from ray.scripts.scripts import main; sys.argv = ['ray'] + sys.argv[1:]; main()")
    for attempt in range(8):
        port, metrics, agent_grpc, agent_http, runtime_env = free_ports(5)
        log = work / f"ray_head_{attempt}.log"
        proc = subprocess.Popen([sys.executable, "-c", launcher, "start", "--head", f"--port={port}", "--num-cpus=8", "--block",
                                 # fixed agent ports: the raylet then need not wait for the agents to report theirs
                                 f"--metrics-export-port={metrics}", f"--dashboard-agent-grpc-port={agent_grpc}",
                                 f"--dashboard-agent-listen-port={agent_http}", f"--runtime-env-agent-port={runtime_env}",
                                 "--include-dashboard=false", "--disable-usage-stats"],
                                stdout=open(log, "w"), stderr=subprocess.STDOUT,
                                env={**os.environ, **RAY_PATIENCE})
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline and proc.poll() is None:
            m = re.search(r"--address='([^']+)'", log.read_text(errors="replace"))
            if m:
                return proc, m.group(1)
            time.sleep(2)
        proc.terminate()
        proc.wait(timeout=60)
        print(f"Ray head did not come up (attempt {attempt + 1}, {log}); retrying", flush=True)
    raise RuntimeError("could not start a Ray head")


def warm_start_and_probe(args, model_dir: Path, work: Path) -> dict:
    """Warm-up exported to `model_dir`, then n sampled responses per training prompt: solved always/never/sometimes."""
    from megatron_sortedrl.config import load_config
    from megatron_sortedrl.driver import Driver
    from megatron_sortedrl.rollout import GenRequest
    from megatron_sortedrl.sample import Sample

    cfg = load_config(ROOT / BASE_CONFIG, workload_overrides(args) + [
        f"model.path={work / 'base_model'}", "model.build_tiny_if_missing=true", f"logging.run_dir={work / 'warmup'}",
        f"trainer.warmup_sft_steps={args.warmup_steps}", "checkpoint.resume=never", f"cluster.ray_address={args.ray}"])
    t0 = time.monotonic()
    driver = Driver(cfg, printer=lambda line: print(f"  [warm-up] {line}", flush=True))
    try:
        out = driver.warm_start()
        driver.trainer.export_hf_weights(model_dir)
        reqs, by_id = [], {}
        for p in driver.prompts.values():
            for i in range(args.n):
                s = Sample(prompt_id=p.prompt_id, index=i, prompt_tokens=driver._tokens(p), ground_truth=p.ground_truth)
                by_id[s.sample_id] = s
                reqs.append((GenRequest(s.sample_id, s.prompt_tokens, driver._sampling(args.max_response_length)), 0))
        driver.pool.submit_many(reqs)
        while driver.pool.in_flight:
            for c in driver.pool.poll(0.05):
                s = by_id[c.request_id]
                c.to_sample(s)
                s.response_text = driver.tok.decode(s.response_tokens, skip_special_tokens=True)
        scored = driver.rewards.score(list(by_id.values()))
    finally:
        driver.close()
    groups: dict[str, list[float]] = {}
    for s in scored:
        groups.setdefault(s.prompt_id, []).append(float(s.reward or 0.0))
    always = sum(all(r >= 1.0 for r in g) for g in groups.values())
    never = sum(all(r <= 0.0 for r in g) for g in groups.values())
    info = {"steps": args.warmup_steps, "final_loss": out.get("loss"), "seconds": round(time.monotonic() - t0, 1),
            "probe": {"prompts": len(groups), "n": args.n, "solved_always": always, "solved_never": never,
                      "informative": sum(len(set(g)) > 1 for g in groups.values()),
                      "mean_reward": statistics.fmean(r for g in groups.values() for r in g)}}
    (model_dir / "warm_start.json").write_text(json.dumps(info, indent=1))
    return info


class RunFailed(RuntimeError):
    pass


def run_variant(name: str, repeat: int, args, model_dir: Path, work: Path) -> dict:
    run_dir = work / f"{name.replace('+', '_')}_r{repeat}"
    cmd = [sys.executable, "-m", "megatron_sortedrl", "train", BASE_CONFIG, *workload_overrides(args),
           f"model.path={model_dir}", "model.build_tiny_if_missing=false", "trainer.warmup_sft_steps=0",
           "data.num_epochs=0", f"trainer.total_steps={args.steps}", "trainer.eval_interval=0",
           "checkpoint.save_interval=0", "checkpoint.resume=never", f"logging.run_dir={run_dir}",
           f"scheduler.policy={args.policy}", f"scheduler.rollout_batch_size={args.rollout_batch}",
           f"scheduler.update_batch_size={args.rollout_batch * args.n}", f"scheduler.group_size={2 * args.rollout_batch}",
           f"cluster.ray_address={args.ray}", *VARIANTS[name], *args.extra]
    log = work / f"{run_dir.name}.log"
    done = work / f"{run_dir.name}.json"  # a finished run is kept, so a benchmark split into parts resumes
    key = [c for c in cmd if not c.startswith("cluster.ray_address=")]  # the head's address differs per part
    if done.is_file() and json.loads(done.read_text()).get("command") == key:
        return json.loads(done.read_text())["result"]
    for attempt in range(STARTUP_RETRIES):  # on a crowded machine Ray's fixed 30 s node start-up can time out
        t0 = time.monotonic()
        with open(log, "w") as fh:
            try:
                rc = subprocess.run(cmd, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT, timeout=args.run_timeout,
                                env={**os.environ, **RAY_PATIENCE}).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
        if rc == 0 or RAY_STARTUP_ERROR not in log.read_text(errors="replace"):
            break
        print(f"  {name} r{repeat}: Ray start-up timed out (attempt {attempt + 1}); retrying", flush=True)
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    if rc != 0 or summary.get("steps") != args.steps:
        tail = "".join(log.read_text(errors="replace").splitlines(keepends=True)[-15:])
        raise RunFailed(f"{name} (repeat {repeat}) ended with rc={rc}, summary={summary or 'missing'}\n"
                        f"command: cd {ROOT} && {shlex.join(cmd)}\nlog {log}, last lines:\n{tail}")
    result = {**figures(run_dir), "process_s": round(time.monotonic() - t0, 1),
              "accuracy_before_rl": summary["accuracy_before_rl"], "run_dir": str(run_dir)}
    done.write_text(json.dumps({"command": key, "result": result}))
    return result


def figures(run_dir: Path) -> dict:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in rows if "time/step_s" in r]
    evals = [r for r in rows if "eval/accuracy" in r]
    total = {k: sum(r.get(f"sampling/{k}", 0) for r in steps)
             for k in ("generated_tokens", "trained_tokens", "trained_groups", "filtered_groups", "skipped_prompts",
                       "extra_rounds", "cap_hit", "predicted_informative", "actual_informative")}
    samples = sum(r["rollout/samples"] for r in steps)
    step_s = sum(r["time/step_s"] for r in steps)
    groups = total["trained_groups"] + total["filtered_groups"]
    return {"steps": len(steps), "trained_samples": samples, **total,
            "generated_tokens_per_trained_token": total["generated_tokens"] / max(1, total["trained_tokens"]),
            "ms_per_trained_sample": 1e3 * step_s / max(1, samples), "step_s_total": step_s,
            "informative_share": total["trained_groups"] / max(1, groups),
            "final_accuracy": evals[-1]["eval/accuracy"], "reward_mean": statistics.fmean(
                v for r in steps for v in r["reward/per_sample"].values()),
            "per_step": [{k: r.get(f"sampling/{k}") for k in ("trained_groups", "filtered_groups", "skipped_prompts",
                                                               "skip_probability", "generated_per_trained_token")}
                         for r in steps]}


def summarise(name: str, runs: list[dict]) -> dict:
    row: dict = {"variant": name, "repeats": len(runs)}
    for key in ("generated_tokens_per_trained_token", "ms_per_trained_sample", "informative_share", "final_accuracy",
                "trained_samples", "skipped_prompts", "filtered_groups", "trained_groups", "extra_rounds", "reward_mean"):
        vals = [r[key] for r in runs]
        if key == "ms_per_trained_sample":
            row.update({f"{key}_median": statistics.median(vals), f"{key}_min": min(vals), f"{key}_max": max(vals)})
        else:
            row[key] = statistics.median(vals)
            row[f"{key}_all"] = vals
    return row


def markdown_table(rows: list[dict]) -> str:
    head = ("variant", "gen tok / trained tok", "ms / trained sample (med [min, max])", "x DS", "informative share",
            "skipped", "final acc (all repeats)")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        lines.append(f"| {r['variant']} | {r['generated_tokens_per_trained_token']:.2f} | "
                     f"{r['ms_per_trained_sample_median']:.1f} [{r['ms_per_trained_sample_min']:.1f}, "
                     f"{r['ms_per_trained_sample_max']:.1f}] | {r['speedup_vs_dynamic_sampling']:.2f} | "
                     f"{r['informative_share']:.2f} | {r['skipped_prompts']:.0f} | "
                     f"{', '.join(f'{a:.3f}' for a in r['final_accuracy_all'])} |")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    names = [r["variant"].replace("+", "\n+") for r in rows]
    fig, ax = plt.subplots(1, 3, figsize=(13, 4))
    ax[0].bar(names, [r["generated_tokens_per_trained_token"] for r in rows], color=["tab:gray", "tab:green"])
    ax[0].set(title="Generated tokens per trained token", ylabel="tokens")
    med = [r["ms_per_trained_sample_median"] for r in rows]
    err = [[m - r["ms_per_trained_sample_min"] for m, r in zip(med, rows)],
           [r["ms_per_trained_sample_max"] - m for m, r in zip(med, rows)]]
    ax[1].bar(names, med, yerr=err, capsize=6, color=["tab:gray", "tab:green"])
    ax[1].set(title="Step time per trained sample (median, min-max)", ylabel="ms")
    for name, runs in result["runs"].items():
        for i, run in enumerate(runs):
            share = [s["generated_per_trained_token"] or 0 for s in run["per_step"]]
            ax[2].plot(range(1, len(share) + 1), share, color="tab:green" if "skip" in name else "tab:gray",
                       alpha=0.7, label=name if i == 0 else None)
    ax[2].set(title="Generated / trained tokens per update", xlabel="update", ylabel="ratio")
    ax[2].legend()
    fig.suptitle(f"Selective rollout, tiny model on CPU ({result['setup']['repeats']} interleaved repeats)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=64, help="training prompts")
    ap.add_argument("--eval-prompts", type=int, default=64, help="held-out prompts of the final eval")
    ap.add_argument("--n", type=int, default=4, help="samples per prompt")
    ap.add_argument("--max-difficulty", type=int, default=6, help="data.max_difficulty")
    ap.add_argument("--max-response-length", type=int, default=128)
    ap.add_argument("--warmup-steps", type=int, default=400)
    ap.add_argument("--steps", type=int, default=12, help="RL updates per run (equal for every variant)")
    ap.add_argument("--rollout-batch", type=int, default=8, help="informative groups per update")
    ap.add_argument("--policy", default="twotier")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--model-dir", type=Path, default=None, help="warm-started HF dir to reuse (made there if absent)")
    ap.add_argument("--work-dir", type=Path, default=None)
    ap.add_argument("--run-timeout", type=int, default=900)
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks")
    ap.add_argument("--warm-only", action="store_true", help="make the warm start and probe, then stop (a resumable part)")
    ap.add_argument("extra", nargs="*", help="key=value overrides for every variant run")
    args = ap.parse_args()
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="selective_rollout_"))
    work.mkdir(parents=True, exist_ok=True)
    model_dir = (args.model_dir or work / "warm_model").resolve()
    t_all = time.monotonic()
    os.environ.update(RAY_PATIENCE)  # the warm-up driver runs in this process
    head, args.ray = start_ray_head(work)
    print(f"Ray head at {args.ray}", flush=True)
    try:
        return measure(args, model_dir, work, t_all)
    finally:
        stop_ray_head(head, args.ray)  # its processes and its bootstrap file (ray_head.py)


def measure(args, model_dir: Path, work: Path, t_all: float) -> int:
    if (model_dir / "warm_start.json").is_file():
        warm = json.loads((model_dir / "warm_start.json").read_text())
        print(f"reusing warm-started model {model_dir}", flush=True)
    else:
        warm = warm_start_and_probe(args, model_dir, work)
    print(f"warm start: {json.dumps(warm)}", flush=True)
    if args.warm_only:
        return 0
    runs: dict[str, list[dict]] = {n: [] for n in VARIANTS}
    try:
        for rep in range(args.repeats):
            for name in VARIANTS:
                r = run_variant(name, rep, args, model_dir, work)
                runs[name].append(r)
                print(f"{name:30s} r{rep}: {r['trained_samples']} samples, gen/trained tok "
                      f"{r['generated_tokens_per_trained_token']:.2f}, {r['ms_per_trained_sample']:.1f} ms/sample, "
                      f"informative {r['informative_share']:.2f}, skipped {r['skipped_prompts']}, "
                      f"acc {r['accuracy_before_rl']:.3f} -> {r['final_accuracy']:.3f} ({r['process_s']:.0f}s)", flush=True)
    except RunFailed as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    rows = [summarise(n, runs[n]) for n in VARIANTS]
    base = rows[0]
    for r in rows:
        r["speedup_vs_dynamic_sampling"] = base["ms_per_trained_sample_median"] / r["ms_per_trained_sample_median"]
        r["generated_tokens_reduction_vs_dynamic_sampling"] = (base["generated_tokens_per_trained_token"]
                                                               / r["generated_tokens_per_trained_token"])
    before = sorted({r["accuracy_before_rl"] for rs in runs.values() for r in rs})
    result = {
        "setup": {"command": "python benchmarks/selective_rollout.py " + " ".join(sys.argv[1:]),
                  "base_config": BASE_CONFIG, "policy": args.policy, "prompts": args.prompts, "n": args.n,
                  "steps": args.steps, "informative_groups_per_update": args.rollout_batch,
                  "max_difficulty": args.max_difficulty, "max_response_length": args.max_response_length,
                  "seed": args.seed, "repeats": args.repeats, "warm_start": warm,
                  "machine": f"{platform.machine()} {os.cpu_count()} CPUs, shared (load average "
                             f"{os.getloadavg()[0]:.1f} at the end)",
                  "date": time.strftime("%Y-%m-%d"), "benchmark_s": round(time.monotonic() - t_all, 1)},
        "checks": {"accuracy_before_rl": before, "identical_start": len(before) == 1},
        "rows": rows, "runs": runs,
    }
    table = markdown_table(rows)
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "selective_rollout.json").write_text(json.dumps(result, indent=1) + "\n")
    probe = warm["probe"]
    (args.out / "selective_rollout.md").write_text(
        f"# Selective rollout on CPU: dynamic sampling vs + reward-history skip\n\n"
        f"`{result['setup']['command']}` ({result['setup']['date']}, {result['setup']['machine']}, "
        f"{result['setup']['benchmark_s']:.0f} s). Policy `{args.policy}`, {args.prompts} arithmetic prompts "
        f"(difficulty 1-{args.max_difficulty}), n = {args.n}, {args.steps} updates of at least {args.rollout_batch} "
        f"informative groups, {args.repeats} interleaved repeats from the same warm start "
        f"({warm['steps']} supervised steps; pre-RL eval accuracy {', '.join(f'{b:.3f}' for b in before)}).\n\n"
        f"Warm-start probe ({probe['n']} sampled responses per training prompt): {probe['solved_always']} of "
        f"{probe['prompts']} prompts solved always, {probe['solved_never']} never, {probe['informative']} "
        f"sometimes (informative).\n\n{table}\n\n"
        "Generated tokens count every response token the engines produced for the update (trained, filtered "
        "groups, aborted surplus); step time is rollout + reward + training + weight sync. See "
        "docs/selective_rollout.md.\n")
    plot(result, args.out / "selective_rollout.png")
    print(f"wrote {args.out}/selective_rollout.{{json,md,png}}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
