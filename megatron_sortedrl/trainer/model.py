"""Megatron-core GPTModel built from a Hugging Face config (Qwen2 / Qwen2.5, Llama-3, Qwen3, Qwen3-MoE).

    from megatron_sortedrl.trainer.model import read_hf_config, build_model
    arch = read_hf_config("runs/tiny_model")
    model = build_model(arch, dtype=torch.float32, use_te=False)   # after parallel_state is initialised

This module knows nothing about parallelism beyond what Megatron's own layers need: it maps the HF config
to a `TransformerConfig` (RMSNorm, SwiGLU, RoPE with the model's base and scaling, grouped-query
attention, Qwen2's qkv bias, Qwen3's per-head q/k RMSNorm and explicit head_dim, Qwen3-MoE's routed experts
(`trainer/moe.py`: router, top-k, aux/z losses, expert parallelism), tied or untied embeddings, activation
recompute from `parallel.recompute`, Megatron's fused kernels on GPU where `trainer/kernels.py` found
them working) and picks the layer spec: the local spec (pure torch, RMSNorm via torch, sequence parallelism
allowed) on CPU and the Transformer Engine spec on GPU where TE works (`kernels.probe_transformer_engine`). The two specs name parameters
differently; `weights.py` knows both, and checkpoints load across them (`checkpoint.py`).

RoPE: the frequencies are Hugging Face's (`rope_inv_freq` reproduces `transformers.modeling_rope_utils` for
default, linear, llama3 and yarn; a test compares them) and replace Megatron's after the model is built.
YaRN also scales cos/sin by its attention factor (0.1 ln(factor) + 1 unless the config states one); Megatron's
attention applies that factor when the config carries `yarn_*` fields, which `build_model` sets. The rope
comes from config.json unless `model.rope_scaling` overrides it (`megatron_sortedrl.rope`), the same
dictionary the engines get.

Deliberately left out: sliding-window attention, latent attention (MLA), shared experts and learned absolute
positions (`convert/architectures.check_architecture` refuses configs that use them); dynamic NTK and other rope
types are rejected with a clear error (see `rope.py`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from megatron_sortedrl.errors import ConfigError, UserError
from megatron_sortedrl.rope import resolve_rope


@dataclass
class HFArch:
    """The parts of a Hugging Face config the trainer needs (read once, picklable, no transformers import)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int  # positions the model supports under its rope scaling (see rope.py)
    tie_word_embeddings: bool
    qkv_bias: bool
    rope_scaling: dict[str, Any] = field(default_factory=dict)
    raw: dict[str, Any] = field(default_factory=dict)  # the full config.json, for rope init functions
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on every q and k head (Megatron's qk_layernorm)
    num_experts: int = 0  # routed experts per MoE layer; 0: a dense model
    moe_topk: int = 0  # experts per token
    moe_ffn_size: int = 0  # FFN size of one expert
    norm_topk_prob: bool = False  # renormalise the top-k probabilities to sum to 1 (Qwen3-MoE: true)
    moe_layers: tuple[bool, ...] = ()  # per layer: MoE (True) or dense MLP (False); () when dense

    def is_moe_layer(self, i: int) -> bool:
        return bool(self.moe_layers) and self.moe_layers[i]


def read_hf_config(model_dir: str | Path, rope_override: dict[str, Any] | None = None) -> HFArch:
    """The architecture of a HF model directory; `rope_override` (model.rope_scaling) replaces its rope scaling."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise UserError(f"model directory {model_dir} has no config.json (set model.path to a Hugging Face model dir)")
    cfg = json.loads(path.read_text())
    from megatron_sortedrl.convert.architectures import EXPERT_KEYS, MODELLED, check_architecture, moe_layer_indices

    check_architecture(cfg, str(path))  # the same line as `plan` and `convert`
    model_type = cfg["model_type"]
    traits = MODELLED[model_type][1]
    try:  # transformers >= 5 writes `rope_parameters`; older files rope_theta / rope_scaling
        rope = resolve_rope(cfg, dict(rope_override or {}), source=str(path))
    except ConfigError as err:
        raise UserError(str(err)) from None
    heads = cfg["num_attention_heads"]
    layers = cfg["num_hidden_layers"]
    experts = next((int(cfg[k]) for k in EXPERT_KEYS if cfg.get(k)), 0) if traits["moe"] else 0
    # Qwen3-MoE: some layers are dense MLPs of intermediate_size (decoder_sparse_step, mlp_only_layers)
    sparse = set(moe_layer_indices(cfg))
    moe_layers = tuple(i in sparse for i in range(layers)) if experts else ()
    return HFArch(
        model_type=model_type,
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=rope.rope_theta,
        max_position_embeddings=rope.max_positions,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=traits["qkv_bias"] or bool(cfg.get("attention_bias", False)),
        rope_scaling=dict(rope.params),
        raw=cfg,
        qk_norm=traits["qk_norm"],
        num_experts=experts,
        moe_topk=int(cfg.get("num_experts_per_tok") or 0) if experts else 0,
        moe_ffn_size=int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"]) if experts else 0,
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)) if experts else False,
        moe_layers=moe_layers,
    )


def padded_vocab_size(arch: HFArch, tp: int) -> int:
    """Vocabulary rounded up so every TP rank holds an equal slice (padding logits are masked out)."""
    return -(-arch.vocab_size // tp) * tp


def rope_inv_freq(arch: HFArch) -> torch.Tensor:
    """Inverse RoPE frequencies exactly as Hugging Face computes them (base, linear, llama3 or yarn scaling)."""
    dim = arch.head_dim
    inv = 1.0 / (arch.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    rs = arch.rope_scaling
    kind = rs.get("rope_type", "default")
    if kind == "linear":
        inv = inv / float(rs["factor"])
    elif kind == "llama3":
        factor, lo, hi = float(rs["factor"]), float(rs["low_freq_factor"]), float(rs["high_freq_factor"])
        old = float(rs["original_max_position_embeddings"])
        wavelen = 2 * torch.pi / inv
        scaled = torch.where(wavelen > old / lo, inv / factor, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old / hi) & ~(wavelen > old / lo)
        inv = torch.where(medium, smoothed, scaled)
    elif kind == "yarn":
        inv = _yarn_inv_freq(arch, inv)
    return inv


def recompute_kwargs(recompute, layers_per_stage: int) -> dict[str, Any]:
    """Megatron's recompute arguments for a `parallel.recompute` section (None or granularity none: off).

    `auto` is resolved to a concrete granularity by the launch planner before the trainer is built; a
    config that still says `auto` here was not planned (tests, hand-built configs) and gets no recompute.
    """
    granularity = getattr(recompute, "granularity", "none")
    if granularity in ("none", "auto"):
        return {}
    if granularity == "selective":
        # Megatron's default recompute_modules (["core_attn"]): the attention core's softmax/probs are
        # recomputed, the projections' inputs are kept.
        return {"recompute_granularity": "selective"}
    # Megatron wants 1 <= num_layers <= layers of this stage; a larger value means "every layer".
    return {"recompute_granularity": "full", "recompute_method": recompute.method,
            "recompute_num_layers": max(1, min(recompute.num_layers, layers_per_stage))}


def kernel_fusions(on_gpu: bool, probes=None) -> dict[str, bool]:
    """Megatron's fused-kernel flags: on a GPU each one exactly where its kernel was probed to work
    (`trainer/kernels.py`: Apex's softmax, torch.compile with a compiler, TE's RoPE, Apex's weight-gradient
    accumulation); all off on CPU. `probes` (a `KernelProbes`) defaults to this process's cached probe of
    the current CUDA device."""
    from megatron_sortedrl.trainer.kernels import FUSION_FLAGS, probe_kernels

    if not on_gpu:
        return dict.fromkeys(FUSION_FLAGS, False)
    if probes is None:
        probes = probe_kernels(f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cuda")
    return probes.fusions()


def _yarn_inv_freq(arch: HFArch, inv_extra: torch.Tensor) -> torch.Tensor:
    """YaRN (arXiv 2309.00071) as `transformers` computes it: interpolate (divide by `factor`) the dimensions
    that rotate fewer than `beta_slow` times over the original context, keep those that rotate more than
    `beta_fast` times, and blend linearly between the two correction dimensions."""
    rs, dim, base = arch.rope_scaling, arch.head_dim, arch.rope_theta
    factor = float(rs["factor"])
    original = float(rs["original_max_position_embeddings"])
    beta_fast, beta_slow = rs.get("beta_fast") or 32, rs.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rs.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers does: no zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp  # 1: extrapolate (original frequency), 0: interpolate
    return (inv_extra / factor) * (1 - keep) + inv_extra * keep


def rope_attention_factor(arch: HFArch) -> float:
    """The factor YaRN multiplies cos/sin by (1.0 for the other types), as `transformers` computes it."""
    rs = arch.rope_scaling
    if rs.get("rope_type") != "yarn":
        return 1.0
    if rs.get("attention_factor") is not None:
        return float(rs["attention_factor"])
    factor = float(rs["factor"])

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if rs.get("mscale") and rs.get("mscale_all_dim"):
        return mscale(factor, float(rs["mscale"])) / mscale(factor, float(rs["mscale_all_dim"]))
    return mscale(factor)


def transformer_config(arch: HFArch, dtype: torch.dtype, *, tp: int = 1, pp: int = 1,
                       sequence_parallel: bool = False, on_gpu: bool = False, recompute=None,
                       fusions: dict[str, bool] | None = None, moe=None, ep: int = 1, etp: int | None = None,
                       use_te: bool | None = None):
    """Megatron's config for `arch`; `fusions` (flag -> on) overrides `kernel_fusions(on_gpu)`. `moe` (a
    `trainer.moe.MoESettings`, default: its defaults), `ep`, `etp` (None: `tp`) and `use_te` (default:
    `on_gpu`; grouped expert GEMMs need it) only matter for an MoE model."""
    from megatron.core.transformer import TransformerConfig

    from megatron_sortedrl.trainer.moe import moe_config_kwargs, needs_sequence_parallel

    # Megatron's MoE layer refuses to train at TP > 1 without sequence parallelism (its dispatcher expects
    # each TP rank to hold only its own tokens); an MoE model turns it on there.
    sequence_parallel = sequence_parallel or needs_sequence_parallel(arch, tp)
    return TransformerConfig(
        **recompute_kwargs(recompute, arch.num_layers // pp),
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        ffn_hidden_size=arch.intermediate_size,
        num_attention_heads=arch.num_heads,
        num_query_groups=arch.num_kv_heads,
        kv_channels=arch.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=arch.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        qk_layernorm=arch.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        attention_softmax_in_fp32=True,
        apply_query_key_layer_scaling=False,
        **(kernel_fusions(on_gpu) if fusions is None else fusions),
        use_cpu_initialization=not on_gpu,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        sequence_parallel=sequence_parallel and tp > 1,
        variable_seq_lengths=True,  # micro-batches are padded to their own length, not a global maximum
        # alltoall: the dispatcher for expert parallelism (and what variable_seq_lengths needs on a dense model)
        moe_token_dispatcher_type="alltoall",
        **moe_config_kwargs(arch, moe, on_gpu=on_gpu, use_te=on_gpu if use_te is None else use_te, ep=ep,
                            etp=etp, tp=tp),
        deallocate_pipeline_outputs=on_gpu,
        calculate_per_token_loss=False,
    )


class LocalRMSNorm(torch.nn.RMSNorm):
    """torch's RMSNorm behind Megatron's norm constructor, usable with sequence parallelism.

    Megatron's own torch wrapper (`WrappedTorchNorm`) refuses sequence parallelism although RMSNorm is
    per token: on a sequence shard it computes exactly the rows of the full-sequence norm. What sequence
    parallelism does need is that the weight's gradient, which each TP rank only has for its own tokens,
    is summed across TP; Megatron's `finalize_model_grads` does that for parameters marked
    `sequence_parallel`, as its fused norms mark theirs."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_unused):
        if config.normalization != "RMSNorm":
            raise ValueError(f"LocalRMSNorm only implements RMSNorm, not {config.normalization}")
        super().__init__(hidden_size, eps=eps)
        self.weight.sequence_parallel = config.sequence_parallel


def layer_spec(use_te: bool, config):
    """Transformer Engine spec on GPU (fused norms in linear_qkv / linear_fc1), local spec on CPU.

    Either comes back as a whole block for this pipeline stage (`config` is the model's TransformerConfig):
    MoE models mix MoE and dense layers (`config.moe_layer_freq`), and the local spec's norms, q/k norms
    included, are all `LocalRMSNorm`."""
    from megatron.core.models.gpt import gpt_layer_specs as specs
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        get_num_layers_to_build,
        get_transformer_layer_offset,
    )

    if use_te and not config.num_moe_experts and not config.qk_layernorm:
        return specs.get_gpt_layer_with_transformer_engine_spec()
    if use_te:
        return specs.get_gpt_decoder_block_spec(config, use_transformer_engine=True, normalization="RMSNorm")
    pattern = config.moe_layer_freq if isinstance(config.moe_layer_freq, list) else [0] * config.num_layers
    offset = get_transformer_layer_offset(config)
    kinds = {}  # one spec object per kind of layer (dense, MoE), shared by the layers of that kind
    for kind in (0, 1):
        layer = specs.get_gpt_layer_local_spec(num_experts=config.num_moe_experts if kind else None,
                                               qk_layernorm=config.qk_layernorm, normalization="RMSNorm")
        sub = layer.submodules
        sub.input_layernorm = sub.pre_mlp_layernorm = LocalRMSNorm
        if config.qk_layernorm:
            sub.self_attention.submodules.q_layernorm = sub.self_attention.submodules.k_layernorm = LocalRMSNorm
        kinds[kind] = layer
    layers = [kinds[k] for k in pattern[offset:offset + get_num_layers_to_build(config)]]
    return TransformerBlockSubmodules(layer_specs=layers, layer_norm=LocalRMSNorm)


def build_model(arch: HFArch, dtype: torch.dtype = torch.float32, *, use_te: bool = False,
                sequence_parallel: bool = False, recompute=None, on_gpu: bool | None = None,
                fusions: dict[str, bool] | None = None, moe=None):
    """One GPTModel chunk for this rank's pipeline stage (parallel_state must be initialised).

    `on_gpu` (default: `use_te`) places the model on the current CUDA device; a GPU without Transformer
    Engine runs the local spec there. `fusions`: the kernel fusion flags (default: probed on a GPU, off on
    CPU; see `kernel_fusions`). `moe`: `trainer.moe.MoESettings` (MoE models; default: its defaults). EP and
    expert TP come from parallel_state."""
    on_gpu = use_te if on_gpu is None else on_gpu
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    tp = ps.get_tensor_model_parallel_world_size()
    pp = ps.get_pipeline_model_parallel_world_size()
    if arch.num_experts:
        from megatron_sortedrl.trainer.moe import fix_megatron_without_te

        fix_megatron_without_te()
    config = transformer_config(arch, dtype, tp=tp, pp=pp, sequence_parallel=sequence_parallel, on_gpu=on_gpu,
                                recompute=recompute, fusions=fusions, moe=moe,
                                ep=ps.get_expert_model_parallel_world_size(),
                                etp=ps.get_expert_tensor_parallel_world_size(), use_te=use_te)
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec(use_te, config),
        vocab_size=padded_vocab_size(arch, tp),
        max_sequence_length=arch.max_position_embeddings,
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=arch.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=int(arch.rope_theta),
        parallel_output=True,
    )
    # Megatron only knows llama3 scaling with fixed factors; HF's exact frequencies cover every case.
    inv = rope_inv_freq(arch).to(model.rotary_pos_emb.inv_freq.device)
    model.rotary_pos_emb.inv_freq = inv
    _set_attention_factor(config, rope_attention_factor(arch))
    if on_gpu:
        model.cuda(torch.cuda.current_device())
    return model.to(dtype)


def _set_attention_factor(config, factor: float) -> None:
    """Make Megatron's attention multiply cos/sin by `factor` (YaRN's attention scaling).

    Megatron's attention reads `_yarn_get_concentration_factor_from_config(config)`, i.e.
    mscale(f, yarn_mscale) / mscale(f, yarn_mscale_all_dim) with mscale(f, m) = 0.1 m ln f + 1, whenever the
    config carries `yarn_rotary_scaling_factor`. With f = e and mscale_all_dim = 0 that ratio is
    0.1 m + 1, so m = 10 (factor - 1) gives exactly `factor`, whatever form the HF config stated it in
    (the rotary frequencies themselves stay HF's, set on `rotary_pos_emb`). The layers share this config
    object, so setting it after construction reaches every attention module."""
    if factor == 1.0:
        return
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
        _yarn_get_concentration_factor_from_config,
    )

    config.yarn_rotary_scaling_factor = math.e
    config.yarn_mscale = 10.0 * (factor - 1.0)
    config.yarn_mscale_all_dim = 0.0
    got = _yarn_get_concentration_factor_from_config(config)
    if abs(got - factor) > 1e-9 * max(1.0, factor):
        raise RuntimeError(f"Megatron applies attention factor {got}, expected {factor}")
