"""The colocated plan against measured GPU memory, phase by phase, on one GPU (`make gpu-check` runs it).

    pytest tests/test_plan_colocated_gpu.py -m gpu -q -s      # needs an NVIDIA GPU; skipped elsewhere

A small Qwen2 (about 155M parameters) is planned colocated on this GPU (megatron_sortedrl/plan/colocated.py), then
each phase is built for real and measured:

- **update**: the trainer's state as the trainer keeps it: the model in bf16 on the GPU (transformers), an fp32
  main gradient per parameter (Megatron's grad buffer) and AdamW on fp32 master copies after one step (its two
  moments exist then). `torch.cuda.memory_allocated` must equal the plan's weights + gradients + optimizer
  within 3% (activations are left out here: tests/test_trainer_recompute.py and docs/benchmarks/
  plan_vs_measured.md check those);
- **offload**: everything to pinned host memory; what stays allocated must be under 64 MiB (the plan counts 0),
  and the copy must reach at least half of `plan.offload_gbs`'s default (25 GB/s);
- **switch**: the trainer's bf16 weights back, an engine's weights allocated and filled from them through two
  buckets (the handoff); the allocator's peak must be within 3% of the plan's switch phase less its residues;
- **rollout**: the engine's weights and the KV cache the plan gives it; the allocator's peak within 3% of the
  plan's rollout phase less the engine reserve and the trainer residue (CUDA graphs and the context are not
  allocator memory).

In every phase the device's used memory (`torch.cuda.mem_get_info`: total - free, so the CUDA context and the
allocator's cache count) must stay within the plan's phase total: the residues the plan assumes
(`TRAINER_IDLE_GIB`, `ENGINE_ASLEEP_GIB`, `plan.engine_reserve_gib`) must cover what this one process keeps.

Left out: a real vLLM engine's sleep and wake (its KV pool and CUDA graphs; tests/test_rollout_gpu.py runs the
engine) and a real Megatron step's activations, both measured elsewhere; two processes sharing the GPU (one
process stands in for the trainer and the engine here, so one CUDA context is counted where there are two).
"""

from __future__ import annotations

import time

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]

GIB = 2**30
SMALL = {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_size": 1024, "num_hidden_layers": 8,
         "num_attention_heads": 16, "num_key_value_heads": 4, "intermediate_size": 2816, "vocab_size": 32000,
         "max_position_embeddings": 4096, "tie_word_embeddings": False, "rms_norm_eps": 1e-6,
         "rope_theta": 10000.0, "torch_dtype": "bfloat16"}
TOL = 0.03


def _plan():
    from megatron_sortedrl.config import load_config
    from megatron_sortedrl.plan.arch import Arch
    from megatron_sortedrl.plan.planner import make_plan

    total_gib = torch.cuda.get_device_properties(0).total_memory / GIB
    cfg = load_config("configs/tiny_cpu.yaml", [
        "model.path=/nonexistent/colocated-gpu-test", "model.dtype=bfloat16", "cluster.device=gpu",
        f"cluster.gpu_memory_gib={total_gib}", "cluster.gpus_per_node=0", "parallel.tensor_model_parallel_size=1",
        "parallel.data_parallel_size=1", "parallel.pipeline_model_parallel_size=1",
        "parallel.use_distributed_optimizer=true", "rollout.num_workers=1", "rollout.tensor_parallel_size=1",
        "rollout.long_round_tensor_parallel_size=1", f"rollout.gpu_memory_utilization={8.0 / total_gib:.4f}",
        "trainer.micro_batch_tokens=2048", "parallel.recompute.granularity=full"])
    cfg.cluster.colocate = True  # set after load while the config refuses it (tests/test_plan_colocated.py)
    arch = Arch.from_dict(SMALL, name="small-qwen2")
    return cfg, make_plan(cfg, arch)


def _used() -> int:
    free, total = torch.cuda.mem_get_info()
    return total - free


def _near(measured: float, planned: float) -> None:
    assert abs(measured - planned) <= TOL * planned, f"measured {measured / GIB:.3f} GiB, planned {planned / GIB:.3f}"


def test_colocated_phases_match_measured_gpu_memory():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg, plan = _plan()
    st = plan.colocated["stages"][0]
    items = plan.trainer[0]["items"]
    dev = torch.device("cuda")
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()

    # update: bf16 model, fp32 main grads, AdamW on fp32 masters after one step.
    model = Qwen2ForCausalLM(Qwen2Config(**{k: v for k, v in SMALL.items() if k != "architectures"}))
    model = model.to(device=dev, dtype=torch.bfloat16)
    params = [p for p in model.parameters()]
    grads = [torch.zeros(p.shape, dtype=torch.float32, device=dev) for p in params]
    masters = [p.detach().float().clone().requires_grad_(True) for p in params]
    opt = torch.optim.AdamW(masters, lr=1e-6)
    for m, g in zip(masters, grads):
        m.grad = g  # the main gradient is the master's gradient (no second copy)
    opt.step()
    torch.cuda.synchronize()
    state = torch.cuda.memory_allocated() - base
    print(f"update: trainer state {state / GIB:.3f} GiB measured, {st['state'] / GIB:.3f} planned "
          f"(weights {items['weights'] / GIB:.3f}, gradients {items['gradients'] / GIB:.3f}, optimizer "
          f"{items['optimizer'] / GIB:.3f}); device used {_used() / GIB:.2f} GiB, plan's update phase "
          f"{st['totals']['update'] / GIB:.2f}")
    _near(state, st["state"])
    torch.cuda.empty_cache()  # the optimizer's freed temporaries: the context and live tensors remain
    assert _used() <= st["totals"]["update"]

    # offload: everything to pinned host memory (buffers allocated first: the trainer keeps them), timed.
    tensors = {"weights": params, "grads": grads, "masters": masters,
               "moments": [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.is_cuda]}
    host = {k: [torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True) for t in ts]
            for k, ts in tensors.items()}
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for k, ts in tensors.items():
        for h, t in zip(host[k], ts):
            h.copy_(t.detach(), non_blocking=True)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    nbytes = sum(t.numel() * t.element_size() for ts in host.values() for t in ts)
    del model, params, grads, masters, opt, tensors
    torch.cuda.empty_cache()
    left = torch.cuda.memory_allocated() - base
    gbs = nbytes / seconds / 1e9
    print(f"offload: {nbytes / GIB:.3f} GiB in {seconds:.3f} s = {gbs:.1f} GB/s (plan assumes "
          f"{plan.colocated['offload_gbs']:g}); left allocated {left / 2**20:.1f} MiB")
    assert left < 64 * 2**20
    assert gbs >= 0.5 * plan.colocated["offload_gbs"]

    # switch: trainer weights back, engine weights filled through two buckets.
    torch.cuda.reset_peak_memory_stats()
    weights = [t.to(dev, non_blocking=True) for t in host["weights"]]
    engine = [torch.empty_like(w) for w in weights]
    bucket_bytes = int(plan.colocated["buckets"] // 2)
    buckets = [torch.empty(bucket_bytes // 2, dtype=torch.bfloat16, device=dev) for _ in range(2)]
    for i, (w, e) in enumerate(zip(weights, engine)):
        flat, b = w.reshape(-1), buckets[i % 2]
        for start in range(0, flat.numel(), b.numel()):  # a tensor larger than a bucket goes in pieces
            n = min(b.numel(), flat.numel() - start)
            b[:n].copy_(flat[start:start + n])
            e.view(-1)[start:start + n].copy_(b[:n])
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    sw = st["phases"]["switch"]
    planned = st["totals"]["switch"] - sw["trainer residue"] - sw["engine residue (asleep)"]
    print(f"switch: peak {peak / GIB:.3f} GiB measured, {planned / GIB:.3f} planned (without residues); device used "
          f"{_used() / GIB:.2f} GiB, plan's switch phase {st['totals']['switch'] / GIB:.2f}")
    _near(peak, planned)
    torch.cuda.empty_cache()
    assert _used() <= st["totals"]["switch"]
    del weights, buckets
    torch.cuda.empty_cache()

    # rollout: the engine's weights (kept) and the KV cache the plan gives it.
    torch.cuda.reset_peak_memory_stats()
    ro = st["phases"]["rollout"]
    kv = torch.empty(int(ro["KV cache"]), dtype=torch.uint8, device=dev)
    kv.fill_(0)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    planned = st["totals"]["rollout"] - ro["engine reserve"] - ro["trainer residue"]
    print(f"rollout: peak {peak / GIB:.3f} GiB measured, {planned / GIB:.3f} planned (weights + KV); device used "
          f"{_used() / GIB:.2f} GiB, plan's rollout phase {st['totals']['rollout'] / GIB:.2f}")
    _near(peak, planned)
    assert _used() <= st["totals"]["rollout"]
    del kv, engine, host
