"""Mixture-of-Experts settings of the Megatron trainer: router, losses, expert kernels and expert parallelism.

    from megatron_sortedrl.trainer.moe import MoESettings, check_expert_layout
    settings = MoESettings.from_config(cfg)                       # model.moe_* keys
    check_expert_layout(arch, cfg.parallel)                       # ConfigError naming the key, before any group
    kwargs = moe_config_kwargs(arch, settings, on_gpu=False, ep=2, etp=1)   # TransformerConfig fields

`trainer/model.py` builds every model; this module only says what an MoE model adds to its TransformerConfig,
so the routing is that of the Hugging Face model it was loaded from (Qwen3-MoE, `transformers`'
`Qwen3MoeSparseMoeBlock`): the router is a bias-free linear layer computed in fp32, the top-k experts per token
come from a softmax over all experts, and `norm_topk_prob` renormalises the k probabilities to sum to 1.
Megatron's `moe_router_pre_softmax=False` (top-k of the logits, then a softmax over those k) is exactly the
renormalised form; `True` (softmax, then top-k) the plain one. No token is dropped (no capacity factor).

Losses: the auxiliary load-balancing loss is off by default (`model.moe_aux_loss_coef=0`): in RL the policy
gradient should be the only thing moving the router, and the aux loss would make the trainer's routing drift
from the one the engines sampled with. The router z-loss (`model.moe_z_loss_coef`) is likewise off unless set.

Kernels: on a GPU with Transformer Engine the experts run as one grouped GEMM (`TEGroupedMLP`, switched off by
`model.moe_grouped_gemm=false`); on CPU, and on a GPU without TE, each local expert is a plain MLP
(`SequentialMLP`). The two name their weights differently; `trainer/weights.py` knows both.

Expert parallelism: `parallel.expert_model_parallel_size` (EP) splits each MoE layer's experts over EP ranks,
`parallel.expert_tensor_parallel_size` (ETP, 0: equal to TP) splits each expert's FFN. Megatron carves the
EP x ETP expert groups out of the TP x DP ranks of each pipeline stage, so (TP x DP) must be a multiple of
EP x ETP; tokens move between EP ranks by all-to-all. Attention and dense layers keep their TP x DP layout.

Deliberately left out: shared experts, sigmoid / grouped / bias-corrected routers (DeepSeek-V3) and
MLA: `convert/architectures.check_architecture` refuses configs that use them; token dropping and capacity factors
(the engines never drop a token, so the trainer must not either).
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_sortedrl.errors import ConfigError


@dataclass(frozen=True)
class MoESettings:
    """The run config's MoE knobs (`model.moe_*`); the routing itself comes from config.json."""

    aux_loss_coef: float = 0.0
    z_loss_coef: float = 0.0
    grouped_gemm: bool = True
    routing_replay: bool = False  # routers that can replay given experts (R3, `trainer/routing_replay.py`)

    @classmethod
    def from_config(cls, cfg) -> MoESettings:
        m = cfg.model
        return cls(aux_loss_coef=m.moe_aux_loss_coef, z_loss_coef=m.moe_z_loss_coef, grouped_gemm=m.moe_grouped_gemm,
                   routing_replay=cfg.algorithm.routing_replay)


def needs_sequence_parallel(arch, tp: int) -> bool:
    """Megatron's MoE layer only trains at TP > 1 with sequence parallelism (each TP rank routes its own tokens)."""
    return bool(arch.num_experts) and tp > 1


def moe_config_kwargs(arch, settings: MoESettings | None, *, on_gpu: bool, use_te: bool, ep: int = 1,
                      etp: int | None = None, tp: int = 1) -> dict:
    """TransformerConfig fields of an MoE model (empty for a dense one)."""
    if not arch.num_experts:
        return {}
    s = settings or MoESettings()
    return {
        "num_moe_experts": arch.num_experts,
        "moe_router_topk": arch.moe_topk,
        "moe_ffn_hidden_size": arch.moe_ffn_size,
        "moe_layer_freq": [int(m) for m in arch.moe_layers],  # Qwen3-MoE's decoder_sparse_step / mlp_only_layers
        "moe_router_score_function": "softmax",
        "moe_router_pre_softmax": not arch.norm_topk_prob,  # see the module docstring
        "moe_router_dtype": "fp32",
        "moe_router_load_balancing_type": "aux_loss" if s.aux_loss_coef > 0 else "none",
        "moe_aux_loss_coeff": s.aux_loss_coef,
        "moe_z_loss_coeff": s.z_loss_coef or None,
        "moe_grouped_gemm": bool(on_gpu and use_te and s.grouped_gemm),
        "moe_permute_fusion": False,
        "moe_router_fusion": False,  # (Transformer Engine's fused top-k also ignores routing replay)
        "moe_enable_routing_replay": s.routing_replay,
        "expert_model_parallel_size": ep,
        "expert_tensor_parallel_size": etp or tp,
    }


def fix_megatron_without_te() -> None:
    """megatron-core 0.16.1's router reads `moe_utils.te_general_gemm`, which it only defines when Transformer
    Engine imports (a NameError on CPU and on a GPU without TE); None selects its plain torch matmul."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def expert_tp(parallel) -> int:
    """The expert TP size a `parallel` config section asks for (0 means: the attention TP)."""
    return parallel.expert_tensor_parallel_size or parallel.tensor_model_parallel_size


def check_expert_layout(arch, parallel) -> None:
    """Refuses, naming the key, an expert layout Megatron cannot build for `arch` (a dense model with EP > 1
    included); called by the trainer before any process group exists, and by `layout`."""
    ep, etp = parallel.expert_model_parallel_size, expert_tp(parallel)
    tp, dp = parallel.tensor_model_parallel_size, parallel.data_parallel_size
    if not arch.num_experts:
        if ep > 1:
            raise ConfigError("parallel.expert_model_parallel_size", ep,
                              f"1 for a dense model ({arch.model_type} has no experts to split)")
        if parallel.expert_tensor_parallel_size not in (0, tp):
            raise ConfigError("parallel.expert_tensor_parallel_size", parallel.expert_tensor_parallel_size,
                              f"0 for a dense model ({arch.model_type} has no experts)")
        return
    if arch.num_experts % ep:
        raise ConfigError("parallel.expert_model_parallel_size", ep,
                          f"a divisor of the number of experts ({arch.num_experts})")
    if arch.moe_ffn_size % etp:
        raise ConfigError("parallel.expert_tensor_parallel_size", parallel.expert_tensor_parallel_size,
                          f"a divisor of the expert FFN size ({arch.moe_ffn_size}), or 0 for the attention TP")
    if (tp * dp) % (ep * etp):
        raise ConfigError("parallel.expert_model_parallel_size", ep,
                          f"such that EP x expert TP ({ep} x {etp}) divides TP x DP ({tp} x {dp}): Megatron carves "
                          "the expert groups out of each pipeline stage's TP x DP ranks")
