"""Micro-batching of variable-length samples and vocab-parallel log-probs / entropy.

    from megatron_sortedrl.trainer.logprobs import make_microbatches, token_logprobs
    mbs = make_microbatches(seqs, budget_tokens=4096)       # length-sorted, padded per micro-batch
    logp = token_logprobs(logits, labels)                   # logits [b, s, V/tp] from GPTModel

A sequence is `prompt + response`; the model reads tokens[:-1] and predicts tokens[1:], so response token
j sits at label position `len(prompt) - 1 + j`. Sequences are sorted by length and packed greedily into
micro-batches whose padded size (rows x longest row) stays within the token budget; each micro-batch is
right-padded only to its own longest row (rounded up to `multiple`), so no micro-batch pays for the
longest sample of the whole batch. Right padding under a causal mask never leaks into real tokens.

`token_logprobs` uses Megatron's `vocab_parallel_cross_entropy` (each TP rank holds a vocabulary slice);
`token_entropy` reduces the softmax statistics over the TP group. Columns past the real vocabulary (TP
padding) are masked out.

Deliberately left out: THD packing (`PackedSeqParams`), which only the Transformer Engine attention
supports; padding per micro-batch keeps one code path for CPU and GPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class SeqItem:
    """One sample as the trainer sees it: tokens plus per-response-token float arrays."""

    index: int  # position in the caller's list
    prompt: list[int]
    response: list[int]
    extras: dict[str, list[float]] = field(default_factory=dict)  # per response token (advantage, old logp, ...)
    mask: list[float] | None = None  # per response token loss weight (None: all ones)


@dataclass
class MicroBatch:
    indices: list[int]  # caller indices of the rows
    tokens: torch.Tensor  # [b, s] input ids
    position_ids: torch.Tensor  # [b, s]
    labels: torch.Tensor  # [b, s] next-token targets (0 on padding)
    loss_mask: torch.Tensor  # [b, s] float, 1 on response labels
    extras: dict[str, torch.Tensor]  # [b, s] float, aligned with labels
    response_slices: list[tuple[int, int]]  # per row: (start, end) label positions of the response


def make_microbatches(items: list[SeqItem], budget_tokens: int, multiple: int = 1) -> list[MicroBatch]:
    order = sorted(range(len(items)), key=lambda i: -(len(items[i].prompt) + len(items[i].response)))
    groups: list[list[int]] = []
    for i in order:  # longest first, so a group's first row is its longest
        if groups and (len(groups[-1]) + 1) * _longest(items, groups[-1]) <= budget_tokens:
            groups[-1].append(i)
        else:
            groups.append([i])
    return [_collate([items[i] for i in g], multiple) for g in groups]


def _longest(items: list[SeqItem], group: list[int]) -> int:
    return max(len(items[i].prompt) + len(items[i].response) - 1 for i in group)


def _collate(rows: list[SeqItem], multiple: int) -> MicroBatch:
    s = max(len(r.prompt) + len(r.response) - 1 for r in rows)
    s = -(-s // multiple) * multiple
    b = len(rows)
    tokens = torch.zeros(b, s, dtype=torch.long)
    labels = torch.zeros(b, s, dtype=torch.long)
    loss_mask = torch.zeros(b, s)
    keys = sorted({k for r in rows for k in r.extras})
    extras = {k: torch.zeros(b, s) for k in keys}
    slices = []
    for j, r in enumerate(rows):
        seq = r.prompt + r.response
        if len(r.prompt) < 1 or len(seq) < 2:
            raise ValueError(f"sample {r.index}: needs at least one prompt token and one more token")
        tokens[j, : len(seq) - 1] = torch.tensor(seq[:-1])
        labels[j, : len(seq) - 1] = torch.tensor(seq[1:])
        start, end = len(r.prompt) - 1, len(seq) - 1
        loss_mask[j, start:end] = torch.tensor(r.mask) if r.mask is not None else 1.0
        for k in keys:
            vals = r.extras.get(k)
            if vals is not None:
                if len(vals) != end - start:
                    raise ValueError(f"sample {r.index}: {k} has {len(vals)} values for {end - start} response tokens")
                extras[k][j, start:end] = torch.tensor(vals, dtype=torch.float32)
        slices.append((start, end))
    pos = torch.arange(s).unsqueeze(0).expand(b, -1).contiguous()
    return MicroBatch([r.index for r in rows], tokens, pos, labels, loss_mask, extras, slices)


def _mask_padded_vocab(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    from megatron.core import parallel_state as ps

    local = logits.shape[-1]
    start = ps.get_tensor_model_parallel_rank() * local
    if start + local <= vocab_size:
        return logits
    col = torch.arange(start, start + local, device=logits.device)
    return logits.masked_fill(col >= vocab_size, float("-inf"))


def token_logprobs(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int, temperature: float = 1.0
                   ) -> torch.Tensor:
    """log p(label) from vocab-parallel logits [b, s, V/tp]; differentiable; float32."""
    from megatron.core import tensor_parallel

    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    logits = _mask_padded_vocab(logits, vocab_size)
    # vocab_parallel_cross_entropy modifies its input in place for the backward pass; give it a copy.
    return -tensor_parallel.vocab_parallel_cross_entropy(logits.clone(), labels)


def token_entropy(logits: torch.Tensor, vocab_size: int, temperature: float = 1.0) -> torch.Tensor:
    """Entropy of the next-token distribution at every position, reduced over the TP group; differentiable."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    logits = _mask_padded_vocab(logits, vocab_size)
    m = logits.detach().max(dim=-1, keepdim=True).values
    if ps.get_tensor_model_parallel_world_size() > 1:
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=ps.get_tensor_model_parallel_group())
    e = torch.exp(logits - m)
    z = reduce_from_tensor_model_parallel_region(e.sum(dim=-1))
    pl = reduce_from_tensor_model_parallel_region(
        (e * torch.nan_to_num(logits - m, neginf=0.0)).sum(dim=-1))
    return torch.log(z) - pl / z
