"""Rollout engine benchmark: decode tokens/s of one vLLM engine at several batch sizes, and weight sync time.

    .venv/bin/python benchmarks/rollout_throughput.py --layout-switch       # tiny model, CPU, ~4 minutes
    .venv/bin/python benchmarks/rollout_throughput.py --model runs/tiny_model --batch-sizes 1 8 32 --max-tokens 256

Writes docs/benchmarks/rollout_throughput.json and .png (unless --out-dir says otherwise). Each batch is
submitted at once (ignore_eos, fixed length), so tokens/s = batch x max_tokens / wall time from submit to
the last completion, through the same pool the RL driver uses (Ray actor, streaming, log-probs on).
Weight sync: full HF-named tensors of the model from this process into the engine (median of --syncs).

Left out: prefill-heavy workloads, speculative decoding (the HistoSpec benchmark covers it) and GPUs
(the script runs there unchanged with --device gpu; report those numbers separately).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="", help="HF model directory (default: build the tiny model in a temp dir)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "gpu"])
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompt-tokens", type=int, default=16)
    ap.add_argument("--syncs", type=int, default=5)
    ap.add_argument("--layout-switch", action="store_true",
                    help="also time switching 1xTP1 -> 1xTP2 -> 1xTP1 (stop, start, weight replay; ~3 min on CPU)")
    ap.add_argument("--out-dir", default=str(Path(__file__).resolve().parent.parent / "docs" / "benchmarks"))
    args = ap.parse_args(argv)

    import ray
    import torch
    from safetensors.torch import load_file

    from megatron_sortedrl.rollout import GenRequest, PoolOptions, RolloutPool
    from megatron_sortedrl.tiny_model import build_tiny_model

    tmp = tempfile.TemporaryDirectory()
    model = Path(args.model) if args.model else build_tiny_model(Path(tmp.name) / "tiny")
    ray.init(address="local", include_dashboard=False, num_cpus=2 if args.device == "cpu" else None)
    t0 = time.monotonic()
    pool = RolloutPool(PoolOptions(model_path=str(model), device=args.device, max_num_seqs=max(args.batch_sizes),
                                   max_model_len=args.prompt_tokens + args.max_tokens + 8, poll_wait_s=0.1))
    start_s = time.monotonic() - t0
    try:
        prompt = [4 + (i % 90) for i in range(args.prompt_tokens)]
        # warm-up: first requests pay one-off allocation costs
        pool.submit(GenRequest("warm", prompt, {"max_tokens": 8, "ignore_eos": True}), 0)
        list(pool.completions())
        rows = []
        for bs in args.batch_sizes:
            reqs = [(GenRequest(f"b{bs}-{i}", prompt, {"max_tokens": args.max_tokens, "ignore_eos": True,
                                                       "seed": i}), 0) for i in range(bs)]
            t = time.monotonic()
            pool.submit_many(reqs)
            outs = list(pool.completions())
            wall = time.monotonic() - t
            tokens = sum(len(c.tokens) for c in outs)
            rows.append({"batch_size": bs, "tokens": tokens, "seconds": wall, "tokens_per_s": tokens / wall})
            print(f"batch {bs:4d}: {tokens} tokens in {wall:.2f} s = {tokens / wall:.0f} tokens/s", flush=True)

        state = load_file(str(next(model.glob("*.safetensors"))))
        syncs = []
        for v in range(1, args.syncs + 1):
            r = pool.sync_weights(iter(state.items()), version=v)
            syncs.append(r.to_dict())
        med = statistics.median(s["seconds"] for s in syncs)
        print(f"weight sync: {syncs[0]['bytes']} bytes, {syncs[0]['num_tensors']} tensors, median {med * 1e3:.1f} ms "
              f"over {len(syncs)} syncs ({syncs[0]['transport']})")
        switches = []
        if args.layout_switch:
            for n, tp in ((1, 2), (1, 1)):
                switches.append(pool.set_layout(n, tp))
                print(f"layout switch to {n}xTP{tp}: {switches[-1]['total_s']:.1f} s "
                      f"(engine start {switches[-1]['engine_start_s']:.1f} s, "
                      f"weight replay {switches[-1]['weight_load_s']:.2f} s)", flush=True)
    finally:
        pool.shutdown()
        ray.shutdown()

    result = {
        "what": "one vLLM rollout engine (TP=1) through RolloutPool: decode throughput and weight sync",
        "model": str(model) if args.model else "built-in tiny Qwen2 (hidden 128, 2 layers, vocab 128, float32)",
        "device": args.device, "machine": f"{platform.machine()}, {__import__('os').cpu_count()} CPU cores",
        "torch": torch.__version__, "vllm": __import__("vllm").__version__,
        "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens, "engine_start_s": start_s,
        "throughput": rows, "weight_sync": syncs, "weight_sync_median_s": med, "layout_switch": switches,
    }
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "rollout_throughput.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, out / "rollout_throughput.png")
    print(f"wrote {out / 'rollout_throughput.json'} and .png")
    return 0


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["throughput"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
    a.plot([r["batch_size"] for r in rows], [r["tokens_per_s"] for r in rows], "o-")
    a.set_xscale("log", base=2)
    a.set_xlabel("concurrent requests (batch size)")
    a.set_ylabel("decode tokens / s")
    a.set_title(f"one engine, {result['device']}, {result['max_tokens']} tokens each")
    a.grid(alpha=0.3)
    secs = [s["seconds"] * 1e3 for s in result["weight_sync"]]
    b.bar(range(1, len(secs) + 1), secs)
    b.axhline(result["weight_sync_median_s"] * 1e3, color="k", ls="--", lw=1, label="median")
    b.set_xlabel("sync #")
    b.set_ylabel("ms")
    mib = result["weight_sync"][0]["bytes"] / 2**20
    b.set_title(f"weight sync, {mib:.1f} MiB ({result['weight_sync'][0]['transport']})")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
