"""Trainer-rollout mismatch of a tiny Qwen3-MoE with and without rollout routing replay (R3), beside a dense tiny
Qwen3 of the same shape, on real RL steps at temperature 1 (CPU).

    PYTHONPATH=. .venv/bin/python benchmarks/moe_mismatch.py                    # ~25 min on 2 cores under load
    PYTHONPATH=. .venv/bin/python benchmarks/moe_mismatch.py --repeats 1 --prompts 16 --engine-dtypes bfloat16 \
        --variants dense,moe --warmup-steps 50                                  # a smoke run

Models (built here, random init, the character tokenizer; `build_models`): both are `tiny_model.qwen3_config`
(hidden 64, 2 layers, 4 query / 2 KV heads of 32, q/k norms); the MoE has 8 experts of width 32 with top-2
routing (active FFN width 64, total 256), the dense model a SwiGLU FFN of width 64, its MoE twin's active width
(same compute per token; the dense model is smaller in total parameters). The MoE router is left at the
transformers initialisation (std 0.02), not the tests' clear-cut scale, so routing has the near-ties real routers
have. Each model gets one supervised warm start on the arithmetic task (`configs/tiny_cpu.yaml`), shared by all
of its variants, then every run does RL from it: `scheduler.policy=sync` (on-policy: the log-probs compared come
from the same weights, so the mismatch is the engine's and the trainer's numerics, not staleness), rounds of 8
prompts x 4 samples = one update per step, temperature 1, weights synced to the engine after every step.

Variants (`VARIANTS`): `dense`, `moe` (R3 off) and `moe+r3` (`algorithm.routing_replay=true`, routes captured by
the engine and replayed by the trainer), each with the engine in bfloat16 (`rollout.dtype`, the usual GPU setting:
bf16 engines beside fp32 trainer weights) and in float32 (the trainer's dtype), the trainer in float32 always.
One driver (trainer + engine) per (variant, engine dtype), its `--repeats` runs (seed + r) in a row; the figures
are numerics, not timings, so the machine's load does not move them and runs need no interleaving across drivers.

Figures: the trainer logs, per step, over the trained tokens (algorithms.py `mismatch_terms`, log rho = trainer
log-prob - engine log-prob of the sampled token): `train/mismatch/logp_abs_diff` = mean |log rho|,
`train/mismatch/k3_kl` = mean rho - 1 - log rho (k3 estimate of KL(engine || trainer)) and
`train/mismatch/ratio_out_of_band` = share of tokens whose rho leaves [0.5, 2]; beside them `train/entropy`
(mismatch grows with entropy). A run's figure is the token-weighted mean over its steps (`run_summary`); a row
is the median over repeats with min and max (`summarize`). The verdict (`verdict`): per engine dtype and metric,
"R3 MoE mismatch <= dense" holds when moe+r3's median is at most dense's; `within_spread` when moe+r3's smallest
repeat is at most dense's largest. Once per model, the warm start also goes through the precision probe
(benchmarks/moe_precision_probe.py: transformers fp32 vs bf16 on the same tokens, how often bf16 flips a routing
decision and what replaying the flipped routes leaves): `precision_probe` in the JSON.

Left out: GPUs (the script runs there unchanged with `cluster.device=gpu`; see the .md for what CPU does not
reproduce), a bf16 trainer, many experts (128 of which 8, as Qwen3-30B-A3B), long responses.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# name -> (model, config keys of the variant)
VARIANTS = {
    "dense": ("dense", ("algorithm.routing_replay=false", "rollout.return_routed_experts=\"off\"")),
    "moe": ("moe", ("algorithm.routing_replay=false", "rollout.return_routed_experts=\"off\"")),
    "moe+r3": ("moe", ("algorithm.routing_replay=true", "rollout.return_routed_experts=auto")),
}
DTYPES = ("bfloat16", "float32")
METRICS = ("logp_abs_diff", "k3_kl", "ratio_out_of_band")
MOE_SHAPE = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
DENSE_SHAPE = {"intermediate_size": MOE_SHAPE["num_experts_per_tok"] * MOE_SHAPE["moe_intermediate_size"]}
ROUTER_STD = 0.02  # transformers' initializer_range


def build_models(work: Path) -> dict[str, Path]:
    """The two model directories (built once per work dir): `<work>/<model>/base_model`."""
    import torch
    from safetensors.torch import load_file, save_file

    from megatron_sortedrl.tiny_model import build_tiny_qwen3

    out = {}
    for name, moe, shape in (("dense", False, DENSE_SHAPE), ("moe", True, MOE_SHAPE)):
        d = work / name / "base_model"
        if not (d / "config.json").is_file():
            build_tiny_qwen3(d, moe=moe, seed=0, **shape)
            if moe:  # undo the tests' clear-cut router scale: real routers have near-ties
                f = d / "model.safetensors"
                w = load_file(f)
                g = torch.Generator().manual_seed(0)
                for k in w:
                    if k.endswith("mlp.gate.weight"):
                        w[k] = torch.randn(w[k].shape, generator=g) * ROUTER_STD
                save_file(w, f, metadata={"format": "pt"})
        out[name] = d
    return out


def run_keys(args, variant: str, dtype: str) -> list[str]:
    """The config keys of every run of one driver (beside what `Session.run_config` adds)."""
    return [f"data.num_train_prompts={args.prompts}", f"data.num_eval_prompts={args.eval_prompts}",
            f"data.max_difficulty={args.max_difficulty}",
            f"rollout.max_response_length={args.max_response_length}", "rollout.temperature=1.0",
            f"rollout.dtype={dtype}", "model.dtype=float32", "speculative.enabled=false",
            "scheduler.rollout_batch_size=8", "scheduler.update_batch_size=32", "scheduler.group_size=8",
            "logging.tensorboard=false", *VARIANTS[variant][1], *(args.set or [])]


def step_figures(row: dict) -> dict:
    """The mismatch figures of one metrics.jsonl step row."""
    out = {m: row.get(f"train/mismatch/{m}") for m in METRICS}
    out.update(step=row.get("step"), entropy=row.get("train/entropy"), n_tokens=row.get("train/n_tokens"),
               reward=row.get("reward/mean"), routed_share=row.get("rollout/routed_share"),
               pg_loss=row.get("train/pg_loss"), clip_frac=row.get("train/clip_frac"),
               replayed=row.get("train/routing_replay/replayed"))  # 1: the update replayed the engines' routes
    return out


def run_summary(steps: list[dict]) -> dict:
    """Token-weighted means over a run's steps (equal weights where a step has no token count)."""
    out = {}
    for key in (*METRICS, "entropy"):
        pairs = [(s[key], s.get("n_tokens") or 1.0) for s in steps if s.get(key) is not None]
        out[key] = sum(v * w for v, w in pairs) / sum(w for _, w in pairs) if pairs else None
    out["steps"] = len(steps)
    out["tokens"] = sum(s.get("n_tokens") or 0 for s in steps)
    for key in ("routed_share", "replayed"):
        vals = [s[key] for s in steps if s.get(key) is not None]
        out[key] = statistics.fmean(vals) if vals else None
    return out


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "per_repeat": values}


def summarize(runs: list[dict]) -> list[dict]:
    """One row per (engine dtype, variant): every figure's median, min and max over the repeats."""
    rows = []
    for dtype in DTYPES:
        for variant in VARIANTS:
            rs = sorted((r for r in runs if r["variant"] == variant and r["engine_dtype"] == dtype),
                        key=lambda r: r["repeat"])
            if not rs:
                continue
            row = {"variant": variant, "engine_dtype": dtype, "repeats": len(rs)}
            for key in (*METRICS, "entropy", "routed_share", "replayed"):
                vals = [r["summary"][key] for r in rs if r["summary"].get(key) is not None]
                row[key] = spread(vals) if vals else None
            row["steps"] = [r["summary"]["steps"] for r in rs]
            row["tokens"] = [r["summary"]["tokens"] for r in rs]
            row["accuracy_before_rl"] = [r.get("accuracy_before_rl") for r in rs]
            row["final_accuracy"] = [r.get("final_eval_accuracy") for r in rs]
            rows.append(row)
    return rows


def verdict(rows: list[dict]) -> dict:
    """Per engine dtype: for each metric, moe+r3 against dense (and what R3 bought against moe)."""
    out = {}
    for dtype in DTYPES:
        by = {r["variant"]: r for r in rows if r["engine_dtype"] == dtype}
        if "dense" not in by or "moe+r3" not in by:
            continue
        per = {}
        for m in METRICS:
            d, r3, off = by["dense"][m], by["moe+r3"][m], (by.get("moe") or {}).get(m)
            if d is None or r3 is None:
                continue
            per[m] = {"dense": d["median"], "moe_r3": r3["median"], "moe": off["median"] if off else None,
                      "r3_moe_le_dense": r3["median"] <= d["median"],
                      "within_spread": r3["min"] <= d["max"],
                      "r3_over_dense": r3["median"] / d["median"] if d["median"] else None,
                      "moe_over_r3": off["median"] / r3["median"] if off and r3["median"] else None}
        out[dtype] = {"metrics": per, "r3_moe_le_dense": bool(per) and all(v["r3_moe_le_dense"] for v in per.values())}
    return out


def markdown_table(rows: list[dict]) -> str:
    def f(d: dict | None, fmt: str) -> str:
        return "-" if d is None else f"{d['median']:{fmt}} ({d['min']:{fmt}}-{d['max']:{fmt}})"

    lines = ["| engine dtype | variant | mean abs log-ratio | k3 KL | ratio outside [0.5, 2] | entropy | routed share | "
             "replayed | steps x repeats |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['engine_dtype']} | {r['variant']} | {f(r['logp_abs_diff'], '.2e')} | {f(r['k3_kl'], '.2e')} "
                     f"| {f(r['ratio_out_of_band'], '.2e')} | {f(r['entropy'], '.3f')} | {f(r['routed_share'], '.2f')} | "
                     f"{f(r.get('replayed'), '.2f')} | {max(r['steps'])} x {r['repeats']} |")
    return "\n".join(lines)


def verdict_lines(v: dict) -> list[str]:
    lines = []
    for dtype, res in v.items():
        parts = [f"{m} {x['moe_r3']:.2e} vs dense {x['dense']:.2e}"
                 + (f" (R3 off: {x['moe']:.2e}, {x['moe_over_r3']:.1f}x the R3 figure)" if x.get("moe_over_r3") else "")
                 + ("" if x["r3_moe_le_dense"] else (" - worse, within the seed spread" if x["within_spread"]
                                                     else " - worse beyond the seed spread"))
                 for m, x in res["metrics"].items()]
        ok = "holds" if res["r3_moe_le_dense"] else "does not hold"
        lines.append(f"- engine {dtype}: **R3 MoE mismatch <= dense {ok}**: " + "; ".join(parts) + ".")
    return lines


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    fig, axes = plt.subplots(1, len(METRICS), figsize=(4.6 * len(METRICS), 4.2))
    colors = {"dense": "tab:gray", "moe": "tab:red", "moe+r3": "tab:blue"}
    dtypes = [d for d in DTYPES if any(r["engine_dtype"] == d for r in rows)]
    for ax, m in zip(axes, METRICS):
        for j, variant in enumerate(VARIANTS):
            for i, dtype in enumerate(dtypes):
                r = next((r for r in rows if r["variant"] == variant and r["engine_dtype"] == dtype), None)
                if r is None or r[m] is None:
                    continue
                x = i * (len(VARIANTS) + 1) + j
                med = r[m]["median"]
                ax.bar(x, med, color=colors[variant], label=variant if i == 0 else None)
                ax.errorbar(x, med, yerr=[[med - r[m]["min"]], [r[m]["max"] - med]], color="k", capsize=3)
        ax.set_xticks([i * (len(VARIANTS) + 1) + 1 for i in range(len(dtypes))], [f"engine {d}" for d in dtypes])
        if all(r[m] and r[m]["min"] > 0 for r in rows):  # a share of 0 has no log
            ax.set_yscale("log")
        ax.set_title(m, fontsize=9)
        ax.grid(alpha=0.3, axis="y")
    axes[0].legend(fontsize=8)
    s = result["setup"]
    fig.suptitle(f"Trainer-rollout mismatch, tiny Qwen3 dense vs MoE (8 experts, top-2), trainer fp32, temperature 1: "
                 f"median and range over {s['repeats']} seeds, {s['machine']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def markdown(result: dict, stem: str) -> str:
    s = result["setup"]
    lines = ["# Trainer-rollout mismatch: tiny MoE with and without routing replay, beside dense", "",
             f"Generated by `{s['command']}` ({s['machine']}, {s['date']}, {s['benchmark_s'] / 60:.0f} minutes); "
             f"figures in [{stem}.json]({stem}.json), plot in [{stem}.png]({stem}.png).", "",
             (f"Workload: `{s['config']}` ({s['task']}), {s['prompts']} training prompts x n={s['n']} per run, "
              f"`scheduler.policy=sync` (on-policy), one update of 32 samples per step, {s['epochs']} epoch(s), "
              f"temperature 1, max response {s['max_response_length']} tokens; trainer float32, engine dtype per "
              f"row. Models ({s['models'].get('shared', '')}): dense SwiGLU FFN of width "
              f"{DENSE_SHAPE['intermediate_size']}; MoE {MOE_SHAPE['num_experts']} experts of width "
              f"{MOE_SHAPE['moe_intermediate_size']}, top-{MOE_SHAPE['num_experts_per_tok']}, router initialised "
              f"with std {ROUTER_STD}. Warm starts: "
              + "; ".join(f"{m} {w.get('steps')} supervised steps, final loss {w.get('final_loss') or 0:.3f}"
                          for m, w in s["warm_start"].items())
              + f". Seeds {s['seeds']}; medians with (min-max) over repeats of the token-weighted mean over a "
              "run's steps."), "",
             (f"Machine: {s['machine_note']} Load average (1 min) at run starts and ends: median "
              f"{s['load_average'].get('median', 0):.1f}, range {s['load_average'].get('min', 0):.1f}-"
              f"{s['load_average'].get('max', 0):.1f}."), "",
             markdown_table(result["rows"]), "", "Verdict (`verdict` in the JSON):", "", *verdict_lines(result["verdict"]),
             ""]
    lines += probe_lines(result.get("precision_probe") or {})
    if result.get("reading"):
        lines += ["## Reading this run", "", result["reading"], ""]
    return "\n".join(lines)


def probe_lines(probes: dict) -> list[str]:
    """The precision probe's table (benchmarks/moe_precision_probe.py), one row per model."""
    if not probes:
        return []

    def g(x, fmt=".2e"):
        return "-" if x is None else f"{x:{fmt}}"

    lines = ["Precision probe (`precision_probe` in the JSON; benchmarks/moe_precision_probe.py): each warm start in "
             "transformers, float32 against bfloat16, teacher-forced on the held-out prompts' reference solutions, "
             "no engines:", "",
             "| model | mean abs log-ratio | max | routing decisions flipped | response tokens with a flip | "
             "on those / the others | with the bf16 routes replayed: all / flipped tokens |", "|---|---|---|---|---|---|---|"]
    for name, p in probes.items():
        lines.append(f"| {name} | {g(p['logp_abs_diff'])} | {g(p['logp_abs_diff_max'], '.3f')} | "
                     f"{g(p.get('flip_share'), '.2%')} | {g(p.get('token_flip_share'), '.2%')} | "
                     f"{g(p.get('logp_abs_diff_flipped'))} / {g(p.get('logp_abs_diff_unflipped'))} | "
                     f"{g(p.get('logp_abs_diff_replayed'))} / {g(p.get('logp_abs_diff_replayed_flipped'))} |")
    return lines + [""]


def one_run(session, name: str, rep: int, dtype: str, ckpt: Path) -> dict:
    fig = session.run(f"{name}_{dtype}", rep, ckpt, variant=("sync", False, False), replay=False)
    rows = [json.loads(x) for x in (Path(fig["run_dir"]) / "metrics.jsonl").read_text().splitlines() if x.strip()]
    steps = [step_figures(r) for r in rows if "time/step_s" in r]
    return {"variant": name, "engine_dtype": dtype, "repeat": rep, "seed": session.args.seed + rep, "steps": steps,
            "summary": run_summary(steps), "load_average": fig["load_average"], "process_s": fig["process_s"],
            "accuracy_before_rl": fig["accuracy_before_rl"], "final_eval_accuracy": fig["final_eval_accuracy"],
            "reward_mean": fig["reward_mean"]}


def run_probe(d, ckpt: Path, model_dir: Path) -> dict:
    """The warm start's bf16-vs-fp32 decomposition (benchmarks/moe_precision_probe.py) on the held-out prompts
    followed by their reference solutions, written to `<model_dir>/probe.json`."""
    from benchmarks.moe_precision_probe import probe

    d.trainer.load_checkpoint(ckpt)
    hf = d.trainer.export_hf_weights(model_dir / "warm_hf")
    prompts = [list(d._tokens(p)) for p in d.eval_prompts]
    seqs = [t + d.tok(p.solution)["input_ids"] + [d.eos] for t, p in zip(prompts, d.eval_prompts)]
    out = probe(hf, seqs, [len(t) for t in prompts])
    (model_dir / "probe.json").write_text(json.dumps(out, indent=1))
    print(f"precision probe of {model_dir.name}: {out}", flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/tiny_cpu.yaml")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--engine-dtypes", default=",".join(DTYPES))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0, help="seed of repeat 0; repeat r uses seed + r")
    ap.add_argument("--max-difficulty", type=int, default=2, help="data.max_difficulty (digits)")
    ap.add_argument("--prompts", type=int, default=48, help="training prompts per run (8 per step: prompts/8 steps)")
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--eval-prompts", type=int, default=32)
    ap.add_argument("--max-response-length", type=int, default=96)
    ap.add_argument("--warmup-steps", type=int, default=600, help="supervised warm-up steps per model")
    ap.add_argument("--sft-prompts", type=int, default=2048)
    ap.add_argument("--set", action="append", help="extra config key=value for every run (repeatable)")
    ap.add_argument("--work-dir", type=Path, default=None)
    ap.add_argument("--machine-note", default="")
    ap.add_argument("--reading", type=Path, default=None, help="a markdown file with the reading, put into the .md")
    ap.add_argument("--stem", default="moe_mismatch")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks")
    args = ap.parse_args()
    names, dtypes = args.variants.split(","), args.engine_dtypes.split(",")
    if any(n not in VARIANTS for n in names) or any(d not in DTYPES for d in dtypes) or args.repeats < 1 \
            or args.prompts < 8 or args.prompts % 8:
        print(f"error: --variants from {', '.join(VARIANTS)} (got {args.variants}), --engine-dtypes from "
              f"{', '.join(DTYPES)} (got {args.engine_dtypes}), --repeats >= 1, --prompts a multiple of 8",
              file=sys.stderr)
        return 2

    from benchmarks.policy_comparison import RunFailed, Session
    from benchmarks.run_log import RunLog
    from megatron_sortedrl.config import load_config

    work = (args.work_dir or Path(tempfile.mkdtemp(prefix="moe_mismatch_"))).resolve()
    work.mkdir(parents=True, exist_ok=True)
    build_models(work)  # <work>/<model>/base_model, which Session.run_config names as model.path
    # finished runs; a restarted benchmark with the same --work-dir goes on
    done = RunLog(work, ("variant", "engine_dtype", "repeat"),
                  "python benchmarks/moe_mismatch.py " + " ".join(sys.argv[1:]))
    print(f"work dir {work}", flush=True)
    warm, startups = {}, {}
    try:
        for dtype in dtypes:
            for name in names:
                todo = [rep for rep in range(args.repeats) if (name, dtype, rep) not in done]
                if not todo:
                    continue
                model = VARIANTS[name][0]
                sargs = SimpleNamespace(**vars(args))
                session = Session(sargs, False, work / model, overrides=lambda a, n=name, d=dtype: run_keys(a, n, d))
                startups[f"{name}/{dtype}"] = round(session.startup_s, 1)
                try:
                    ckpt = work / model / "warm_start" / "ckpt"
                    info = ckpt.parent / "warm_start.json"
                    if not info.is_file():
                        print(f"warm-up of {model} ({args.warmup_steps} supervised steps)", flush=True)
                        session.warm_start(ckpt)
                    warm[model] = json.loads(info.read_text())
                    if not (work / model / "probe.json").is_file():
                        run_probe(session.driver, ckpt, work / model)
                    for rep in todo:
                        rec = one_run(session, name, rep, dtype, ckpt)
                        done.add(rec)
                        sm = rec["summary"]
                        print(f"{name:7s} {dtype:8s} r{rep}: {sm['steps']} steps {sm['tokens']} tokens  |logr| "
                              f"{sm['logp_abs_diff']:.3e}  k3 {sm['k3_kl']:.3e}  out {sm['ratio_out_of_band']:.3e}  "
                              f"entropy {sm['entropy']:.3f}  ({rec['process_s']:.0f}s)", flush=True)
                finally:
                    session.close()
    except RunFailed as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        done.finish()
    for model in ("dense", "moe"):
        info = work / model / "warm_start" / "warm_start.json"
        if model not in warm and info.is_file():
            warm[model] = json.loads(info.read_text())
    probes = {m: json.loads((work / m / "probe.json").read_text()) for m in ("dense", "moe")
              if (work / m / "probe.json").is_file()}
    runs = [done[(n, d, rep)] for d in dtypes for n in names for rep in range(args.repeats)]
    rows = summarize(runs)
    cfg = load_config(ROOT / args.config, run_keys(args, names[0], dtypes[0]))
    loads = [x for r in runs for x in r["load_average"]]
    result = {
        "setup": {"command": done.setup()["command"], "starts": done.setup()["starts"], "config": args.config,
                  "task": cfg.data.task, "prompts": args.prompts, "n": cfg.rollout.n_samples_per_prompt,
                  "epochs": args.epochs, "max_response_length": args.max_response_length, "repeats": args.repeats,
                  "seeds": [args.seed + r for r in range(args.repeats)], "variants": names, "engine_dtypes": dtypes,
                  "models": {"dense": {"qwen3_config": DENSE_SHAPE}, "moe": {"qwen3_config": MOE_SHAPE,
                                                                               "router_init_std": ROUTER_STD},
                             "shared": "hidden 64, 2 layers, 4 heads / 2 KV heads of 32, q/k norms"},
                  "warm_start": {m: {k: w.get(k) for k in ("steps", "final_loss", "seconds")} for m, w in warm.items()},
                  "driver_startup_s": startups, "machine": f"{platform.machine()} {os.cpu_count()} CPUs",
                  "machine_note": args.machine_note or "not given.",
                  "load_average": {"min": min(loads), "median": statistics.median(loads), "max": max(loads)},
                  "date": done.setup()["date"], "benchmark_s": done.setup()["benchmark_s"]},
        "rows": rows, "verdict": verdict(rows), "precision_probe": probes, "runs": runs,
    }
    prev = args.out / f"{args.stem}.json"
    if not startups and prev.is_file():  # nothing ran now (all runs resumed): keep the timing of the real runs
        old = json.loads(prev.read_text())["setup"]
        result["setup"].update({k: old[k] for k in ("driver_startup_s", "benchmark_s") if k in old})
    if args.reading and args.reading.is_file():
        result["reading"] = args.reading.read_text().strip()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.stem}.json").write_text(json.dumps(result, indent=1) + "\n")
    (args.out / f"{args.stem}.md").write_text(markdown(result, args.stem))
    plot(result, args.out / f"{args.stem}.png")
    print((args.out / f"{args.stem}.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
