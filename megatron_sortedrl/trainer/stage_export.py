"""The stage senders' export for rollout weight sync: each pipeline stage's full HF tensors, gathered to one rank.

    from megatron_sortedrl.trainer.stage_export import iter_stage_hf_weights
    for name, tensor in iter_stage_hf_weights(model, arch):                 # every trainer rank, to the end
        ...                                                                 # only the stage sender gets any

One sender per pipeline stage, the stage's TP rank 0 of DP replica 0; every HF tensor comes from exactly one
stage (`stage_export_plan`). A sender sends in two passes (`stage_export_cells`):

1. every non-expert tensor of the stage (embedding, attention, norms, routers, dense MLPs, output layer),
   its TP pieces sent point to point by the stage's TP ranks of DP replica 0;
2. the experts, layer by layer, each HF expert tensor received piece by piece from the rank that holds
   it: expert `e` lives on EP rank `e // (experts / EP)`, split over its expert-TP (ETP) group. The sender's
   expert tensor-and-model-parallel group (EP x ETP ranks Megatron carves out of the stage's TP x DP ranks:
   other DP replicas at EP2 x DP2, the TP peers at TP2 x EP2 with ETP1) is where those ranks are, so EP > 1
   and ETP != TP need no rank outside the stage.

Memory: beside its own shard the sender holds the one HF tensor being assembled; its peers at most one piece
of their own shard (a copy only for a `row` tensor split along dim 1). No pass gathers a layer, a bucket or
an EP rank's experts ahead, so the bound "own shard plus two buckets" of the caller's packing
(`rollout.weight_sync`) holds at any EP (tests/test_weight_sync_moe.py).

The transfers are `torch.distributed` point-to-point calls on the trainer's own groups: gloo on CPU, NCCL on
GPU (the tensors stay on the device; the GPU path is exercised by tests/test_weight_sync_gpu.py on a GPU).

Deliberately left out: overlapping the expert pass's receives with packing (each receive waits for the
previous tensor to be copied into a bucket), and sending from several EP ranks straight to the engines.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from megatron_sortedrl.trainer.weights import (
    expert_layout,
    local_param_name,
    local_params,
    owner_stage,
    export_order,
    hf_shapes,
)


def stage_export_cells(arch, pp: int, stage: int, *, use_te: bool = False, order: str = "layer"
                       ) -> list[tuple[str, str, list[str], int | None, int | None]]:
    """`export_order`'s rows that pipeline stage `stage` sends, in send order: every non-expert tensor first (in
    `order`), then the experts (in `order`: layer by layer, each layer's experts in expert order). The engine
    thus has every attention and router weight before the first expert, and the expert pass can gather over
    the EP group without mixing with the TP gathers of the first pass."""
    per = arch.num_layers // pp
    rows = [r for r in export_order(arch, use_te=use_te, order=order) if owner_stage(r[0], r[3], pp, per) == stage]
    return [r for r in rows if r[4] is None] + [r for r in rows if r[4] is not None]


def stage_export_plan(arch, pp: int, stage: int, *, use_te: bool = False, order: str = "layer", ep: int = 1
                      ) -> list[tuple[str, str, list[str]]]:
    """(local Megatron name, layout, HF names) of every tensor pipeline stage `stage` exports, in send order
    (`stage_export_cells`: non-expert tensors, then experts).

    Each HF tensor belongs to exactly one stage: layers to their stage, the embedding to the first, the final
    norm and an untied output layer to the last. `order`: see `export_order`. Experts are named as their EP rank
    holds them at expert-parallel size `ep`."""
    per = arch.num_layers // pp
    local_experts = arch.num_experts // ep if arch.num_experts else 1
    return [(local_param_name(mname, gi, e, stage * per, local_experts), layout, names)
            for mname, layout, names, gi, e in stage_export_cells(arch, pp, stage, use_te=use_te, order=order)]


def _hf_pieces(local: torch.Tensor, layout: str, arch, tp: int, rank: int) -> list[tuple[torch.Tensor, bool]]:
    """This TP rank's part of each HF tensor of one table row: (piece, transposed), in HF-name order.

    Every piece is a block of rows of its HF tensor (of its transpose when `transposed`: the `row` layout,
    split along dim 1), and the pieces of ranks 0..tp-1 stacked along dim 0 give the whole tensor. Views
    where possible (`column`, `vocab`, `gate_up`, `row`); copies of this rank's shard size for `qkv`."""
    if layout == "column":
        return [(local, False)]
    if layout == "row":  # split along dim 1: assembled transposed, unless one rank holds it whole
        return [(local.t(), True)] if tp > 1 else [(local, False)]
    if layout == "vocab":  # the padding rows of the last ranks are not part of the HF tensor
        rows = local.shape[0]
        valid = max(0, min(rows, arch.vocab_size - rank * rows))
        return [(local[:valid], False)]
    if layout == "gate_up":
        gate, up = local.chunk(2, dim=0)
        return [(gate, False), (up, False)]
    if layout == "qkv":
        qpg, hd = arch.num_heads // arch.num_kv_heads, arch.head_dim
        grouped = local.reshape(arch.num_kv_heads // tp, (qpg + 2) * hd, *local.shape[1:])
        q, k, v = grouped.split([qpg * hd, hd, hd], dim=1)
        return [(t.reshape(-1, *local.shape[1:]), False) for t in (q, k, v)]
    raise ValueError(f"unknown layout {layout}")


def iter_stage_hf_weights(model, arch, *, use_te: bool = False, dtype: torch.dtype | None = None,
                          order: str = "layer") -> Iterator[tuple[str, torch.Tensor]]:
    """This pipeline stage's full HF tensors, yielded on the stage sender only (TP rank 0 of DP replica 0).

    A collective of the stage's ranks: every rank of the trainer must iterate it to the end (the others yield
    nothing; ranks with no part return at once). Two passes, in `stage_export_cells`' order:

    1. Non-expert tensors, over the stage's TP group of DP replica 0. One HF tensor at a time: fused Megatron
       weights (q/k/v, gate/up) are split into their HF tensors *before* anything moves, each TP peer sends
       its rows of that one HF tensor (point to point), and the sender receives them straight into the full
       tensor (a `row`-layout tensor is assembled transposed, so every received block is contiguous, and
       yielded as a transposed view).
    2. Experts, over the sender's expert tensor-and-model-parallel group (its EP x ETP ranks, which Megatron
       may carve out of other DP replicas or of the TP group): each HF expert tensor is received, piece by
       ETP piece, from the EP rank that holds the expert, the same way. EP peers send views of their own
       shard (a copy of one piece only for a `row` tensor split by ETP); nothing is gathered ahead.

    So beside its own shard the sender holds one full HF tensor and nothing else (no gathered fused weight,
    no collective's staging buffer, no other rank's experts beyond the one tensor), and a peer at most one
    piece of its own shard's size. The tensor yielded is reused memory only in the sense that the next one
    is allocated after the caller has copied it out (`iter_packed` does so at once)."""
    from megatron.core import parallel_state as ps

    tp = ps.get_tensor_model_parallel_world_size()
    params = local_params(model)
    out_dtype = dtype or next(iter(params.values())).dtype
    pp, stage = ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()
    ep, ep_rank, etp, etp_rank = expert_layout()
    cells = stage_export_cells(arch, pp, stage, use_te=use_te, order=order)
    first = stage * (arch.num_layers // pp)
    local_experts = arch.num_experts // ep if arch.num_experts else 1
    in_replica0 = ps.get_data_parallel_rank() == 0
    sender = in_replica0 and (ps.get_tensor_model_parallel_rank() if tp > 1 else 0) == 0
    # Who holds which expert pieces, and whether this rank's expert group has the sender (one tiny collective).
    owners = _expert_owners(sender, next(iter(params.values())).device) if arch.num_experts else None
    if in_replica0:
        dense = [(local_param_name(m, gi, None, first, 1), layout, names) for m, layout, names, gi, e in cells if e is None]
        yield from _tp_pass(params, dense, arch, tp, sender, out_dtype)
    if owners is not None:
        experts = [(local_param_name(m, gi, e, first, local_experts), layout, names, e // local_experts)
                   for m, layout, names, gi, e in cells if e is not None]
        yield from _expert_pass(params, experts, arch, owners, (ep_rank, etp, etp_rank), sender, out_dtype)


def _tp_pass(params, plan, arch, tp: int, sender: bool, out_dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """Pass 1 of `iter_stage_hf_weights`: non-expert tensors, TP pieces point to point to TP rank 0."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    tp_group = ps.get_tensor_model_parallel_group()
    tp_rank = ps.get_tensor_model_parallel_rank() if tp > 1 else 0
    ranks = dist.get_process_group_ranks(tp_group) if tp > 1 else [None]
    shapes = hf_shapes(arch)
    for local_name, layout, names in plan:
        local = params[local_name].detach()
        if layout == "replicated" or tp == 1:
            if sender:
                fulls = [local] if layout == "replicated" else [p for p, _ in _hf_pieces(local, layout, arch, 1, 0)]
                for n, t in zip(names, fulls):
                    yield n, t.to(out_dtype)
            continue
        for k, (piece, transposed) in enumerate(_hf_pieces(local, layout, arch, tp, tp_rank)):
            if not sender:
                if piece.numel():  # (a vocab piece of padding rows only is not sent)
                    dist.send(piece.contiguous(), dst=ranks[0], group=tp_group)
                continue
            shape = shapes[names[k]]
            full = torch.empty(shape[::-1] if transposed else shape, dtype=local.dtype, device=local.device)
            per = piece.shape[0] if layout != "vocab" else local.shape[0]  # rows of every rank's piece
            full.narrow(0, 0, piece.shape[0]).copy_(piece)
            for r in range(1, tp):
                rows = min(per, full.shape[0] - r * per)
                if rows > 0:
                    dist.recv(full.narrow(0, r * per, rows), src=ranks[r], group=tp_group)
            yield names[k], (full.t() if transposed else full).to(out_dtype)
            del full


def _expert_owners(sender: bool, device) -> dict | None:
    """For the expert group (EP x ETP ranks, `get_expert_tensor_and_model_parallel_group`) that holds the stage
    sender: {"sender": its global rank, "group": the group, (ep rank, etp rank): global rank of every member}.
    None on the ranks of the other expert groups (other expert-DP replicas: they send nothing)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    ep, ep_rank, etp, etp_rank = expert_layout()
    if ep * etp == 1:
        return {"sender": dist.get_rank(), "group": None, (0, 0): dist.get_rank()} if sender else None
    group = ps.get_expert_tensor_and_model_parallel_group()
    ranks = dist.get_process_group_ranks(group)
    mine = torch.tensor([int(sender), ep_rank, etp_rank], dtype=torch.int64, device=device)
    every = [torch.empty_like(mine) for _ in ranks]
    dist.all_gather(every, mine, group=group)
    rows = [t.tolist() for t in every]
    senders = [g for g, (is_sender, _, _) in zip(ranks, rows) if is_sender]
    if not senders:
        return None
    return {"sender": senders[0], "group": group, **{(e, t): g for g, (_, e, t) in zip(ranks, rows)}}


def _expert_pass(params, plan, arch, owners: dict, me: tuple[int, int, int], sender: bool, out_dtype
                 ) -> Iterator[tuple[str, torch.Tensor]]:
    """Pass 2 of `iter_stage_hf_weights`: every expert tensor of the stage, each assembled on the sender from the
    ETP pieces of the EP rank that holds the expert (point to point, one HF tensor at a time)."""
    import torch.distributed as dist

    ep_rank, etp, etp_rank = me
    group, dst = owners["group"], owners["sender"]
    shapes = hf_shapes(arch)
    for local_name, layout, names, owner_ep in plan:
        mine = owner_ep == ep_rank
        local = params[local_name].detach()  # every EP rank has a local expert of this name (its own expert)
        pieces = _hf_pieces(local, layout, arch, etp, etp_rank) if mine else None
        if not sender:
            for piece, _ in pieces or ():
                dist.send(piece.contiguous(), dst=dst, group=group)
            continue
        if mine and etp == 1:  # the sender holds the expert whole: its views, as in pass 1 at TP 1
            for n, (piece, _) in zip(names, pieces):
                yield n, piece.to(out_dtype)
            continue
        for k, name in enumerate(names):
            shape = shapes[name]
            transposed = layout == "row" and etp > 1
            full = torch.empty(shape[::-1] if transposed else shape, dtype=local.dtype, device=local.device)
            per = full.shape[0] // etp
            for r in range(etp):
                block = full.narrow(0, r * per, per)
                if mine and r == etp_rank:
                    block.copy_(pieces[k][0])
                else:
                    dist.recv(block, src=owners[(owner_ep, r)], group=group)
            yield name, (full.t() if transposed else full).to(out_dtype)
            del full
