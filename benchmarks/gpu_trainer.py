"""GPU trainer benchmark: step throughput and MFU of a 0.5B-class Qwen2 at sequence 4k, against a plain
PyTorch loop on the same model, and NVML sampling of the training loop (sampler cost, utilization report).

    python benchmarks/gpu_trainer.py                       # one NVIDIA GPU; `make gpu-check` runs it
    python benchmarks/gpu_trainer.py --layers 4 --steps 3  # a quicker, smaller run
    python benchmarks/gpu_trainer.py --cpu-smoke --out-dir /tmp/x   # the script itself, tiny, on CPU

What it does, in one process on one GPU (world size 1, NCCL, no Ray):
1. writes a randomly initialised Qwen2 with Qwen2.5-0.5B's shape (24 layers, hidden 896, GQA 14/2 heads,
   SwiGLU 4864, vocabulary 151936, tied embeddings) as a Hugging Face directory;
2. times `--steps` optimizer steps of our trainer (`TrainerWorker`, bf16, distributed optimizer, Megatron's
   clipping; Transformer Engine spec when TE is installed, the local spec otherwise) on `--seqs` sequences
   of `--seq-len` tokens, one sequence per micro-batch (supervised loss: the RL loss costs the same
   forward/backward), interleaved step by step with the baseline: transformers' Qwen2ForCausalLM in bf16
   (SDPA attention) with torch's fused AdamW, the same micro-batches and gradient clipping (its loss covers
   every position, ours the response: the same FLOPs);
3. runs a short training loop (log-probs + train step per iteration, as the RL loop does) under the NVML
   sampler with timeline phases, renders the utilization report, and compares step time with the
   sampler on against the timed steps without it.

tokens/s = seqs x seq_len / step wall time (after `torch.cuda.synchronize`); medians with min and max over
the timed steps (the first `--warmup` steps of each variant are dropped). MFU = model FLOPs per step /
(step time x the device's dense bf16 peak): FLOPs = 3 x forward, forward = 2 x (linear weights incl. the
output layer) per token + causal attention 2 x seq x heads x head_dim per token per layer. No peak is known
for an unlisted device (MFU is then left out).

Writes docs/benchmarks/gpu_trainer.json and .png, and the report under docs/benchmarks/gpu_trainer_nvml/.
Left out: multi-GPU scaling (one lent GPU), recompute and sequence packing variants, and vLLM.
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tools"))

# Dense bf16 tensor-core peaks (FLOP/s) by a substring of the device name, most specific first.
PEAK_BF16 = (("H200", 989e12), ("H100 PCIe", 756e12), ("H100", 989e12), ("H800", 989e12), ("A100", 312e12),
             ("A800", 312e12), ("L40S", 362e12), ("L4", 121e12), ("A10G", 70e12), ("B200", 2250e12))
QWEN2_05B = {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
             "num_key_value_heads": 2, "vocab_size": 151936, "max_position_embeddings": 32768, "rope_theta": 1e6,
             "rms_norm_eps": 1e-6, "tie_word_embeddings": True}


def peak_flops(name: str) -> float | None:
    return next((v for k, v in PEAK_BF16 if k in name), None)


def _dims(cfg: dict) -> tuple[int, int, int, int, int]:
    h = cfg["hidden_size"]
    hd = h // cfg["num_attention_heads"]
    return h, cfg["intermediate_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"] * hd, \
        cfg["num_key_value_heads"] * hd


def num_params(cfg: dict) -> int:
    """Qwen2: qkv with bias, two RMSNorms per layer, a final norm, tied or untied output layer."""
    h, f, n_layers, q, kv = _dims(cfg)
    per_layer = h * q + 2 * h * kv + q + 2 * kv + q * h + 3 * h * f + 2 * h
    emb = cfg["vocab_size"] * h * (1 if cfg["tie_word_embeddings"] else 2)
    return n_layers * per_layer + emb + h


def flops_per_step(cfg: dict, seqs: int, seq_len: int) -> float:
    """Training FLOPs = 3 x forward; forward per token = 2 x linear weights (the output layer included)
    + causal attention (QK^T and AV over half the sequence on average: 2 x seq x q per layer)."""
    h, f, n_layers, q, kv = _dims(cfg)
    linear = n_layers * (h * q + 2 * h * kv + q * h + 3 * h * f) + cfg["vocab_size"] * h
    attention = n_layers * 2 * seq_len * q
    return 3.0 * seqs * seq_len * (2 * linear + attention)


# --cpu-smoke: a shape that runs the whole script in about a minute on a CPU (no figures about speed).
SMOKE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2,
         "num_key_value_heads": 1, "vocab_size": 512}


def write_model(out: Path, layers: int, smoke: bool = False) -> dict:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = {**QWEN2_05B, "num_hidden_layers": layers, **(SMOKE if smoke else {})}
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**cfg, torch_dtype="bfloat16")).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    del model
    return cfg


def stats(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs), "all": xs}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Baseline:
    """transformers' Qwen2 in bf16 with fused AdamW: the plain PyTorch loop we compare against."""

    def __init__(self, model_dir: Path, lr: float, clip: float, device: str, dtype: str):
        import torch
        import transformers
        from transformers import AutoModelForCausalLM

        major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
        key = "dtype" if (major, minor) >= (4, 56) else "torch_dtype"  # older versions ignore `dtype=`
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa",
                                                          **{key: getattr(torch, dtype)}).to(device).train()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr, fused=device == "cuda")
        self.clip = clip

    def step(self, batches) -> float:
        import torch

        total = 0.0
        for ids in batches:
            logits = self.model(ids[None]).logits[0, :-1].float()
            loss = torch.nn.functional.cross_entropy(logits, ids[1:]) / len(batches)
            loss.backward()
            total += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return total


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=24, help="transformer layers (24: the 0.5B shape)")
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--seqs", type=int, default=8, help="sequences per optimizer step (one per micro-batch)")
    ap.add_argument("--steps", type=int, default=6, help="timed steps per variant (after --warmup)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--loop-steps", type=int, default=5, help="iterations of the sampled training loop")
    ap.add_argument("--out-dir", default=str(REPO / "docs" / "benchmarks"))
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="tiny model, short sequences, CPU allowed: checks the script, measures nothing")
    args = ap.parse_args(argv)

    import torch

    if args.cpu_smoke:
        args.seq_len, args.seqs, args.steps, args.warmup, args.loop_steps = 64, 2, 1, 1, 1
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not args.cpu_smoke:
        print("gpu_trainer: no NVIDIA GPU visible (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    from gpu_check import environment

    from megatron_sortedrl.config import RunConfig
    from megatron_sortedrl.telemetry.nvml import NvmlSampler, read_samples
    from megatron_sortedrl.telemetry.report import render
    from megatron_sortedrl.telemetry.timeline import Event, RunClock, TimelineWriter
    from megatron_sortedrl.trainer.worker import TrainerWorker

    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="gpu_trainer_"))
    t0 = time.monotonic()
    model_cfg = write_model(work / "model", args.layers, smoke=args.cpu_smoke)
    print(f"model written in {time.monotonic() - t0:.0f} s", flush=True)

    cfg = RunConfig()
    cfg.model.path = str(work / "model")
    dtype = "bfloat16" if device == "cuda" else "float32"  # megatron-core's bf16 optimizer needs CUDA
    cfg.model.dtype = dtype
    cfg.cluster.device = "gpu" if device == "cuda" else "cpu"
    cfg.parallel.use_distributed_optimizer = device == "cuda"  # megatron-core refuses it on CPU
    cfg.trainer.micro_batch_tokens = args.seq_len
    cfg.trainer.grad_clip = 1.0
    cfg.trainer.warmup_sft_lr = 1e-5
    worker = TrainerWorker(cfg, 0, 1, "127.0.0.1", free_port())
    info = worker.setup()
    baseline = Baseline(work / "model", lr=1e-5, clip=1.0, device=device, dtype=dtype)

    g = torch.Generator().manual_seed(0)
    vocab = model_cfg["vocab_size"]
    seqs = [torch.randint(0, vocab, (args.seq_len,), generator=g) for _ in range(args.seqs)]
    prompt = min(64, args.seq_len // 4)  # the loss covers the response tokens
    items = [{"prompt": s[:prompt].tolist(), "response": s[prompt:].tolist()} for s in seqs]
    gpu_seqs = [s.to(device) for s in seqs]
    tokens = args.seqs * args.seq_len

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    def timed(fn) -> tuple[float, float]:
        sync()
        a = time.perf_counter()
        loss = fn()
        sync()
        return time.perf_counter() - a, loss

    times: dict[str, list[float]] = {"megatron": [], "baseline": []}
    losses: dict[str, list[float]] = {"megatron": [], "baseline": []}
    for i in range(args.warmup + args.steps):  # interleaved: both see the same machine state
        for name, fn in (("megatron", lambda: worker.train_step(items, "sft")["loss"]),
                         ("baseline", lambda: baseline.step(gpu_seqs))):
            dt, loss = timed(fn)
            print(f"step {i} {name}: {dt:.3f} s loss {loss:.4f}", flush=True)
            if i >= args.warmup:
                times[name].append(dt)
            losses[name].append(float(loss))
    mem_peak_gib = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None
    baseline = None  # frees its weights and optimizer state before the sampled loop
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()

    # The training loop under the NVML sampler, with phase events so the report draws its bands.
    run = out_dir / "gpu_trainer_nvml"
    clock = RunClock()
    sampler = NvmlSampler(work / "nvml" / f"{socket.gethostname()}.jsonl", clock=clock, interval_s=0.1)
    sampled = sampler.start()
    loop_times = []
    with TimelineWriter(work / "timeline.jsonl", clock=clock) as tl:
        time.sleep(1.0)  # an idle stretch before the loop, so the report shows the contrast
        for step in range(args.loop_steps):
            a = time.perf_counter()
            tl.write(Event(clock.now(), "phase", "start", step, phase="logprob"))
            worker.logprobs(items)
            sync()
            tl.write(Event(clock.now(), "phase", "end", step, phase="logprob"))
            tl.write(Event(clock.now(), "phase", "start", step, phase="train"))
            b = time.perf_counter()
            worker.train_step(items, "sft")
            sync()
            loop_times.append(time.perf_counter() - b)
            tl.write(Event(clock.now(), "phase", "end", step, phase="train"))
            print(f"loop {step}: {time.perf_counter() - a:.3f} s", flush=True)
    overhead = sampler.stop()
    report_summary: dict = {"sampled": sampled, "reason": sampler.unavailable_reason}
    if sampled:
        from megatron_sortedrl.telemetry.timeline import read_timeline

        samples = read_samples(work / "nvml" / f"{socket.gethostname()}.jsonl")
        rep = render(samples, read_timeline(work / "timeline.jsonl"), run, title="GPU trainer loop (NVML)")
        report_summary.update(html=str(rep.html.relative_to(REPO)) if rep.html.is_relative_to(REPO) else str(rep.html),
                              phases=[p.__dict__ for p in rep.summary], headline=rep.headline)
    worker.shutdown()

    meg, base = stats(times["megatron"]), stats(times["baseline"])
    peak = peak_flops(torch.cuda.get_device_name()) if device == "cuda" else None
    flops = flops_per_step(model_cfg, args.seqs, args.seq_len)
    result = {
        "benchmark": "gpu_trainer",
        "environment": environment(),
        "trainer": {"layer_spec": "transformer_engine" if info["use_te"] else "local", "dtype": dtype,
                    "distributed_optimizer": device == "cuda", "grad_clip": 1.0, "device": info["device"]},
        "cpu_smoke": args.cpu_smoke,
        "model": {**model_cfg, "params": num_params(model_cfg)},
        "workload": {"seqs_per_step": args.seqs, "seq_len": args.seq_len, "tokens_per_step": tokens,
                     "warmup_steps": args.warmup, "timed_steps": args.steps},
        "step_s": {"megatron": meg, "baseline": base},
        "tokens_per_s": {"megatron": tokens / meg["median"], "baseline": tokens / base["median"],
                         "megatron_min": tokens / meg["max"], "megatron_max": tokens / meg["min"]},
        "speedup_vs_baseline": base["median"] / meg["median"],
        "model_flops_per_step": flops,
        "peak_bf16_flops": peak,
        "mfu": {"megatron": flops / meg["median"] / peak, "baseline": flops / base["median"] / peak} if peak else None,
        "peak_memory_gib": mem_peak_gib,
        "losses": losses,
        "nvml": {"sampler": overhead,  # ms per sampled GPU row, measured inside the sampling thread
                 "ms_per_sample": 1000 * overhead["busy_s"] / overhead["rows"] if overhead["rows"] else None,
                 "train_step_s_sampled": stats(loop_times) if loop_times else None,
                 "sampled_vs_unsampled_step": statistics.median(loop_times) / meg["median"] if loop_times else None,
                 "report": report_summary},
        "machine_meanwhile": "nothing else ran on the lent GPU; the host ran only this process",
    }
    (out_dir / "gpu_trainer.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    plot(result, out_dir / "gpu_trainer.png")
    shutil.rmtree(work, ignore_errors=True)  # the written model (about 1 GB at the 0.5B shape)
    print(json.dumps({k: result[k] for k in ("tokens_per_s", "speedup_vs_baseline", "mfu")}, default=str))
    return 0


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    names = ["megatron", "baseline"]
    data = [result["step_s"][n]["all"] for n in names]
    ax1.boxplot(data)
    ax1.set_xticks([1, 2], ["our trainer", "transformers + AdamW"])
    ax1.set_ylabel("seconds per optimizer step")
    ax1.set_title(f"{result['workload']['tokens_per_step']} tokens/step, {result['environment'].get('device', 'CPU')}")
    tps = [result["workload"]["tokens_per_step"] / x for x in (result["step_s"][n]["median"] for n in names)]
    ax2.bar(["our trainer", "transformers + AdamW"], tps, color=["tab:blue", "tab:gray"])
    ax2.set_ylabel("tokens/s (median)")
    if result["mfu"]:
        for i, n in enumerate(names):
            ax2.text(i, tps[i], f"MFU {100 * result['mfu'][n]:.1f}%", ha="center", va="bottom")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
