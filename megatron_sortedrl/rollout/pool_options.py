"""What a rollout pool is started with (`PoolOptions`, from a run config or by hand) and the small choices derived
from the config: the vLLM executor per engine, the engines' placement and HistoSpec's `speculative_config`.

Split out of `pool.py`, which holds the running pool; `PoolOptions` is also importable from `megatron_sortedrl.rollout`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from megatron_sortedrl.rollout.engine_worker import DEFAULT_EXTENSION
from megatron_sortedrl.rollout.weight_sync import DEFAULT_BUCKET_BYTES


@dataclass
class PoolOptions:
    model_path: str
    device: str = "cpu"  # cpu | gpu (resolved, not "auto")
    num_engines: int = 1
    tp: int = 1
    dtype: str = "float32"
    max_num_seqs: int = 64
    max_model_len: int | None = None
    seed: int = 0
    enforce_eager: bool = True
    gpu_memory_utilization: float = 0.5
    kv_cache_gib: float = 1.0
    speculative_config: dict | None = None
    worker_extension_cls: str = DEFAULT_EXTENSION
    cpus_per_rank: float = 1.0  # Ray CPUs reserved per TP rank on CPU machines
    cpu_bind: str = "spread"  # spread: engine k rank r on core (k*tp+r) % cores; auto: vLLM's NUMA binding
    request_timeout_s: float = 600.0
    poll_wait_s: float = 0.5
    restart_failed: bool = True
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    keep_weights: bool = True  # keep the last synced buckets in Ray's object store for relayout/restart
    # object_store: buckets through Ray + shared memory (any device); nccl | ipc: vLLM's GPU transfer engines
    # (the caller must hold a CUDA device); auto: object_store on CPU, ipc when colocated, else nccl.
    weight_transport: str = "auto"
    # pipelined: stages send at once, layer by layer, bounded shared memory; serial: the path before (to compare)
    weight_sync_mode: str = "pipelined"
    colocate: bool = False
    shared_placement: Any = None  # colocated: the trainer's bundles and GPUs (colocate/placement.SharedPlacement)
    # Placement: with gpus_per_node > 0 on GPU, engine e of TP t sits on layout GPUs first_gpu + e*t onwards,
    # i.e. on the nodes `python -m megatron_sortedrl layout` names; 0 places engines anywhere Ray packs them.
    gpus_per_node: int = 0
    first_gpu: int = 0
    startup_timeout_s: float = 900.0
    engine_extra: dict[str, Any] = field(default_factory=dict)  # more AsyncEngineArgs keywords
    # vLLM executor per engine: auto = uni for a CPU engine of TP 1 (docs/benchmarks/engine_executor.json), else mp
    executor: str = "auto"

    @classmethod
    def from_config(cls, cfg, **overrides: Any) -> PoolOptions:
        """Options from a `RunConfig` (short-round layout); `overrides` replace single fields.

        `max_model_len` is the longest prompt plus the longest response (checked against the model's positions
        when the config was loaded), not the model's `max_position_embeddings`, so a response is only ever cut
        by `max_tokens`; the rope scaling the trainer uses reaches the engines through `hf_overrides`."""
        import json
        from pathlib import Path

        import torch

        from megatron_sortedrl.rope import resolve_rope

        device = cfg.cluster.device
        if device == "auto":
            device = "gpu" if torch.cuda.is_available() else "cpu"
        hf_config = Path(cfg.model.path) / "config.json"
        shape = json.loads(hf_config.read_text()) if hf_config.is_file() else {}
        if shape:
            cfg.validate_context(shape)  # the model directory may have been built or replaced since loading
        rope = resolve_rope(shape, dict(cfg.model.rope_scaling), source=str(hf_config)) if shape else None
        opts = cls(model_path=cfg.model.path, device=device, num_engines=cfg.rollout.num_workers,
                   tp=cfg.rollout.tensor_parallel_size, dtype=cfg.rollout.dtype or cfg.model.dtype, max_num_seqs=cfg.rollout.max_num_seqs,
                   max_model_len=cfg.max_model_len, seed=cfg.seed, enforce_eager=cfg.rollout.enforce_eager,
                   gpu_memory_utilization=cfg.rollout.gpu_memory_utilization, kv_cache_gib=cfg.rollout.kv_cache_gib,
                   speculative_config=speculative_config_from(cfg.speculative),
                   request_timeout_s=cfg.rollout.request_timeout_s, colocate=cfg.cluster.colocate,
                   executor=cfg.rollout.executor)
        from megatron_sortedrl.rollout.engine_worker import capture_routed_experts

        opts.engine_extra.update(capture_routed_experts(cfg.rollout.return_routed_experts, cfg.algorithm.routing_replay,
                                                        shape, device, opts.speculative_config))
        opts.gpus_per_node, opts.first_gpu, opts.startup_timeout_s = engine_placement_from(cfg)
        if rope is not None and rope.hf_overrides():
            opts.engine_extra["hf_overrides"] = rope.hf_overrides()
        for key, value in overrides.items():
            setattr(opts, key, value)
        return opts


def executor_for(choice: str, device: str, tp: int) -> str:
    """The vLLM executor of one engine: `auto` runs a CPU engine of TP 1 in one process (`uni`: 1.22x the
    tokens/s of `mp` on 2 cores, docs/benchmarks/engine_executor.json) and every other engine with a worker
    process per rank (`mp`; GPU engines are unmeasured, so they keep it); `uni` asked for a TP > 1 layout (an
    elastic long round) falls back to `mp`, the only executor that can run it."""
    if choice == "auto":
        return "uni" if device == "cpu" and tp == 1 else "mp"
    return "mp" if tp > 1 else choice


def engine_placement_from(cfg) -> tuple[int, int, float]:
    """(gpus_per_node, first rollout GPU, start-up timeout) of a RunConfig, as the layout plans them."""
    from megatron_sortedrl.layout import rollout_first_gpu

    gpn = cfg.cluster.gpus_per_node
    return gpn, (rollout_first_gpu(cfg) if gpn else 0), cfg.cluster.startup_timeout_s


def speculative_config_from(spec) -> dict | None:
    """vLLM `speculative_config` for a `SpeculativeConfig` section (None when disabled); the mapping is
    HistoSpec's own (`speculative.proposer.vllm_speculative_config`), so there is one definition of it."""
    from speculative.proposer import vllm_speculative_config

    return vllm_speculative_config(spec)
