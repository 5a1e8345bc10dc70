"""Micro-batching of variable-length samples and vocab-parallel log-probs / entropy.

    from megatron_sortedrl.trainer.logprobs import make_microbatches, token_logprobs
    mbs = make_microbatches(seqs, budget_tokens=4096)       # length-sorted, padded per micro-batch
    logp, ent = token_logprobs_and_entropy(logits, labels, vocab, Sampling(0.7, 0.9), chunk_tokens=512)

A sequence is `prompt + response`; the model reads tokens[:-1] and predicts tokens[1:], so response token
j sits at label position `len(prompt) - 1 + j`. Sequences are sorted by length and packed greedily into
micro-batches whose padded size (rows x longest row) stays within the token budget; each micro-batch is
right-padded only to its own longest row (rounded up to `multiple`), so no micro-batch pays for the
longest sample of the whole batch. Right padding under a causal mask never leaks into real tokens.

`token_logprobs_and_entropy` scores the distribution the engines sampled from (`Sampling`: logits divided by
the temperature, then vLLM's top-k and top-p cut, renormalised) on vocabulary-parallel logits (each TP rank
holds a vocabulary slice; columns past the real vocabulary, TP padding, are masked out). It is one autograd
function written here rather than Megatron's `vocab_parallel_cross_entropy`, which keeps a float32 softmax
of the whole micro-batch for its backward: this one works on `chunk_tokens` rows at a time, saves only
the per-token log-normaliser and recomputes each chunk's softmax in the backward pass, and gives the
entropy from the same reductions. The nucleus is recomputed from the logits as vLLM does (ascending sort,
cumulative probability), on an all-gather of one chunk when TP > 1.

Deliberately left out: THD packing (`PackedSeqParams`), which only the Transformer Engine attention
supports; padding per micro-batch keeps one code path for CPU and GPU. Logits processors other than
temperature / top-k / top-p (min-p, penalties, bad words): the rollout never sets them.
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


# Sorting the whole vocabulary for the nucleus needs values and int64 indices: at most this many elements
# at a time (about 200 MB), whatever the chunk size.
SORT_ELEMENTS = 1 << 24


@dataclass(frozen=True)
class Sampling:
    """The distribution the engines sample from, as the trainer must reproduce it: logits / temperature, then
    top-k, then top-p (vLLM's order), renormalised. `temperature` 0 (greedy) scores the raw distribution."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off

    @property
    def truncates(self) -> bool:
        return self.temperature > 0 and (self.top_p < 1.0 or self.top_k > 0)

    @property
    def scale(self) -> float:
        return self.temperature if self.temperature > 0 else 1.0


def token_logprobs(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int,
                   sampling: Sampling = Sampling(), chunk_tokens: int = 512) -> torch.Tensor:
    """log p(label) under `sampling` from vocab-parallel logits [b, s, V/tp]; differentiable; float32 [b, s]."""
    return token_logprobs_and_entropy(logits, labels, vocab_size, sampling, chunk_tokens, with_entropy=False)[0]


def token_logprobs_and_entropy(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int,
                               sampling: Sampling = Sampling(), chunk_tokens: int = 512,
                               with_entropy: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-prob of the label and entropy of the sampled distribution, both float32 [b, s] and both
    differentiable (the entropy gradient is only computed when the entropy reaches the loss).

    Works on `chunk_tokens` rows at a time: a float32 copy of one chunk exists at a time, never of the whole
    logits tensor; the backward pass recomputes each chunk's softmax from the logits (kept in the model's
    dtype) and the per-token log-normaliser saved in the forward pass. Across the TP group each chunk costs
    two all-reduces (max, then [sum exp, label logit, sum exp * logit]) plus, when top-p/top-k truncate, an
    all-gather of that chunk's logits (the nucleus needs the whole vocabulary's order)."""
    b, s, v_local = logits.shape
    flat = logits.reshape(b * s, v_local)
    lp, ent = _ChunkedLogProbs.apply(flat, labels.reshape(-1), vocab_size, sampling, max(1, chunk_tokens),
                                     with_entropy)
    return lp.view(b, s), (ent.view(b, s) if with_entropy else None)


def token_entropy(logits: torch.Tensor, vocab_size: int, sampling: Sampling = Sampling(),
                  chunk_tokens: int = 512) -> torch.Tensor:
    """Entropy of the sampled next-token distribution at every position, reduced over the TP group."""
    labels = torch.zeros(logits.shape[:2], dtype=torch.long, device=logits.device)
    return token_logprobs_and_entropy(logits, labels, vocab_size, sampling, chunk_tokens, with_entropy=True)[1]


def _tp():
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return 0, 1, None
    return (ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size(),
            ps.get_tensor_model_parallel_group())


def _all_reduce(t: torch.Tensor, group, op=None) -> torch.Tensor:
    import torch.distributed as dist

    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op or dist.ReduceOp.SUM, group=group)
    return t


def _threshold(z: torch.Tensor, sampling: Sampling, tp: int, group) -> torch.Tensor:
    """Smallest scaled logit the engine keeps, per row, reproducing vLLM's `apply_top_k_top_p_pytorch`:
    ascending sort, top-k cut at the k-th largest, then drop the prefix whose cumulative probability is
    <= 1 - top_p (the largest token always stays). Ties at the boundary are all kept."""
    import torch.distributed as dist

    with torch.no_grad():
        if tp > 1:
            parts = [torch.empty_like(z) for _ in range(tp)]
            dist.all_gather(parts, z.contiguous(), group=group)
            full = torch.cat(parts, dim=-1)
        else:
            full = z
        rows = max(1, SORT_ELEMENTS // full.shape[-1])
        return torch.cat([_row_threshold(full[i:i + rows], sampling) for i in range(0, full.shape[0], rows)])


def _row_threshold(full: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    srt = full.sort(dim=-1).values
    thr = torch.full(full.shape[:1], float("-inf"), dtype=full.dtype, device=full.device)
    v = srt.shape[-1]
    if 0 < sampling.top_k < v:
        thr = srt[:, v - sampling.top_k]
        srt = srt.masked_fill(srt < thr[:, None], float("-inf"))
    if sampling.top_p < 1.0:
        cum = srt.softmax(dim=-1).cumsum(dim=-1)
        drop = cum <= 1 - sampling.top_p
        drop[:, -1] = False  # the most likely token always stays
        thr = torch.maximum(thr, srt.gather(1, drop.sum(dim=-1, keepdim=True))[:, 0])
    return thr


def _scaled_chunk(ctx, logits, i, j, labels, thr):
    """float32 logits of rows [i, j) as the engine scores them: / T, TP padding and truncated tokens -inf."""
    z = logits[i:j].to(torch.float32, copy=True)  # a copy even when the model runs float32: edited in place
    if ctx.sampling.scale != 1.0:
        z.div_(ctx.sampling.scale)
    if thr is None and ctx.start + z.shape[-1] <= ctx.vocab_size:
        return z
    col = torch.arange(ctx.start, ctx.start + z.shape[-1], device=z.device)
    out = (col >= ctx.vocab_size)[None, :]
    if thr is not None:
        # The sampled token was inside the engine's nucleus; keep it even if rounding puts it just outside
        # ours, so its log-prob stays finite (it only changes the normaliser by that token's mass).
        out = out | ((z < thr[i:j, None]) & (col[None, :] != labels[i:j, None]))
    return z.masked_fill_(out, float("-inf"))


class _ChunkedLogProbs(torch.autograd.Function):
    """Vocab-parallel log-softmax at the label plus entropy, chunked over tokens, with a recomputing backward."""

    @staticmethod
    def forward(ctx, logits, labels, vocab_size, sampling, chunk, with_entropy):
        import torch.distributed as dist

        ctx.set_materialize_grads(False)
        rank, tp, group = _tp()
        n, v_local = logits.shape
        ctx.vocab_size, ctx.sampling, ctx.chunk, ctx.start = vocab_size, sampling, chunk, rank * v_local
        lp = torch.empty(n, dtype=torch.float32, device=logits.device)
        lse = torch.empty_like(lp)
        ent = torch.empty_like(lp) if with_entropy else None
        thr = torch.empty_like(lp) if sampling.truncates else None
        local = labels - ctx.start
        owned = (local >= 0) & (local < v_local)
        local = local.clamp(0, v_local - 1)
        for i in range(0, n, chunk):
            j = min(n, i + chunk)
            if thr is not None:
                z = _scaled_chunk(ctx, logits, i, j, labels, None)
                thr[i:j] = _threshold(z, sampling, tp, group)
            z = _scaled_chunk(ctx, logits, i, j, labels, thr)
            m = _all_reduce(z.max(dim=-1).values, group, dist.ReduceOp.MAX)
            e = torch.exp(z - m[:, None])
            picked = torch.where(owned[i:j], z.gather(1, local[i:j, None])[:, 0], torch.zeros_like(m))
            stats = [e.sum(dim=-1), picked]
            if with_entropy:
                stats.append((e * torch.nan_to_num(z, neginf=0.0)).sum(dim=-1))
            stats = _all_reduce(torch.stack(stats), group)
            lse[i:j] = m + torch.log(stats[0])
            lp[i:j] = stats[1] - lse[i:j]
            if with_entropy:
                ent[i:j] = lse[i:j] - stats[2] / stats[0]
            del z, e
        ctx.save_for_backward(logits, labels, lse, thr, ent)
        if ent is None:
            return lp, None
        return lp, ent

    @staticmethod
    def backward(ctx, grad_lp, grad_ent):
        logits, labels, lse, thr, ent = ctx.saved_tensors
        if grad_lp is None and grad_ent is None:
            return (None,) * 6
        n, v_local = logits.shape
        grad = torch.empty_like(logits)
        local = labels - ctx.start
        owned = (local >= 0) & (local < v_local)
        local = local.clamp(0, v_local - 1)
        for i in range(0, n, ctx.chunk):
            j = min(n, i + ctx.chunk)
            z = _scaled_chunk(ctx, logits, i, j, labels, thr)
            p = torch.exp(z - lse[i:j, None])  # 0 on masked columns
            g = torch.zeros_like(p)
            if grad_lp is not None:
                g.sub_(p * grad_lp[i:j, None])
                # + grad at the label's column, on the rank that owns it (no host sync, unlike indexing)
                g.scatter_add_(1, local[i:j, None], (grad_lp[i:j] * owned[i:j])[:, None])
            if grad_ent is not None:
                # dH/dz = -p (log p + H); masked columns have p = 0 and contribute nothing.
                logp = torch.nan_to_num(z - lse[i:j, None], neginf=0.0)
                g.sub_(grad_ent[i:j, None] * p * (logp + ent[i:j, None]))
            if ctx.sampling.scale != 1.0:
                g.div_(ctx.sampling.scale)
            grad[i:j] = g.to(grad.dtype)
            del z, p, g
        return grad, None, None, None, None, None

