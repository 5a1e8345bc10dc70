"""vLLM executor of a TP=1 rollout engine on CPU: `mp` (the model in a worker process of its own, fed through a
shared-memory queue) against `uni` (the model in the engine-core process), on a long-tail batch.

    PYTHONPATH=. .venv/bin/python benchmarks/engine_executor.py --repeats 3      # ~4 minutes on 2 cores

Why it matters on small machines: vLLM's shared-memory queue readers busy-wait (`sched_yield`) for a second
after every read, so with `mp` the engine core spins while the worker computes a step, and the worker spins
for a second after the last step of a round. On 2 cores that spinner takes the core the driver, the reward
workers and (after a round) the trainer would use. `uni` has no such hand-off.

Each repeat starts one pool per executor, in turn (interleaved), warms it, then generates one long-tail batch
(`--requests` requests at once, `ignore_eos`, lengths drawn once from a long-tail distribution: most 11-31
tokens, one in eight 200-500; the same lengths for both). Per run: wall time from submit to the last
completion, tokens/s, and the machine's busy CPU seconds over that wall time (from /proc/stat: what the
engine's processes and everything else burnt; idle spinning counts as busy). Writes
docs/benchmarks/engine_executor.{json,png}: per executor the median with min and max over repeats, and the
ratios `uni` over `mp`.

Measured (the committed JSON, 6 interleaved repeats): `uni` made the same tokens 1.22x faster (1.07-1.40x,
faster in every pair) with 0.83x the busy CPU seconds, so the pool's `rollout.executor: auto` picks it for
CPU engines of TP 1. Both keep the 2 cores busy for the whole batch: on 2 cores the rollout path alone
(engine core, model, the Ray actor streaming completions, the driver polling them) saturates the machine,
so anything run beside a round, such as a streamed backward, takes cycles from it.

Left out: TP > 1 (needs `mp`: one process per rank) and GPUs (vLLM picks `uni` itself for one GPU).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def busy_cpu_s() -> float:
    """Busy CPU seconds of the whole machine since boot (user + nice + system + irq + softirq + steal)."""
    fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def lengths(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(200, 500) if rng.random() < 0.125 else rng.randint(11, 31) for _ in range(n)]


def one_run(model: Path, executor: str, lens: list[int], prompt_tokens: int) -> dict:
    from megatron_sortedrl.rollout import GenRequest, PoolOptions, RolloutPool

    pool = RolloutPool(PoolOptions(model_path=str(model), device="cpu", max_num_seqs=len(lens),
                                   max_model_len=prompt_tokens + max(lens) + 8, poll_wait_s=0.02,
                                   executor=executor))
    try:
        prompt = [4 + (i % 90) for i in range(prompt_tokens)]
        pool.submit(GenRequest("warm", prompt, {"max_tokens": 8, "ignore_eos": True}), 0)
        list(pool.completions())
        reqs = [(GenRequest(f"r{i}", prompt, {"max_tokens": n, "ignore_eos": True}), 0)
                for i, n in enumerate(lens)]
        cpu0, t0 = busy_cpu_s(), time.monotonic()
        pool.submit_many(reqs)
        outs = list(pool.completions())
        wall, cpu = time.monotonic() - t0, busy_cpu_s() - cpu0
    finally:
        pool.shutdown()
    tokens = sum(len(c.tokens) for c in outs)
    if tokens != sum(lens):
        raise RuntimeError(f"{executor}: {tokens} tokens generated, {sum(lens)} asked for")
    return {"executor": executor, "wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall,
            "busy_cpu_s": cpu, "busy_cores": cpu / wall}


def summary(vals: list[float]) -> dict:
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="", help="HF model directory (default: build the tiny model in a temp dir)")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=56)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--machine-note", default="", help="what else the machine was doing")
    ap.add_argument("--out-dir", default=str(ROOT / "docs" / "benchmarks"))
    args = ap.parse_args(argv)

    import ray

    from megatron_sortedrl.tiny_model import build_tiny_model

    tmp = tempfile.TemporaryDirectory()
    model = Path(args.model) if args.model else build_tiny_model(Path(tmp.name) / "tiny")
    lens = lengths(args.requests, args.seed)
    ray.init(address="local", include_dashboard=False, num_cpus=2)
    runs: list[dict] = []
    loads = [os.getloadavg()[0]]
    try:
        for rep in range(args.repeats):
            for executor in (("mp", "uni") if rep % 2 == 0 else ("uni", "mp")):
                r = one_run(model, executor, lens, args.prompt_tokens)
                runs.append({"repeat": rep, **r})
                loads.append(os.getloadavg()[0])
                print(f"r{rep} {executor:3s}: {r['tokens']} tokens in {r['wall_s']:.2f} s = {r['tokens_per_s']:.0f} "
                      f"tokens/s, {r['busy_cores']:.2f} cores busy", flush=True)
    finally:
        ray.shutdown()

    keys = ("wall_s", "tokens_per_s", "busy_cores", "busy_cpu_s")
    per = {e: {k: summary([r[k] for r in runs if r["executor"] == e]) for k in keys} for e in ("mp", "uni")}
    pairs = [(next(r for r in runs if r["repeat"] == k and r["executor"] == "mp"),
              next(r for r in runs if r["repeat"] == k and r["executor"] == "uni")) for k in range(args.repeats)]
    result = {
        "what": "one TP=1 vLLM engine on CPU through RolloutPool, one long-tail batch per run: executor mp vs uni",
        "setup": {"command": "python benchmarks/engine_executor.py " + " ".join(sys.argv[1:] if argv is None else argv),
                  "requests": args.requests, "prompt_tokens": args.prompt_tokens, "lengths": lens,
                  "repeats": args.repeats, "order": "interleaved, the first executor alternating per repeat",
                  "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores", "machine_note": args.machine_note or "not given",
                  "load_average": loads, "vllm": __import__("vllm").__version__, "date": time.strftime("%Y-%m-%d")},
        "per_executor": per,
        "speedup_uni_vs_mp": summary([m["wall_s"] / u["wall_s"] for m, u in pairs]),
        "busy_cpu_ratio_uni_vs_mp": summary([u["busy_cpu_s"] / m["busy_cpu_s"] for m, u in pairs]),
        "runs": runs,
    }
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "engine_executor.json").write_text(json.dumps(result, indent=1) + "\n")
    plot(result, out / "engine_executor.png")
    s, c = result["speedup_uni_vs_mp"], result["busy_cpu_ratio_uni_vs_mp"]
    print(f"uni vs mp: {s['median']:.2f}x faster ({s['min']:.2f}-{s['max']:.2f}), busy CPU x{c['median']:.2f} "
          f"({c['min']:.2f}-{c['max']:.2f}); wrote {out / 'engine_executor.json'} and .png")
    return 0


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(8, 3.2))
    for ax, key, label in ((axes[0], "wall_s", "wall time of the batch (s)"), (axes[1], "busy_cores", "busy cores")):
        for i, e in enumerate(("mp", "uni")):
            vals = [r[key] for r in result["runs"] if r["executor"] == e]
            ax.scatter([i] * len(vals), vals, color=f"C{i}")
            ax.bar(i, statistics.median(vals), color=f"C{i}", alpha=0.4)
        ax.set_xticks([0, 1], ["mp", "uni"])
        ax.set_ylabel(label)
    fig.suptitle("TP=1 vLLM engine on CPU: executor (median bars, repeats as points)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
