"""Cost model of one continuously batched rollout engine: decode step time, prefill time, KV capacity.

Used twice with the same numbers: the simulator's engines advance by it, and the `cost_model` layout
planner estimates round times with it. Decode is modelled as memory bound (a roofline): each step reads
the weights once and the KV cache of every running sequence, split over the engine's TP GPUs, plus a fixed
per-step overhead, a per-sequence compute term and an all-reduce term that grows with log2(TP):

    step_s(tp, B, C) = overhead + comm * log2(tp) + (read_bytes(B) + C * kv_bytes_per_token) / (tp * hbm)
                       + per_seq_s * B / tp
    prefill_s(tp, T) = T / (prefill_tokens_per_s_per_gpu * tp)
    kv_capacity(tp)  = (tp * gpu_mem * mem_utilization - weight_bytes) / kv_bytes_per_token

B = running sequences (query positions of the step), C = their total context (prompt + generated tokens).
Parameters come from `configs/sim_*.yaml` (`engine:` section) or are measured from a real run
(`scheduler/sim/calibrate.py`).

Mixture of Experts (`expert_weight_gib` > 0): memory follows the total weights (`weight_gib`, all experts
resident), decode cost the weights a step actually reads: the shared part (attention, norms, embeddings,
output layer, shared experts) plus, per layer, the distinct routed experts the step's tokens chose. With B
tokens each picking k of E experts uniformly, a layer reads E x (1 - (1 - k/E)^B) experts in expectation:
k for one token, all of them for a large batch, since a big batch touches every expert:

    read_bytes(B) = (weight_gib - expert_weight_gib) + expert_weight_gib x (1 - (1 - k/E)^B)     [GiB]

For a dense model (`expert_weight_gib` 0) read_bytes is the whole model, as before. `per_seq_s` is the
per-token compute of the *active* parameters (2 x active params FLOP), set by the scenario. Speculative
verification multiplies B by the positions verified, so drafts touch more experts on an MoE engine.

Speculative decoding: `verify_step_s` is one step that verifies several positions per sequence (the
simulator's HistoSpec model, `scheduler/sim/speculation_model.py`, supplies how many).

Left out: chunked-prefill interleaving details, pipeline parallelism inside an engine, routing skew (real
routing is not uniform: a step touches somewhat fewer experts than the formula says, so MoE decode at
mid-size batches is slightly pessimistic here) and expert-parallel engines' all-to-all cost.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megatron_sortedrl.schema import help_field
from megatron_sortedrl.errors import ConfigError

GIB = 1024**3


@dataclass
class EngineCostModel:
    hbm_gbs: float = help_field("Memory bandwidth of one GPU (or CPU socket share) in GB/s.", 3350.0, gt=0)
    gpu_mem_gib: float = help_field("Memory of one GPU in GiB.", 80.0, gt=0)
    mem_utilization: float = help_field("Fraction of memory the engine may use (vLLM gpu_memory_utilization).", 0.9, gt=0, max=1)
    weight_gib: float = help_field("Model weights in GiB (whole model, all TP shards together).", 61.0, min=0)
    kv_bytes_per_token: float = help_field("KV-cache bytes per token (2 * layers * kv_heads * head_dim * dtype bytes).", 262144.0, gt=0)
    step_overhead_s: float = help_field("Fixed cost of one decode step (scheduling, sampling, launches) in seconds.", 0.006, min=0)
    tp_comm_s: float = help_field("All-reduce cost per decode step per doubling of TP, in seconds.", 0.002, min=0)
    per_seq_s: float = help_field("Compute per running sequence per decode step at TP=1, in seconds.", 0.00004, min=0)
    prefill_tokens_per_s: float = help_field("Prefill throughput of one GPU in tokens/s.", 12000.0, gt=0)
    max_num_seqs: int = help_field("Running sequences per engine (vLLM max_num_seqs).", 256, min=1)  # type: ignore[assignment]
    expert_weight_gib: float = help_field("MoE: the routed experts' share of weight_gib in GiB (0: a dense model). Decode "
                                          "reads only the experts a step's tokens are routed to.", 0.0, min=0)
    num_experts: int = help_field("MoE: routed experts per layer (0: dense).", 0, min=0)  # type: ignore[assignment]
    experts_per_token: int = help_field("MoE: experts each token is routed to (top-k).", 0, min=0)  # type: ignore[assignment]

    def __post_init__(self) -> None:
        for key in ("hbm_gbs", "gpu_mem_gib", "kv_bytes_per_token", "prefill_tokens_per_s"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"engine.{key}", getattr(self, key), "a positive number")
        for key in ("weight_gib", "step_overhead_s", "tp_comm_s", "per_seq_s"):
            if getattr(self, key) < 0:
                raise ConfigError(f"engine.{key}", getattr(self, key), "a number >= 0")
        if not 0 < self.mem_utilization <= 1:
            raise ConfigError("engine.mem_utilization", self.mem_utilization, "a float in (0, 1]")
        if self.max_num_seqs < 1:
            raise ConfigError("engine.max_num_seqs", self.max_num_seqs, "an integer >= 1")
        if not 0 <= self.expert_weight_gib <= self.weight_gib:
            raise ConfigError("engine.expert_weight_gib", self.expert_weight_gib, f"a number in [0, weight_gib={self.weight_gib}]")
        if self.expert_weight_gib and not 0 < self.experts_per_token <= self.num_experts:
            raise ConfigError("engine.experts_per_token", (self.experts_per_token, self.num_experts),
                              "1 <= experts_per_token <= num_experts when expert_weight_gib > 0")

    def scaled(self, k: float) -> EngineCostModel:
        """The same engine `k` times slower at decode and prefill (same memory): an engine on a busier core."""
        from dataclasses import replace

        if k == 1.0:
            return self
        return replace(self, hbm_gbs=self.hbm_gbs / k, step_overhead_s=self.step_overhead_s * k,
                       tp_comm_s=self.tp_comm_s * k, per_seq_s=self.per_seq_s * k,
                       prefill_tokens_per_s=self.prefill_tokens_per_s / k)

    def kv_capacity(self, tp: int) -> int:
        """KV-cache tokens one engine of TP `tp` can hold (0 when the weights do not fit)."""
        free = tp * self.gpu_mem_gib * self.mem_utilization * GIB - self.weight_gib * GIB
        return max(0, int(free / self.kv_bytes_per_token))

    def min_tp(self) -> int:
        """Smallest power-of-two TP whose engine holds the weights and at least one long context."""
        tp = 1
        while self.kv_capacity(tp) <= 0 and tp < 1024:
            tp *= 2
        return tp

    def expert_share_read(self, tokens: float) -> float:
        """Expected fraction of a layer's routed experts that `tokens` tokens touch (1 for a dense model)."""
        if not self.expert_weight_gib:
            return 1.0
        return 1.0 - (1.0 - self.experts_per_token / self.num_experts) ** max(1.0, tokens)

    def weight_read_gib(self, tokens: float) -> float:
        """GiB of weights one forward over `tokens` query positions reads: all of them for a dense model; the
        shared part plus the touched experts for an MoE model."""
        return self.weight_gib - self.expert_weight_gib + self.expert_weight_gib * self.expert_share_read(tokens)

    def decode_step_s(self, tp: int, batch: int, context_tokens: float) -> float:
        bytes_read = self.weight_read_gib(batch) * GIB + context_tokens * self.kv_bytes_per_token
        return (self.step_overhead_s + self.tp_comm_s * math.log2(tp) + bytes_read / (tp * self.hbm_gbs * 1e9)
                + self.per_seq_s * batch / tp)

    def verify_step_s(self, tp: int, positions: float, context_tokens: float) -> float:
        """A decode step over `positions` query positions (k + 1 per sequence with a k-token draft): weights
        and KV are read once, the per-position compute is paid for every position."""
        return self.decode_step_s(tp, positions, context_tokens)

    def prefill_s(self, tp: int, tokens: float) -> float:
        return tokens / (self.prefill_tokens_per_s * tp)

    def estimate_round_s(self, tp: int, num_engines: int, lengths: list[float], prompt_len: float) -> float:
        """Rough time for `num_engines` engines of TP `tp` to generate `lengths` (planner's estimate).

        Per engine (requests dealt longest-first onto the least-loaded engine): the larger of a latency
        bound (its longest request decoded with a small batch) and a throughput bound (its tokens at the
        batch the KV cache and max_num_seqs allow), plus prefill.
        """
        if not lengths or num_engines < 1:
            return 0.0
        cap = self.kv_capacity(tp)
        if cap <= 0:
            return math.inf
        loads = [[0.0, 0, 0.0] for _ in range(num_engines)]  # tokens, count, longest
        for length in sorted(lengths, reverse=True):
            slot = min(loads, key=lambda x: x[0])
            slot[0] += length
            slot[1] += 1
            slot[2] = max(slot[2], length)
        worst = 0.0
        for tokens, count, longest in loads:
            if not count:
                continue
            mean = tokens / count
            batch = max(1, min(count, self.max_num_seqs, int(cap / (prompt_len + mean / 2 + 1))))
            throughput = batch / self.decode_step_s(tp, batch, batch * (prompt_len + mean / 2))
            latency = longest * self.decode_step_s(tp, min(count, 4), 4 * (prompt_len + longest / 2))
            worst = max(worst, max(latency, tokens / throughput) + self.prefill_s(tp, count * prompt_len))
        return worst
