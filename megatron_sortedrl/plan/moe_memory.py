"""The Mixture-of-Experts terms of the trainer-memory model (`trainer_memory.py` adds them per stage).

    from megatron_sortedrl.plan.moe_memory import moe_mlp_activations, moe_dispatch_bytes, check_expert_layout
    check_expert_layout(arch, tp=2, dp=16, ep=8, etp=1)          # ValueError naming the constraint

megatron-core's alltoall token dispatcher: each rank routes its local tokens (tokens / TP under sequence
parallelism) to the top-k experts, an all-to-all over the EP group brings every expert its tokens, an
all-gather over ETP gives each expert-TP slice all of them, and the reverse path brings the outputs back,
weighted by the routing probabilities. With uniform routing a rank receives k x its local tokens; the busiest
rank receives `MOE_IMBALANCE` times that (routing is never uniform and the recipes drop no tokens).

Left out: token dropping and capacity factors, the allgather and flex (DeepEP) dispatchers, fused
permutation's own buffers, and the router's auxiliary-loss statistics (a few values per expert).
"""

from __future__ import annotations

# Tokens the busiest expert-parallel rank receives over the mean (routing is not uniform and nothing is dropped;
# RL runs keep the load-balancing loss off or small). 1.5 is a working assumption to check on a GPU.
MOE_IMBALANCE = 1.5


def moe_received_tokens(arch, *, tokens: float, spd: int, imbalance: float) -> float:
    """Token copies the busiest EP rank receives per sparse layer: its local tokens (tokens / SP degree) x top-k
    (uniform routing spreads them evenly) x the imbalance."""
    return tokens / spd * arch.experts_per_token * imbalance


def moe_mlp_activations(arch, *, tokens: float, tp: int, spd: int, dtype_bytes: int, spec: str, ep: int, etp: int,
                        imbalance: float = MOE_IMBALANCE) -> dict[str, float]:
    """What a sparse layer's MoE block saves for backward (the alltoall dispatcher; see the module docstring)."""
    e, h = dtype_bytes, arch.hidden_size
    local = tokens / spd
    recv = moe_received_tokens(arch, tokens=tokens, spd=spd, imbalance=imbalance)
    swiglu = 5 if spec == "local" else 3  # tensors kept per ffn unit, as trainer_memory.layer_activations counts a dense MLP
    out = {
        "router (fp32 input, logits, probabilities)": local * (h + 2 * arch.num_experts) * 4,
        "expert inputs (dispatched tokens, x ETP after its all-gather)": recv * etp * h * e,
        "expert SwiGLU (per ETP slice)": recv * etp * swiglu * arch.moe_intermediate_size / etp * e,
        "expert outputs before un-permutation": local * arch.experts_per_token * h * e,
    }
    if arch.shared_expert_intermediate_size:
        out["shared-expert SwiGLU"] = tokens * swiglu * arch.shared_expert_intermediate_size / tp * e
    return out


def moe_dispatch_bytes(arch, *, tokens: float, spd: int, dtype_bytes: int, imbalance: float = MOE_IMBALANCE) -> float:
    """The all-to-all send and receive buffers of one sparse layer (freed after it; forward and backward alike)."""
    return (tokens / spd * arch.experts_per_token + moe_received_tokens(arch, tokens=tokens, spd=spd,
                                                                         imbalance=imbalance)) * arch.hidden_size * dtype_bytes


def check_expert_layout(arch, *, tp: int, dp: int, ep: int, etp: int) -> None:
    """megatron-core's constraints on an expert layout (ValueError with the numbers; the planner words it)."""
    if arch.num_experts % ep:
        raise ValueError(f"expert parallelism EP={ep} does not divide the {arch.num_experts} experts")
    if (tp * dp) % (ep * etp):
        raise ValueError(f"EP={ep} x ETP={etp} does not divide TP x DP = {tp * dp} (the expert groups are carved out "
                         "of the TP x DP ranks of each pipeline stage)")
    if etp > 1 and arch.moe_intermediate_size % etp:
        raise ValueError(f"ETP={etp} does not divide the experts' ffn {arch.moe_intermediate_size}")
