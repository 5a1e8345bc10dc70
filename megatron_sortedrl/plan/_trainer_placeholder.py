"""Placeholder trainer-memory model (Korthikanti et al. 2022 with flash attention), until plan.trainer_memory lands."""

from __future__ import annotations

from dataclasses import dataclass, field

GIB = 2**30


@dataclass
class TrainerMemory:
    stages: list[dict] = field(default_factory=list)  # per stage: {"items": {name: bytes}, "total": bytes}
    explain: list[str] = field(default_factory=list)


def trainer_memory(arch, *, tp, pp, dp, micro_batch_tokens, longest_sequence, dtype_bytes=2,
                   sequence_parallel=True, distributed_optimizer=True, granularity="none", method="uniform",
                   num_layers=1, spec="te", reference_model=False) -> TrainerMemory:
    h, q, kv, f = arch.hidden_size, arch.q_dim, arch.kv_dim, arch.intermediate_size
    sp = tp if sequence_parallel else 1
    per_layer_tok = (2 * h + 2 * h + 2 * (q + 2 * kv) + 2 * q + 2 * q + 2 * h + 2 * h + 4 * f + 2 * f) * dtype_bytes / 2
    per_layer_tok /= tp
    if granularity == "selective":
        per_layer_tok -= 2 * q / tp
    tokens = max(micro_batch_tokens, longest_sequence)
    layers = arch.num_layers // pp
    out = TrainerMemory()
    for s in range(pp):
        params = arch.stage_params(s, pp) / tp
        inflight = min(pp - s, pp)
        if granularity == "full":
            if method == "uniform":
                groups = -(-layers // num_layers)
                act = groups * 2 * h / sp * tokens * inflight + num_layers * per_layer_tok * tokens
            else:
                k = min(num_layers, layers)
                act = (k * 2 * h / sp + (layers - k) * per_layer_tok) * tokens * inflight + per_layer_tok * tokens
        else:
            act = layers * per_layer_tok * tokens * inflight
        items = {"weights": params * dtype_bytes, "gradients": params * 4,
                 "optimizer": params * (12 if dtype_bytes == 2 else 8) / (dp if distributed_optimizer else 1),
                 "activations": act,
                 "logits": (tokens * arch.vocab_size / tp * 6) if s == pp - 1 else 0.0}
        if reference_model:
            items["reference weights"] = params * dtype_bytes
        out.stages.append({"items": items, "total": sum(items.values()),
                           "activations_longest": act * longest_sequence / tokens, "activations_micro_batch": act})
        out.explain.append(f"stage {s}: " + ", ".join(f"{k} {v / GIB:.2f} GiB" for k, v in items.items()))
    return out
