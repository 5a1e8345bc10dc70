"""Policy comparison on real RL runs (CPU): the same workload, warm start and sample budget through the RL loop
of the `train` command (the driver) with every scheduling policy, with and without HistoSpec, over repeats.

    PYTHONPATH=. .venv/bin/python benchmarks/policy_comparison.py --preset longtail   # ~50 min on 2 cores at load 30-85
    PYTHONPATH=. .venv/bin/python benchmarks/policy_comparison.py --preset light      # ~12 min at load 70-80: sync vs twotier
    PYTHONPATH=. .venv/bin/python benchmarks/policy_comparison.py --preset light --repeats 1 --prompts 16  # a smoke run

Two presets, each with its own output files under docs/benchmarks/:
- `longtail` (configs/longtail_cpu.yaml, `policy_comparison_longtail.{json,md,png}`): long-tail column
  addition, responses of ~20 tokens at the median and up to ~470, three engines; variants sync, tail, sorted,
  twotier, twotier+histospec.
- `light` (configs/tiny_cpu.yaml, `policy_comparison.{json,md,png}`): the default run's light-tail arithmetic;
  sync vs twotier, the check that the default is not slower than sync where the tail is short.

What it does: one driver (trainer, engines, reward pool; `Session`) per speculative setting runs every run
of that setting in turn, so start-up is paid twice, not once per run (minutes each on a loaded machine). The
supervised warm-up runs once (`--warmup-steps`, default the preset's, on `--sft-prompts` fresh problems of the
task) and is saved as a trainer checkpoint; before every run the trainer reloads it (weights and
optimizer), the engines get it as policy version 0, and the policy, HistoSpec history (drafters emptied),
run records and reward counters are new, so each run is what a fresh `train` from the warm start would do:
same prompts, `data.num_epochs` passes (every prompt is trained n x epochs times whatever the policy; the
trained sample counts are checked), greedy eval before and after (the pre-RL accuracies must agree). Repeat r
runs every variant with `seed=<seed>+r` (sampling and data order; the prompts come from `data.seed`), the
variants of one driver interleaved, so the spread over repeats is a seed spread under the same machine
conditions. The HistoSpec variants run after the plain ones (their engines differ), so their ratio to `sync`
spans two time windows: the load average of each run is in the JSON. Mid-run evaluation and checkpoints are
off.

Figures per variant, median over repeats with min and max (from metrics.jsonl and timeline.jsonl):
`ms_per_sample_*` = sum of `time/step_s` / trained samples (rollout, reward, train, weight sync, history;
start-up, warm-up and evals excluded); `speedup_vs_sync` = sync's median / the variant's median;
`worker_bubble` = mean `rollout/bubble_ratio`; `driver_idle_share` = rollout-time-weighted mean of
`rollout/driver_idle_share`; `reward` = mean reward over every trained sample (equal counts); `final_accuracy`
= greedy eval accuracy after the last step. The per-update fixed cost is broken down from the phase timers:
`time/train_s` (advantages + optimizer step, two trainer RPCs), `time/sync_s` (weight push to every engine),
`time/history_s` (HistoSpec history shipping and drafter stats, two engine RPCs; zero work without
speculation) and `other` = step time outside the phases (round composition, harvest bookkeeping, metrics).
`round_len_ratio` is the median over steps of (longest / median response finished in that step), taken from
`sync`, whose rounds are the workload's batches. Variants named `+stream` run with `trainer.stream: true`.
The `ceiling` block: after each sync run, its own responses are generated again as one packed batch (all at
once, longest first; `packed_replay`), and `sync ms/sample / (packed rollout + sync's non-rollout time)` is
the most any scheduling policy could gain on this machine with the same train step. The load average is
sampled at every run's start and end and written to `setup.load_average`.

Left out: GPUs (the script runs there unchanged; the CPU figures rank policies differently, see the .md),
statistical tests (3 seeds show the spread, not significance).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# name -> (scheduler.policy, speculative.enabled, trainer.stream); `sync` is the baseline every ratio refers to.
VARIANTS = {
    "sync": ("sync", False, False),
    "tail": ("tail", False, False),
    "sorted": ("sorted", False, False),
    "twotier": ("twotier", False, False),
    "twotier+histospec": ("twotier", True, False),
    "sync+histospec": ("sync", True, False),
    "sync+stream": ("sync", False, True),
    "twotier+stream": ("twotier", False, True),
    "twotier+histospec+stream": ("twotier", True, True),
}
BASELINE, HEADLINE = "sync", "twotier+histospec"
PRESETS = {
    "longtail": {"config": "configs/longtail_cpu.yaml", "stem": "policy_comparison_longtail",
                 "variants": "sync,tail,sorted,twotier,twotier+histospec", "prompts": 48, "eval_prompts": 48,
                 "epochs": 2, "warmup_steps": 400},
    "light": {"config": "configs/tiny_cpu.yaml", "stem": "policy_comparison", "variants": "sync,twotier",
              "prompts": 48, "eval_prompts": 64, "epochs": 2, "warmup_steps": 500},
}
PHASES = ("rollout", "train", "sync", "history", "other")


def workload_overrides(args) -> list[str]:
    """The keys every run (warm-up included) shares; the rest comes from the preset's config."""
    keys = [f"data.num_train_prompts={args.prompts}", f"data.num_eval_prompts={args.eval_prompts}",
            "logging.tensorboard=false"]
    if args.max_difficulty:
        keys.append(f"data.max_difficulty={args.max_difficulty}")
    if args.max_response_length:
        keys.append(f"rollout.max_response_length={args.max_response_length}")
    # equal footing (docs/trainer.md): the same samples per optimizer step for every variant
    if getattr(args, "mini_batch", 0):
        keys.append(f"algorithm.ppo_mini_batch_size={args.mini_batch}")
    return keys


class RunFailed(RuntimeError):
    pass


class Session:
    """One `Driver` (trainer, rollout engines, reward pool) reused by consecutive runs, so the start-up (minutes
    on a loaded machine) is paid once per speculative setting instead of once per run. Before each run the
    trainer reloads the warm-start checkpoint (weights and optimizer), the engines get those weights as
    version 0, and the policy, HistoSpec history (the engines' drafters are emptied too), run records and
    counters are new: each run sees what a fresh `train` with `model.path=<warm start>` would.
    """

    def __init__(self, args, spec: bool, work: Path, overrides=None) -> None:
        from megatron_sortedrl.driver import Driver

        self.args, self.spec, self.work = args, spec, work
        self.overrides = overrides or workload_overrides  # args -> the config keys every run shares
        self.cfg = self.run_config("sync", args.seed, work / f"session_{'spec' if spec else 'plain'}", warmup=True)
        print(f"starting a driver (speculative.enabled={str(spec).lower()}) ...", flush=True)
        t0 = time.monotonic()
        self.driver = Driver(self.cfg, printer=lambda line: print(f"  [driver] {line}", flush=True))
        self.driver.write_report = lambda: None  # the report is not part of the comparison; saves time
        self.driver.checkpoint = lambda: ""  # no per-run checkpoints either
        self.startup_s = time.monotonic() - t0
        print(f"driver up in {self.startup_s:.0f}s", flush=True)

    def run_config(self, policy: str, seed: int, run_dir: Path, warmup: bool = False, stream: bool = False,
                   extra: tuple[str, ...] = ()):
        from megatron_sortedrl.config import load_config

        args = self.args
        keys = self.overrides(args) + [
            f"seed={seed}", f"model.path={self.work / 'base_model'}", "model.build_tiny_if_missing=true",
            f"data.num_epochs={args.epochs}", f"trainer.total_steps={args.prompts * args.epochs}",
            "trainer.eval_interval=0", "checkpoint.save_interval=0", "checkpoint.resume=never",
            f"logging.run_dir={run_dir}", f"scheduler.policy={policy}",
            f"speculative.enabled={str(self.spec).lower()}", "speculative.method=histospec",
            f"trainer.stream={str(stream).lower()}", *extra]
        if not warmup:
            keys.append("trainer.warmup_sft_steps=0")
        elif args.warmup_steps is not None:
            keys.append(f"trainer.warmup_sft_steps={args.warmup_steps}")
        return load_config(ROOT / args.config, keys)

    def warm_start(self, ckpt: Path) -> dict:
        """The supervised warm-up, saved as the checkpoint every run starts from. Like the driver's `warm_start`
        (16 worked solutions per step, `trainer.warmup_sft_steps` steps) but on `--sft-prompts` fresh problems of
        the task (another generator seed than the training and held-out sets): a warm start on the few RL
        prompts alone memorizes their solutions instead of learning the procedure."""
        import random
        from dataclasses import replace

        from megatron_sortedrl.warmup import sft_problems

        d, steps = self.driver, self.cfg.trainer.warmup_sft_steps
        problems = self.args.sft_prompts or self.cfg.trainer.warmup_sft_problems or 2048
        # the driver's own pool (fresh problems, another seed; `warmup_answer_only_share` applied)
        pool = sft_problems(replace(self.cfg, trainer=replace(self.cfg.trainer, warmup_sft_problems=problems)), [])
        rng = random.Random(self.cfg.seed)
        t0, out = time.monotonic(), {}
        for i in range(steps):
            pairs = [(d.encoder.encode(p), d.tok(p.solution)["input_ids"] + [d.eos]) for p in rng.sample(pool, 16)]
            out = d.trainer.sft_step(pairs)
            if (i + 1) % max(1, steps // 10) == 0:
                print(f"  warm-up {i + 1}/{steps}: loss {out.get('loss', float('nan')):.3f} "
                      f"({time.monotonic() - t0:.0f}s)", flush=True)
        if self.cfg.trainer.warmup_reset_optimizer:  # as the driver's warm start: RL starts from a fresh Adam
            d.trainer.reset_optimizer()
        self.driver.trainer.save_checkpoint(ckpt, extra={})
        info = {"steps": steps, "reset_optimizer": self.cfg.trainer.warmup_reset_optimizer, "sft_problems": len(pool),
                "final_loss": out.get("loss"), "seconds": round(time.monotonic() - t0, 1)}
        (ckpt.parent / "warm_start.json").write_text(json.dumps(info, indent=1))
        return info

    def run(self, name: str, repeat: int, ckpt: Path, variant: tuple | None = None, on_step=None,
            replay: bool = True) -> dict:
        """One run of variant `name` (`VARIANTS[name]`, or `variant` = (policy, speculative, stream[, extra
        config keys])) from the warm start; `on_step(driver, StepResult)` is called after every step (the
        driver's hook); `replay` adds sync's packed replay (the `ceiling` block)."""
        import random

        from megatron_sortedrl.minibatch import MiniBatcher
        from megatron_sortedrl.trainer.stream import DriverStream
        from scheduler.layout import make_planner
        from scheduler.policies import make_policy
        from speculative.history import HistoryStore

        policy, spec, stream, *rest = variant or VARIANTS[name]
        extra = tuple(rest[0]) if rest else ()
        assert spec == self.spec
        run_dir = self.work / f"{name.replace('+', '_')}_r{repeat}"
        shutil.rmtree(run_dir, ignore_errors=True)
        cfg = self.run_config(policy, self.args.seed + repeat, run_dir, stream=stream, extra=extra)
        d = self.driver
        for close in d.records.closers():
            close()
        d.cfg, d.run_dir, d.ckpt_root = cfg, run_dir, run_dir / "checkpoints"
        run_dir.mkdir(parents=True, exist_ok=True)
        d.step = d.version = 0
        d._saved_step, d.accuracy_before, d._resumed, d.stop_signal, d.events = -1, None, {}, None, []
        d.trainer.load_checkpoint(ckpt)
        d.pool.sync_weights(d.trainer, version=0)
        random.seed(cfg.seed)
        gpus = cfg.rollout.num_workers * cfg.rollout.tensor_parallel_size
        planner = make_planner("fixed", gpus=gpus, gpus_per_node=gpus, tp_short=cfg.rollout.tensor_parallel_size,
                               tp_long=cfg.rollout.long_round_tensor_parallel_size)
        d.policy = make_policy(cfg.scheduler, sorted(d.prompts), n_samples=cfg.rollout.n_samples_per_prompt,
                               max_response_length=cfg.rollout.max_response_length, planner=planner, seed=cfg.seed,
                               sample_factory=d.new_sample, num_epochs=cfg.data.num_epochs or None)
        d.stream = DriverStream(d.trainer, d.policy) if cfg.trainer.stream else None  # as Driver.__init__ does
        # this run's mini-batch size and a fresh step count (the driver's own was built for the session's config)
        d.minibatch = MiniBatcher(cfg.algorithm.ppo_mini_batch_size, cfg.algorithm.ppo_epochs)
        d.history = HistoryStore(max_prompts=cfg.speculative.history_max_prompts,
                                 max_responses_per_prompt=cfg.speculative.history_max_responses)
        d._shipped = 0
        if self.spec:  # empty the drafters' history (a full snapshot of an empty store) and their counters
            d.pool.collective_rpc("histospec_update", HistoryStore().snapshot().to_bytes())
            d.pool.collective_rpc("histospec_stats", reset=True)
        d.rewards.stats.update(scored=0, errors=0, timeouts=0)
        d.rewards.failures.clear()
        d._open_records()
        load = [os.getloadavg()[0]]
        t0 = time.monotonic()
        try:
            summary = d.run(on_step=(lambda result: on_step(d, result)) if on_step else None)
        except Exception as exc:
            raise RunFailed(f"{name} (repeat {repeat}) failed: {type(exc).__name__}: {exc}") from exc
        process_s = time.monotonic() - t0
        load.append(os.getloadavg()[0])
        if not summary.get("data_exhausted"):
            raise RunFailed(f"{name} (repeat {repeat}) did not use up its data: {summary}")
        out = {**figures(run_dir, cfg.rollout.max_num_seqs), "process_s": process_s, "driver_wall_s": summary["wall_s"],
               "load_average": load, "accuracy_before_rl": summary["accuracy_before_rl"], "run_dir": str(run_dir)}
        if name == BASELINE and replay:  # the floor of every plain schedule on this run's responses (the `ceiling` block)
            out["packed_replay"] = packed_replay(d, run_dir)
        return out

    def close(self) -> None:
        self.driver.close()


def figures(run_dir: Path, max_num_seqs: int) -> dict:
    """The comparison figures of one finished run, from its metrics.jsonl and timeline.jsonl."""
    from megatron_sortedrl.telemetry.timeline import (
        read_run_timeline,
        slot_bubble_ratio,
    )

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in rows if "time/step_s" in r]
    evals = [r for r in rows if "eval/accuracy" in r]
    samples = sum(r["rollout/samples"] for r in steps)
    rewards = [v for r in steps for v in r["reward/per_sample"].values()]
    tokens = sum(r["rollout/response_len"] * r["rollout/samples"] for r in steps)
    step_s = sum(r["time/step_s"] for r in steps)
    phase_s = {p: sum(r.get(f"time/{p}_s", 0.0) for r in steps) for p in PHASES[:-1]}
    phase_s["other"] = step_s - sum(phase_s.values())
    rollout_s = [r.get("time/rollout_s", 0.0) for r in steps]
    hist: Counter = Counter()
    for r in steps:
        hist.update({int(k): v for k, v in r["rollout/staleness_hist"].items()})

    def mean_of(key: str) -> float | None:
        vals = [r[key] for r in steps if r.get(key) is not None]
        return statistics.fmean(vals) if vals else None

    ratios, longest = round_lengths(run_dir)
    slot = slot_bubble_ratio(read_run_timeline(run_dir), max_batch=max_num_seqs)
    return {"steps": len(steps), "trained_samples": samples, "response_tokens": tokens,
            "step_s_total": step_s, "rl_wall_s": steps[-1]["t"] - evals[0]["t"],
            "s_per_sample_steps": step_s / samples, "tokens_per_s": tokens / step_s,
            "bubble_ratio": mean_of("rollout/bubble_ratio"), "slot_bubble": slot,
            "driver_idle_share": sum(r.get("rollout/driver_idle_share", 0.0) * t for r, t in zip(steps, rollout_s))
            / max(1e-9, sum(rollout_s)),
            "rollout_share": phase_s["rollout"] / step_s,
            **{f"{p}_ms_per_sample": 1e3 * v / samples for p, v in phase_s.items()},
            **{f"{p}_ms_per_update": 1e3 * v / len(steps) for p, v in phase_s.items() if p != "rollout"},
            "fixed_ms_per_update": 1e3 * (step_s - phase_s["rollout"]) / len(steps),
            "staleness_mean": mean_of("rollout/staleness_mean"),
            "staleness_hist": {str(k): v for k, v in sorted(hist.items())},
            "spec_mean_accepted_length": mean_of("spec/mean_accepted_length"),
            "spec_tokens_per_forward": mean_of("spec/tokens_per_forward"),
            "reward_mean": statistics.fmean(rewards), "reward_samples": len(rewards),
            "final_eval_accuracy": evals[-1]["eval/accuracy"], "mean_response_len": tokens / samples,
            "round_len_ratio": statistics.median(ratios) if ratios else None,
            "rounds_len_ratio_ge_10": sum(x >= 10 for x in ratios) / len(ratios) if ratios else None,
            "longest_response": longest}


def round_lengths(run_dir: Path) -> tuple[list[float], int]:
    """Per step, longest / median length of the responses that finished in it; and the longest of the run."""
    per_step: dict[int, list[int]] = {}
    with open(run_dir / "timeline.jsonl") as f:
        for line in f:
            if '"finish"' not in line:
                continue
            e = json.loads(line)
            if e.get("kind") == "request" and e.get("event") == "finish" and e.get("step", 0) > 0:
                per_step.setdefault(e["step"], []).append(int(e["tokens"]))
    ratios = [max(v) / max(1.0, statistics.median(v)) for v in per_step.values() if len(v) >= 4]
    return ratios, max((max(v) for v in per_step.values()), default=0)


def train_cost_fit(run_dirs: list[str]) -> dict:
    """Least-squares `time/train_s = fixed + per_token * train/n_tokens` over every step of the given runs: the
    train step's fixed part (RPCs, optimizer step, launch overheads) apart from its per-token work."""
    import numpy as np

    pts = [(r["train/n_tokens"], r["time/train_s"]) for d in run_dirs
           for r in map(json.loads, (Path(d) / "metrics.jsonl").read_text().splitlines())
           if "time/train_s" in r and "train/n_tokens" in r]
    x, y = np.array([p[0] for p in pts], float), np.array([p[1] for p in pts], float)
    slope, intercept = np.polyfit(x, y, 1)
    resid = y - (intercept + slope * x)
    return {"fixed_ms": 1e3 * float(intercept), "us_per_token": 1e6 * float(slope), "steps": len(pts),
            "r2": float(1 - resid.var() / y.var()) if y.var() > 0 else None}


def packed_replay(d, run_dir: Path) -> dict:
    """Sync's own responses regenerated as one perfectly packed batch: every response of the run (its prompt's
    token count, its final length, `ignore_eos`, the run's sampling) submitted at once, longest first, so the
    engines run `rollout.max_num_seqs` sequences until the queue drains and the last tail is as short as it can
    be. Its wall time per sample is what rollout would cost if no schedule ever left a slot empty and nothing
    waited for a policy update: the floor of every plain scheduler on this machine."""
    from megatron_sortedrl.rollout import GenRequest
    from megatron_sortedrl.telemetry.timeline import read_run_timeline
    from scheduler.sim.calibrate import replay_table, run_prompt_tokens

    table = replay_table(read_run_timeline(run_dir))
    prompt_len = run_prompt_tokens(run_dir)
    mean_prompt = statistics.fmean(prompt_len.values()) if prompt_len else 64.0
    jobs = sorted(((n, prompt_len.get(pid, round(mean_prompt))) for pid, by_epoch in table.items()
                   for ns in by_epoch.values() for n in ns if n > 0), reverse=True)
    engines, asked = d.cfg.rollout.num_workers, sum(n for n, _ in jobs)
    reqs = [(GenRequest(f"packed-{i}", [4 + j % 90 for j in range(p)],
                        {**d._sampling(n), "ignore_eos": True, "stop_token_ids": []}), i % engines)
            for i, (n, p) in enumerate(jobs)]
    t0 = time.monotonic()
    d.pool.submit_many(reqs)
    outs = list(d.pool.completions())
    wall = time.monotonic() - t0
    tokens = sum(len(c.tokens) for c in outs)
    if tokens != asked:
        raise RunFailed(f"packed replay of {run_dir}: {tokens} tokens, {asked} asked for")
    return {"samples": len(jobs), "tokens": tokens, "packed_s": wall, "packed_ms_per_sample": 1e3 * wall / len(jobs)}


def speedup_ceiling(sync_runs: list[dict]) -> dict:
    """What no plain scheduling policy can beat on this machine: sync's step time per sample against the packed
    replay of its own responses plus sync's non-rollout time (train, weight sync, history, other: every
    variant trains the same samples, and on 2 saturated cores stream training moves that work rather than
    hiding it, see the +stream rows). Per sync repeat, then the median."""
    per = []
    for r in sync_runs:
        ms, rollout = 1e3 * r["s_per_sample_steps"], r["rollout_ms_per_sample"]
        packed = r["packed_replay"]["packed_ms_per_sample"]
        per.append({**r["packed_replay"], "sync_ms_per_sample": ms, "sync_rollout_ms_per_sample": rollout,
                    "rollout_vs_packed": rollout / packed, "ceiling": ms / (packed + ms - rollout)})
    return {"ceiling_median": statistics.median(x["ceiling"] for x in per),
            "ceiling_min": min(x["ceiling"] for x in per), "ceiling_max": max(x["ceiling"] for x in per),
            "packed_ms_per_sample_median": statistics.median(x["packed_ms_per_sample"] for x in per),
            "per_sync_repeat": per}


def median_row(name: str, runs: list[dict]) -> dict:
    """Median over repeats of every scalar (min and max of the headline ones); staleness histograms summed."""
    row: dict = {"variant": name, "policy": VARIANTS[name][0], "histospec": VARIANTS[name][1],
                 "stream": VARIANTS[name][2], "repeats": len(runs)}
    for key, value in runs[0].items():
        if isinstance(value, (int, float)) and not isinstance(value, bool) or value is None:
            vals = [r[key] for r in runs if r.get(key) is not None]
            row[key] = statistics.median(vals) if vals else None
    ms = [1e3 * r["s_per_sample_steps"] for r in runs]
    row.update(ms_per_sample_median=statistics.median(ms), ms_per_sample_min=min(ms), ms_per_sample_max=max(ms),
               ms_per_sample_per_repeat=ms, worker_bubble=row["bubble_ratio"],
               reward=row["reward_mean"], reward_per_repeat=[r["reward_mean"] for r in runs],
               final_accuracy=row["final_eval_accuracy"],
               final_accuracy_per_repeat=[r["final_eval_accuracy"] for r in runs])
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
        r["speedup_vs_sync"] = base["ms_per_sample_median"] / r["ms_per_sample_median"]
        # the spread of the ratio: best and worst pairing of this variant's and sync's repeats
        r["speedup_vs_sync_min"] = base["ms_per_sample_min"] / r["ms_per_sample_max"]
        r["speedup_vs_sync_max"] = base["ms_per_sample_max"] / r["ms_per_sample_min"]
        r["slower_than_sync_beyond_spread"] = r["ms_per_sample_min"] > base["ms_per_sample_max"]


def _f(v, fmt: str = ".3f") -> str:
    return "-" if v is None else format(v, fmt)


def _spread(r: dict, key: str) -> str:
    vals = r[f"{key}_per_repeat"]
    return f"{statistics.median(vals):.3f} ({min(vals):.3f}-{max(vals):.3f})"


def markdown_tables(rows: list[dict]) -> str:
    head = ("| variant | ms/sample median (min-max) | speed-up vs sync (range) | worker bubble | slot bubble | driver idle | "
            "rollout share | staleness | tokens/s | tokens/fwd | reward median (min-max) | final acc median (min-max) |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        lines.append(
            f"| {r['variant']} | {r['ms_per_sample_median']:.1f} ({r['ms_per_sample_min']:.1f}-"
            f"{r['ms_per_sample_max']:.1f}) | {r['speedup_vs_sync']:.2f}x ({r['speedup_vs_sync_min']:.2f}-"
            f"{r['speedup_vs_sync_max']:.2f}) | {_f(r['worker_bubble'], '.2f')} | {r['slot_bubble']:.2f} | "
            f"{r['driver_idle_share']:.3f} | "
            f"{r['rollout_share']:.2f} | {_f(r['staleness_mean'], '.2f')} | {r['tokens_per_s']:.0f} | "
            f"{_f(r['spec_tokens_per_forward'], '.2f')} | {_spread(r, 'reward')} | {_spread(r, 'final_accuracy')} |")
    lines += ["", ("Where the time goes, ms per trained sample by phase (medians over repeats), and the fixed cost of "
              "one update (ms per update: train = advantages + optimizer step, sync = weight push, history = "
              "HistoSpec shipping + drafter stats RPCs, other = driver bookkeeping outside the phases):"), "",
              ("| variant | updates | rollout | train | sync | history | other | total | fixed ms/update "
              "(train / sync / history / other) |"), "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['variant']} | {r['steps']:.0f} | " + " | ".join(f"{r[f'{p}_ms_per_sample']:.1f}" for p in PHASES)
            + f" | {r['ms_per_sample_median']:.1f} | {r['fixed_ms_per_update']:.0f} ("
            + " / ".join(f"{r[f'{p}_ms_per_update']:.0f}" for p in PHASES[1:]) + ") |")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    names = [r["variant"] for r in rows]
    x = list(range(len(rows)))
    colors = ["#999999" if r["variant"] == BASELINE else "#e6550d" if r["variant"] == HEADLINE
              else "#3182bd" if not r["histospec"] else "#fdae6b" for r in rows]
    fig, axes = plt.subplots(2, 3, figsize=(15, 7.5))
    ax = axes[0, 0]
    med = [r["ms_per_sample_median"] for r in rows]
    err = [[m - r["ms_per_sample_min"] for m, r in zip(med, rows)], [r["ms_per_sample_max"] - m for m, r in zip(med, rows)]]
    bars = ax.bar(names, med, color=colors, yerr=err, capsize=4)
    for b, r in zip(bars, rows):
        ax.annotate(f"{r['ms_per_sample_median']:.1f}\n{r['speedup_vs_sync']:.2f}x",
                    (b.get_x() + b.get_width() / 2, r["ms_per_sample_max"]), ha="center", va="bottom", fontsize=7)
    cap = result.get("ceiling")
    if cap:  # the packed replay's bound: sync's median over the ceiling
        base = next(r for r in rows if r["variant"] == BASELINE)["ms_per_sample_median"]
        ax.axhline(base / cap["ceiling_median"], color="k", ls="--", lw=1,
                   label=f"ceiling of any policy ({cap['ceiling_median']:.2f}x sync)")
        ax.legend(fontsize=7, loc="lower left")
    ax.set_title("ms per trained sample (min-max bars), speed-up vs sync", fontsize=9)
    ax.margins(y=0.25)
    ax = axes[0, 1]
    bottom = [0.0] * len(rows)
    for p, c in zip(PHASES, ["#3182bd", "#e6550d", "#31a354", "#756bb1", "#bbbbbb"]):
        vals = [r[f"{p}_ms_per_sample"] for r in rows]
        ax.bar(names, vals, bottom=bottom, color=c, label=p)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_title("ms per trained sample by phase", fontsize=9)
    ax.legend(fontsize=7)
    ax = axes[0, 2]
    for off, key, alpha, hatch, label in ((-0.27, "worker_bubble", 1.0, "", "worker bubble"),
                                          (0.0, "slot_bubble", 0.7, "..", "slot bubble"),
                                          (0.27, "driver_idle_share", 0.4, "//", "driver idle share")):
        ax.bar([i + off for i in x], [r[key] or 0.0 for r in rows], 0.27, color=colors, alpha=alpha, hatch=hatch,
               label=label)
    ax.set_xticks(x, names)
    ax.set_title("rollout: worker bubble, slot bubble, driver-idle share", fontsize=9)
    ax.legend(fontsize=7)
    for ax, key, title in ((axes[1, 0], "reward", "reward over all trained samples (median, min-max)"),
                           (axes[1, 1], "final_accuracy", "final greedy eval accuracy (median, min-max)")):
        vals = [r[f"{key}_per_repeat"] for r in rows]
        med = [statistics.median(v) for v in vals]
        ax.bar(names, med, color=colors, yerr=[[m - min(v) for m, v in zip(med, vals)],
                                               [max(v) - m for m, v in zip(med, vals)]], capsize=4)
        ax.set_title(title, fontsize=9)
    ax = axes[1, 2]
    ax.set_title("staleness of trained samples (policy versions)", fontsize=9)
    top = max((int(k) for r in rows for k in r["staleness_hist"]), default=0)
    bottom = [0.0] * len(rows)
    for s in range(top + 1):
        frac = [r["staleness_hist"].get(str(s), 0) / max(1, sum(r["staleness_hist"].values())) for r in rows]
        ax.bar(names, frac, bottom=bottom, label=f"{s} behind", color=plt.cm.Blues(0.35 + 0.5 * s / max(1, top)))
        bottom = [b + f for b, f in zip(bottom, frac)]
    ax.legend(fontsize=7)
    for ax in axes.flat:
        ax.tick_params(axis="x", labelrotation=30, labelsize=7)
    s = result["setup"]
    fig.suptitle(f"Scheduling policies on real RL runs, tiny model on CPU ({s['machine']}, load {s['load_average']['median']:.1f}): "
                 f"{s['config']}, {s['prompts']} prompts x n={s['n']} x {s['epochs']} epochs, median of {s['repeats']} "
                 "seeds", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def write_markdown(result: dict, table: str, path: Path, stem: str) -> None:
    rows = {r["variant"]: r for r in result["rows"]}
    s, c = result["setup"], result["checks"]
    lines = [f"# Policy comparison on real RL runs (CPU): {s['preset']} preset", "",
             (f"Generated by `{s['command']}` ({s['machine']}, {s['date']}, {s['benchmark_s'] / 60:.0f} minutes); "
             f"figures in [{stem}.json]({stem}.json), plot in [{stem}.png]({stem}.png)."), "",
             (f"Workload: `{s['config']}` ({s['task']}, difficulty {s['min_difficulty']}..{s['max_difficulty']}), "
             f"{s['prompts']} training prompts, n={s['n']}, {s['epochs']} epochs, max response "
             f"{s['max_response_length']} tokens, {s['num_engines']} engine(s); in `sync`'s rounds the longest response "
             f"is {_f(s['sync_round_len_ratio'], '.1f')}x the median (median over rounds; >= 10x in "
             f"{100 * (s['sync_rounds_len_ratio_ge_10'] or 0):.0f}% of them), the longest of all "
             f"{s['sync_longest_response']} tokens. Every run starts from the same {s['warm_start']['steps']}-step "
             f"supervised warm start (pre-RL greedy accuracy {', '.join(f'{a:.3f}' for a in c['accuracy_before_rl'])})"
             f" and trains {', '.join(sorted({str(v) for v in c['trained_samples'].values()}))} samples. "
             f"{s['repeats']} interleaved repeats with seeds {s['seeds']}; medians with (min-max)."), "",
             (f"Machine: {s['machine_note']} Load average (1 min) at run starts and ends: median "
             f"{s['load_average']['median']:.1f}, range {s['load_average']['min']:.1f}-{s['load_average']['max']:.1f}."),
             "", table, ""]
    fit = result["train_step_fit"]
    if fit["r2"] is not None and fit["r2"] >= 0.5 and fit["fixed_ms"] >= 0:
        lines += [(f"The train step is mostly per-token work, not a fixed cost: over all {fit['steps']} steps, "
                   f"`time/train_s` = {fit['fixed_ms']:.0f} ms + {fit['us_per_token']:.0f} us x trained tokens "
                   f"(R^2 {fit['r2']:.2f}). The fixed part of an update is that intercept plus sync, history and "
                   "other."), ""]
    else:
        lines += [(f"A straight line through `time/train_s` against trained tokens over the {fit['steps']} steps "
                   f"does not separate a fixed part (R^2 {fit['r2'] or 0:.2f}): the machine's load varied more "
                   "than the batches did."), ""]
    if HEADLINE in rows:
        h = rows[HEADLINE]
        lines += [(f"**Headline**: twotier+HistoSpec {h['ms_per_sample_median']:.1f} ms per trained sample against "
                  f"{rows[BASELINE]['ms_per_sample_median']:.1f} ms for sync: **{h['speedup_vs_sync']:.2f}x** "
                  f"(range {h['speedup_vs_sync_min']:.2f}-{h['speedup_vs_sync_max']:.2f}x)."), ""]
    cap = result.get("ceiling")
    if cap:
        lines += [(f"**Ceiling on this machine** (`ceiling` in the JSON): after each sync run, its own "
                   f"{cap['per_sync_repeat'][0]['samples']} responses were generated again as one packed batch "
                   f"(same prompt and response lengths, submitted at once, longest first: the engine runs full until "
                   f"the queue drains), {cap['packed_ms_per_sample_median']:.1f} ms per sample against sync's "
                   f"{rows[BASELINE]['rollout_ms_per_sample']:.1f} ms of rollout. A policy that kept every slot busy "
                   f"and never waited for an update, with sync's train, sync and history time, would be "
                   f"**{cap['ceiling_median']:.2f}x** sync ({cap['ceiling_min']:.2f}-{cap['ceiling_max']:.2f}x over "
                   "sync's repeats): the most any plain scheduling policy can gain here."), ""]
    slower = [r["variant"] for r in result["rows"] if r["slower_than_sync_beyond_spread"]]
    lines += [(f"Slower than sync beyond the spread (its fastest repeat slower than sync's slowest): "
              f"{', '.join(slower) or 'none'}."), "",
              ("Columns: ms/sample = sum of `time/step_s` / trained samples; speed-up range pairs the variant's "
              "slowest repeat with sync's fastest and vice versa; worker bubble = mean `rollout/bubble_ratio`; "
              "driver idle = rollout-weighted mean `rollout/driver_idle_share`; rollout share = rollout phase / "
              "step time; staleness = mean policy versions behind; tokens/fwd = HistoSpec tokens per target "
              "forward; reward = mean over all trained samples; final acc = greedy held-out accuracy after the "
              "last step."), ""]
    path.write_text("\n".join(lines))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="longtail")
    ap.add_argument("--prompts", type=int, default=None, help="training prompts (default: the preset's)")
    ap.add_argument("--eval-prompts", type=int, default=None, help="held-out prompts of the final eval")
    ap.add_argument("--epochs", type=int, default=None, help="data.num_epochs (>= 2 gives HistoSpec a history)")
    ap.add_argument("--max-difficulty", type=int, default=None, help="data.max_difficulty (default: the config's)")
    ap.add_argument("--max-response-length", type=int, default=None, help="default: the config's")
    ap.add_argument("--warmup-steps", type=int, default=None, help="supervised warm-up steps (default: the preset's)")
    ap.add_argument("--mini-batch", type=int, default=0,
                    help="algorithm.ppo_mini_batch_size for every variant: the same optimizer steps for all (0: one "
                         "step per harvest, as the committed figures were measured)")
    ap.add_argument("--sft-prompts", type=int, default=0,
                    help="fresh problems of the warm-up (default: the config's trainer.warmup_sft_problems, else 2048)")
    ap.add_argument("--seed", type=int, default=0, help="seed of repeat 0; repeat r uses seed + r")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved repeats of every variant")
    ap.add_argument("--variants", default=None, help=f"comma list from {', '.join(VARIANTS)} (default: the preset's)")
    ap.add_argument("--warm-ckpt", type=Path, default=None,
                    help="warm-start trainer checkpoint to reuse (written there first unless warm_start.json is beside it)")
    ap.add_argument("--work-dir", type=Path, default=None, help="run dirs and logs (default: a temp dir)")
    ap.add_argument("--machine-note", default="", help="what else the machine was doing, for the setup block")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks")
    args = ap.parse_args()
    preset = PRESETS[args.preset]
    args.config = preset["config"]
    for key in ("prompts", "eval_prompts", "epochs", "variants", "warmup_steps"):
        if getattr(args, key) is None:
            setattr(args, key, preset[key])
    names = args.variants.split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown or BASELINE not in names or args.epochs < 1 or args.repeats < 1:
        print(f"error: --variants must name {BASELINE} and only {', '.join(VARIANTS)} (got {args.variants}); "
              "--epochs and --repeats must be >= 1", file=sys.stderr)
        return 2

    from benchmarks.run_log import RunLog
    from megatron_sortedrl.config import load_config
    from megatron_sortedrl.data import load_prompts

    cfg = load_config(ROOT / args.config, workload_overrides(args))
    work = (args.work_dir or Path(tempfile.mkdtemp(prefix="policy_comparison_"))).resolve()
    work.mkdir(parents=True, exist_ok=True)
    ckpt = (args.warm_ckpt or work / "warm_start" / "ckpt").resolve()
    print(f"work dir {work}", flush=True)
    # Finished runs are appended to runs.jsonl, so a benchmark stopped half-way (a crash, the OOM killer) goes on
    # where it stopped when started again with the same --work-dir.
    done = RunLog(work, ("variant", "repeat"), "python benchmarks/policy_comparison.py " + " ".join(sys.argv[1:]))
    runs: dict[str, list[dict]] = {n: [] for n in names}
    startups: dict[str, float] = {}
    warm: dict = json.loads((ckpt.parent / "warm_start.json").read_text()) \
        if (ckpt.parent / "warm_start.json").is_file() else {}
    # One driver per speculative setting (engines are built with or without the drafter);
    # within it the variants are interleaved repeat by repeat.
    groups = [[n for n in names if VARIANTS[n][1] == spec] for spec in (False, True)]
    try:
        for group in groups:
            todo = [(rep, n) for rep in range(args.repeats) for n in group if (n, rep) not in done]
            if not todo:
                continue
            session = Session(args, VARIANTS[group[0]][1], work)
            startups["speculative" if session.spec else "plain"] = round(session.startup_s, 1)
            try:
                if not warm:
                    print(f"warm-up ({session.cfg.trainer.warmup_sft_steps} supervised steps) -> {ckpt}", flush=True)
                    warm = session.warm_start(ckpt)
                    print(f"warm-up done in {warm['seconds']:.0f}s, loss {warm['final_loss']:.3f}", flush=True)
                for rep, name in todo:
                    r = session.run(name, rep, ckpt)
                    done.add({"variant": name, "repeat": rep, **r})
                    print(f"{name:18s} r{rep}: {r['steps']:3d} steps {r['trained_samples']} samples  "
                          f"{1e3 * r['s_per_sample_steps']:.1f} ms/sample  rollout {r['rollout_share']:.2f}  "
                          f"bubble {_f(r['bubble_ratio'], '.2f')}/{r['slot_bubble']:.2f}  idle "
                          f"{r['driver_idle_share']:.3f}  fixed {r['fixed_ms_per_update']:.0f} ms/update  reward "
                          f"{r['reward_mean']:.3f}  acc {r['accuracy_before_rl']:.3f} -> {r['final_eval_accuracy']:.3f}"
                          f"  ({r['process_s']:.0f}s, load {r['load_average'][0]:.1f}/{r['load_average'][1]:.1f})",
                          flush=True)
            finally:
                session.close()
        for n in names:
            runs[n] = [done[(n, rep)] for rep in range(args.repeats)]
    except RunFailed as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        done.finish()

    rows = [median_row(n, runs[n]) for n in names]
    add_ratios(rows)
    counts = {f"{n}/r{i}": runs[n][i]["trained_samples"] for n in names for i in range(len(runs[n]))}
    expected = args.prompts * cfg.rollout.n_samples_per_prompt * args.epochs
    before = sorted({r["accuracy_before_rl"] for n in names for r in runs[n]})
    loads = [x for n in names for r in runs[n] for x in r["load_average"]]
    sync_row = next(r for r in rows if r["variant"] == BASELINE)
    result = {
        "setup": {"command": done.setup()["command"], "starts": done.setup()["starts"],
                  "preset": args.preset, "config": args.config, "task": cfg.data.task,
                  "prompts": args.prompts, "eval_prompts": args.eval_prompts, "n": cfg.rollout.n_samples_per_prompt,
                  "epochs": args.epochs, "min_difficulty": cfg.data.min_difficulty,
                  "max_difficulty": cfg.data.max_difficulty, "max_response_length": cfg.rollout.max_response_length,
                  "num_engines": cfg.rollout.num_workers, "seeds": [args.seed + r for r in range(args.repeats)],
                  "repeats": args.repeats, "warm_start": warm, "driver_startup_s": startups,
                  "order": "one driver per speculative setting (plain variants, then HistoSpec ones, except runs "
                           "already in runs.jsonl from an earlier start); within a driver the variants are "
                           "interleaved repeat by repeat",
                  "sync_round_len_ratio": sync_row["round_len_ratio"],
                  "sync_rounds_len_ratio_ge_10": sync_row["rounds_len_ratio_ge_10"],
                  "sync_longest_response": sync_row["longest_response"],
                  "solution_len_median": statistics.median(len(p.solution) for p in load_prompts(cfg.data, "train")),
                  "machine": f"{platform.machine()} {os.cpu_count()} CPUs",
                  "machine_note": args.machine_note or "not given.",
                  "load_average": {"min": min(loads), "median": statistics.median(loads), "max": max(loads),
                                   "samples": loads},
                  "date": done.setup()["date"], "benchmark_s": done.setup()["benchmark_s"]},
        "train_step_fit": train_cost_fit([d for r in rows for d in r["run_dirs"]]),
        "ceiling": speedup_ceiling(runs[BASELINE]) if all("packed_replay" in r for r in runs[BASELINE]) else None,
        "checks": {"expected_trained_samples": expected, "trained_samples": counts,
                   "equal_sample_budget": all(v == expected for v in counts.values()),
                   "accuracy_before_rl": before, "identical_start": len(before) == 1},
        "rows": rows,
    }
    table = markdown_tables(rows)
    print(table)
    if not result["checks"]["equal_sample_budget"]:
        print(f"warning: trained sample counts differ from {expected}: {counts}", file=sys.stderr)
    if not result["checks"]["identical_start"]:
        print(f"warning: pre-RL eval accuracies differ across runs: {before}", file=sys.stderr)
    stem = preset["stem"]
    prev = args.out / f"{stem}.json"
    if not startups and prev.exists():  # nothing ran now (all runs resumed): keep the timing of the real runs
        old = json.loads(prev.read_text())["setup"]
        result["setup"].update({k: old[k] for k in ("driver_startup_s", "benchmark_s") if k in old})
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{stem}.json").write_text(json.dumps(result, indent=1) + "\n")
    write_markdown(result, table, args.out / f"{stem}.md", stem)
    plot(result, args.out / f"{stem}.png")
    print(f"wrote {args.out}/{stem}.{{json,md,png}}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
