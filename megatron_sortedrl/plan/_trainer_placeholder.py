"""Placeholder of plan.trainer_memory (same signature and result shape), until that module lands."""

from __future__ import annotations

from dataclasses import dataclass, field

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass
class StageMemory:
    stage: int
    items: dict = field(default_factory=dict)
    TOTAL_KEYS = ("weights", "gradients", "optimizer", "activations", "recompute_transient", "logits")

    @property
    def total(self) -> int:
        return sum(self.items[k] for k in self.TOTAL_KEYS)


@dataclass
class TrainerMemory:
    stages: list
    explain: list


def trainer_memory(arch, *, tp=1, pp=1, dp=1, sequence_parallel=False, distributed_optimizer=False, dtype="bfloat16",
                   micro_batch_tokens, longest_sequence, recompute="none", recompute_method="uniform",
                   recompute_num_layers=1, spec="te", **_):
    e = DTYPE_BYTES[dtype]
    h, q, kv, f = arch.hidden_size, arch.q_dim, arch.kv_dim, arch.intermediate_size
    per_tok = (8 * h + 2 * (q + 2 * kv) + 4 * q + 6 * f) * e / 2 / tp - (2 * q / tp if recompute == "selective" else 0)
    inp = 2 * h / (tp if sequence_parallel else 1)
    layers = arch.num_layers // pp
    stages = []
    for s in range(pp):
        n = arch.stage_params(s, pp) / tp
        def act(tokens):
            if recompute != "full":
                return layers * per_tok * tokens, 0
            if recompute_method == "uniform":
                return -(-layers // recompute_num_layers) * inp * tokens, recompute_num_layers * per_tok * tokens
            k = min(recompute_num_layers, layers)
            return (k * inp + (layers - k) * per_tok) * tokens, per_tok * tokens
        a, _ = act(longest_sequence)
        b, tr = act(max(micro_batch_tokens, longest_sequence))
        opt = 8 + (4 if e != 4 else 0)
        items = {"weights": n * e, "gradients": n * 4, "optimizer": n * opt / (dp if distributed_optimizer else 1),
                 "activations_longest": a, "activations_microbatch": b, "activations": (pp - s) * max(a, b),
                 "recompute_transient": tr,
                 "logits": 2 * max(micro_batch_tokens, longest_sequence) * arch.vocab_size / tp * e if s == pp - 1 else 0}
        stages.append(StageMemory(s, items))
    return TrainerMemory(stages, [f"stage {s.stage}: total {s.total / 2**30:.2f} GiB (placeholder model)" for s in stages])
