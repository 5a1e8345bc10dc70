"""TEST-SIDE REFERENCE: Megatron-LM's theoretical memory accounting, re-derived (not our planner).

Arithmetic of `megatron/training/theoretical_memory_usage.py` in the NVIDIA Megatron-LM repository
(read, not copied; dense models only: no MoE, MTP, MLA or interleaved pipeline):

* weights + optimizer of the most loaded shard (the first stage: its layers plus the embedding):
  parameters x 18 bytes (2 bf16 weight + 4 fp32 grad + 12 fp32 master/Adam), or 6 + 12 / DP with the
  distributed optimizer;
* activations (`compute_activation_memory`, used when sequence parallelism and selective recompute are
  both on): s*b*h*(18 + 4*ffn/h) bytes per layer, times all layers (the first stage's layers times PP
  micro-batches in flight), plus the embedding's input ids (8 s b PP) and dropout mask (s b h PP),
  divided by TP; with PP = 1 also the output layer's input and logits, 4 s b h (1 + V/h);
* otherwise (`compute_activation_memory_without_sp`): s*b*h*(10 + 24/TP) per layer, the same embedding
  terms, with PP = 1 the logits and final norm output in 2 bytes, and a 5% overhead factor.

Used by tests/test_plan_memory.py and benchmarks/plan_vs_measured.py (docs/benchmarks/plan_vs_megatron.md)
to compare and explain the differences with our `te` model.
"""

from __future__ import annotations


def megatron_padded_vocab(vocab: int, tp: int, divisible_by: int = 128) -> int:
    """Megatron-LM pads the vocabulary to a multiple of make_vocab_size_divisible_by (128) x TP."""
    m = divisible_by * tp
    return -(-vocab // m) * m


def weight_and_optimizer_bytes(arch, *, tp: int, pp: int, dp: int, distributed_optimizer: bool) -> float:
    h, f = arch.hidden_size, arch.intermediate_size
    q_ratio = arch.head_dim * arch.num_heads / h
    attn = 2 * h * h * ((1 + arch.num_kv_heads / arch.num_heads) * q_ratio)
    layer = 2 * h * (f * 1.5 + 1) + attn  # SwiGLU multiplier 3/2, RMSNorm size 1
    vocab = megatron_padded_vocab(arch.vocab_size, tp)
    emb = h * vocab
    block = layer * arch.num_layers + h  # + final norm
    most_loaded = (block / pp + emb) / tp
    if not arch.tie_word_embeddings and pp == 1:
        most_loaded += emb / tp
    per_param = 6 + 12 / dp if distributed_optimizer else 18
    return most_loaded * per_param


def activation_bytes(arch, *, seq_length: int, micro_batch_size: int = 1, tp: int, pp: int,
                     sequence_parallel: bool, selective: bool, num_microbatches: int | None = None,
                     include_output: bool = True) -> float:
    """First-stage activations; `include_output=False` drops the PP = 1 output-layer/logits term."""
    s, b, h, f, L = seq_length, micro_batch_size, arch.hidden_size, arch.intermediate_size, arch.num_layers
    vocab = megatron_padded_vocab(arch.vocab_size, tp)
    with_sp = sequence_parallel and selective
    per_layer = s * b * h * ((18 + 4 * f / h) if with_sp else (10 + 24 / tp))
    act = per_layer * L
    act += 8 * s * b * pp + s * b * h * pp  # embedding input ids and dropout mask, PP micro-batches
    if pp > 1 and num_microbatches is not None:
        act *= min(1, num_microbatches / pp)
    if with_sp:
        if pp == 1 and include_output:
            act += s * b * h * 4 * (1 + vocab / h)
        return act / tp
    if pp == 1 and include_output:
        act += (s * b * vocab / tp + s * b * h) * 2
    return act * 1.05
