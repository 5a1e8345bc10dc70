"""The Hugging Face <-> Megatron weight table, and loading / exporting weights at any TP and PP.

    from megatron_sortedrl.trainer.weights import load_hf_weights, export_hf_weights
    load_hf_weights(model, "runs/tiny_model", arch, use_te=False)          # every rank, after build_model
    for name, tensor in export_hf_weights(model, arch, use_te=False):     # every rank, in lockstep
        ...                                                                # full, un-sharded HF tensors

`WEIGHT_TABLE` is data: one row per Megatron parameter (per layer where `{i}` appears) naming the HF
tensors it is made of and how it is laid out across tensor-parallel ranks:

* `vocab`  - split along dim 0 (vocabulary), padded with zero rows to a multiple of TP;
* `column` - split along dim 0 (output features);
* `row`    - split along dim 1 (input features);
* `replicated` - every rank holds the full tensor (norm weights);
* `qkv`    - q, k, v fused per query group, `[q heads of group g..., k_g, v_g]` for every g, then split
             along dim 0 (each TP rank holds whole query groups); biases the same;
* `gate_up` - `[gate_i; up_i]` on TP rank i (gate and up each split along dim 0, then stacked).

The Transformer Engine spec fuses the two RMSNorm weights into the following linear layer; the TE
column of the table gives those names. Qwen3's q/k norms (`q_norm`, `k_norm`: one head_dim vector shared by
every head) are replicated rows of the same table; rows whose HF tensor a model lacks (biases, q/k norms, the
dense MLP of an MoE layer) are skipped.

MoE layers take their MLP rows from `EXPERT_TABLE` instead of the dense MLP rows (`DENSE_MLP_ROWS`): the
router (`mlp.gate`, replicated), the pre-MLP norm (not fused into a linear layer in TE's MoE layer) and, per
expert `{e}`, `gate_up` / `row` layouts split over the *expert* TP group (ETP) instead of TP. Expert `e` lives
on expert-parallel rank `e // (num_experts / EP)` as its local expert `e % (num_experts / EP)`; the local spec
names it `mlp.experts.local_experts.{e}.*` (SequentialMLP), TE's grouped GEMM `mlp.experts.linear_fc1.weight{e}`.

Pipeline stages hold a contiguous slice of layers; local layer
`i` on stage `s` is global layer `s * num_layers / pp + i`. With tied embeddings the last stage holds a
copy of the embedding as `output_layer.weight`.

The export iterator is a collective: every rank of the trainer calls it and consumes it in the same
order; shards are all-gathered over TP (experts over ETP, then broadcast over EP from the rank that holds
the expert) and the owning stage broadcasts over PP, so every rank yields the same full tensors. The
checkpoint conversion tool builds on it (HF files themselves: `hf_files.py`). Rollout weight sync uses
`stage_export.iter_stage_hf_weights` instead: each stage's sender gathers only its
own stage's tensors, non-expert tensors first, then the experts over the EP group, so no rank holds the
model. Both export layer by layer by default (`export_order`): each layer's tensors together, which is what
lets vLLM's layerwise reload finish one module before the next arrives.

Deliberately left out: learned position embeddings and shared experts (no modelled family has them).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

from megatron_sortedrl.errors import CheckpointError
from megatron_sortedrl.trainer.hf_files import HFReader

L = "model.layers.{i}."
# (megatron name, TE megatron name, HF names, layout)
WEIGHT_TABLE: list[tuple[str, str, tuple[str, ...], str]] = [
    ("embedding.word_embeddings.weight", "embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab"),
    ("decoder.layers.{i}.input_layernorm.weight", "decoder.layers.{i}.self_attention.linear_qkv.layer_norm_weight",
     (L + "input_layernorm.weight",), "replicated"),
    ("decoder.layers.{i}.self_attention.linear_qkv.weight", "decoder.layers.{i}.self_attention.linear_qkv.weight",
     (L + "self_attn.q_proj.weight", L + "self_attn.k_proj.weight", L + "self_attn.v_proj.weight"), "qkv"),
    ("decoder.layers.{i}.self_attention.linear_qkv.bias", "decoder.layers.{i}.self_attention.linear_qkv.bias",
     (L + "self_attn.q_proj.bias", L + "self_attn.k_proj.bias", L + "self_attn.v_proj.bias"), "qkv"),
    ("decoder.layers.{i}.self_attention.q_layernorm.weight", "decoder.layers.{i}.self_attention.q_layernorm.weight",
     (L + "self_attn.q_norm.weight",), "replicated"),
    ("decoder.layers.{i}.self_attention.k_layernorm.weight", "decoder.layers.{i}.self_attention.k_layernorm.weight",
     (L + "self_attn.k_norm.weight",), "replicated"),
    ("decoder.layers.{i}.self_attention.linear_proj.weight", "decoder.layers.{i}.self_attention.linear_proj.weight",
     (L + "self_attn.o_proj.weight",), "row"),
    ("decoder.layers.{i}.pre_mlp_layernorm.weight", "decoder.layers.{i}.mlp.linear_fc1.layer_norm_weight",
     (L + "post_attention_layernorm.weight",), "replicated"),
    ("decoder.layers.{i}.mlp.linear_fc1.weight", "decoder.layers.{i}.mlp.linear_fc1.weight",
     (L + "mlp.gate_proj.weight", L + "mlp.up_proj.weight"), "gate_up"),
    ("decoder.layers.{i}.mlp.linear_fc2.weight", "decoder.layers.{i}.mlp.linear_fc2.weight",
     (L + "mlp.down_proj.weight",), "row"),
    ("decoder.final_layernorm.weight", "decoder.final_layernorm.weight", ("model.norm.weight",), "replicated"),
    ("output_layer.weight", "output_layer.weight", ("lm_head.weight",), "vocab"),
]
# The dense MLP's rows: an MoE layer has `EXPERT_TABLE`'s instead.
DENSE_MLP_ROWS = frozenset({"decoder.layers.{i}.pre_mlp_layernorm.weight", "decoder.layers.{i}.mlp.linear_fc1.weight",
                            "decoder.layers.{i}.mlp.linear_fc2.weight"})
# MoE layers (Qwen3-MoE names): rows with `{e}` are one per expert, split over the expert TP group.
EXPERT_TABLE: list[tuple[str, str, tuple[str, ...], str]] = [
    ("decoder.layers.{i}.pre_mlp_layernorm.weight", "decoder.layers.{i}.pre_mlp_layernorm.weight",
     (L + "post_attention_layernorm.weight",), "replicated"),
    ("decoder.layers.{i}.mlp.router.weight", "decoder.layers.{i}.mlp.router.weight", (L + "mlp.gate.weight",),
     "replicated"),
    ("decoder.layers.{i}.mlp.experts.local_experts.{e}.linear_fc1.weight", "decoder.layers.{i}.mlp.experts.linear_fc1.weight{e}",
     (L + "mlp.experts.{e}.gate_proj.weight", L + "mlp.experts.{e}.up_proj.weight"), "gate_up"),
    ("decoder.layers.{i}.mlp.experts.local_experts.{e}.linear_fc2.weight", "decoder.layers.{i}.mlp.experts.linear_fc2.weight{e}",
     (L + "mlp.experts.{e}.down_proj.weight",), "row"),
]


def _rows(use_te: bool, table=None) -> list[tuple[str, tuple[str, ...], str]]:
    return [(te if use_te else local, hf, layout) for local, te, hf, layout in (table or WEIGHT_TABLE)]


def _layer_rows(arch, gi: int, use_te: bool) -> list[tuple[str, tuple[str, ...], str]]:
    """The table rows of global layer `gi`: a dense layer's, or an MoE layer's attention rows + EXPERT_TABLE."""
    if not arch.is_moe_layer(gi):
        return [r for r in _rows(use_te) if "{i}" in r[0]]
    dense = [r for r, (local, *_) in zip(_rows(use_te), WEIGHT_TABLE) if "{i}" in local and local not in DENSE_MLP_ROWS]
    return dense + _rows(use_te, EXPERT_TABLE)


# ------------------------------------------------------------------------------------------ layout math


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """HF q/k/v (weights [out, in] or biases [out]) -> Megatron's per-query-group fused layout."""
    g = num_kv_heads
    qg = q.reshape(g, -1, *q.shape[1:])
    kg = k.reshape(g, -1, *k.shape[1:])
    vg = v.reshape(g, -1, *v.shape[1:])
    return torch.cat([qg, kg, vg], dim=1).reshape(-1, *q.shape[1:])


def split_qkv(fused: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int):
    """Inverse of `fuse_qkv`: Megatron fused qkv -> HF (q, k, v)."""
    qpg = num_heads // num_kv_heads
    grouped = fused.reshape(num_kv_heads, (qpg + 2) * head_dim, *fused.shape[1:])
    q, k, v = grouped.split([qpg * head_dim, head_dim, head_dim], dim=1)
    return tuple(t.reshape(-1, *fused.shape[1:]) for t in (q, k, v))


def full_to_shard(full: list[torch.Tensor], layout: str, tp: int, rank: int, arch) -> torch.Tensor:
    """The TP shard of rank `rank` from the full HF tensor(s) of one table row."""
    if layout == "replicated":
        return full[0]
    if layout == "vocab":
        from megatron_sortedrl.trainer.model import padded_vocab_size

        t = full[0]
        pad = padded_vocab_size(arch, tp) - t.shape[0]
        if pad:
            t = torch.cat([t, t.new_zeros(pad, *t.shape[1:])])
        return t.chunk(tp, dim=0)[rank]
    if layout == "column":
        return full[0].chunk(tp, dim=0)[rank]
    if layout == "row":
        return full[0].chunk(tp, dim=1)[rank]
    if layout == "qkv":
        return fuse_qkv(*full, arch.num_kv_heads).chunk(tp, dim=0)[rank]
    if layout == "gate_up":
        gate, up = full
        return torch.cat([gate.chunk(tp, dim=0)[rank], up.chunk(tp, dim=0)[rank]])
    raise ValueError(f"unknown layout {layout}")


def shards_to_full(shards: list[torch.Tensor], layout: str, arch) -> list[torch.Tensor]:
    """Full HF tensor(s) of one table row from the TP shards of all ranks (in rank order)."""
    if layout == "replicated":
        return [shards[0]]
    if layout == "vocab":
        return [torch.cat(shards, dim=0)[: arch.vocab_size]]
    if layout == "column":
        return [torch.cat(shards, dim=0)]
    if layout == "row":
        return [torch.cat(shards, dim=1)]
    if layout == "qkv":
        return list(split_qkv(torch.cat(shards, dim=0), arch.num_heads, arch.num_kv_heads, arch.head_dim))
    if layout == "gate_up":
        halves = [s.chunk(2, dim=0) for s in shards]
        return [torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])]
    raise ValueError(f"unknown layout {layout}")


def hf_shapes(arch) -> dict[str, tuple[int, ...]]:
    """Shape of every HF tensor of the model (what the export broadcast allocates)."""
    h, hd = arch.hidden_size, arch.head_dim
    shapes = {"model.embed_tokens.weight": (arch.vocab_size, h), "model.norm.weight": (h,)}
    if not arch.tie_word_embeddings:
        shapes["lm_head.weight"] = (arch.vocab_size, h)
    for i in range(arch.num_layers):
        p = L.format(i=i)
        shapes.update({
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (arch.num_heads * hd, h),
            p + "self_attn.k_proj.weight": (arch.num_kv_heads * hd, h),
            p + "self_attn.v_proj.weight": (arch.num_kv_heads * hd, h),
            p + "self_attn.o_proj.weight": (h, arch.num_heads * hd),
        })
        if arch.is_moe_layer(i):
            f = arch.moe_ffn_size
            shapes[p + "mlp.gate.weight"] = (arch.num_experts, h)
            for e in range(arch.num_experts):
                q = f"{p}mlp.experts.{e}."
                shapes.update({q + "gate_proj.weight": (f, h), q + "up_proj.weight": (f, h),
                               q + "down_proj.weight": (h, f)})
        else:
            shapes.update({p + "mlp.gate_proj.weight": (arch.intermediate_size, h),
                           p + "mlp.up_proj.weight": (arch.intermediate_size, h),
                           p + "mlp.down_proj.weight": (h, arch.intermediate_size)})
        if arch.qk_norm:
            shapes.update({p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,)})
        if arch.qkv_bias:
            shapes.update({p + "self_attn.q_proj.bias": (arch.num_heads * hd,),
                           p + "self_attn.k_proj.bias": (arch.num_kv_heads * hd,),
                           p + "self_attn.v_proj.bias": (arch.num_kv_heads * hd,)})
    return shapes


# -------------------------------------------------------------------------------------------- load/export


def _stage_layers(arch) -> tuple[int, int]:
    from megatron.core import parallel_state as ps

    pp, rank = ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()
    per = arch.num_layers // pp
    return rank * per, per


def local_params(model) -> dict[str, torch.Tensor]:
    """This rank's parameters by local name (Transformer Engine's `_extra_state` entries left out)."""
    return {k: v for k, v in model.state_dict(keep_vars=True).items() if "_extra_state" not in k}


def expert_layout() -> tuple[int, int, int, int]:
    """(EP size, EP rank, expert TP size, expert TP rank) of this rank (1, 0, TP, TP rank without experts)."""
    from megatron.core import parallel_state as ps

    return (ps.get_expert_model_parallel_world_size(), ps.get_expert_model_parallel_rank(),
            ps.get_expert_tensor_parallel_world_size(), ps.get_expert_tensor_parallel_rank())


def owner_stage(mname: str, gi: int | None, pp: int, per: int) -> int:
    """The pipeline stage that holds a table row: embeddings on the first, the head on the last, layer gi on gi // per."""
    return (0 if mname.startswith("embedding") else pp - 1) if gi is None else gi // per


def load_hf_weights(model, model_dir: str | Path, arch, *, use_te: bool = False) -> None:
    """Copies a HF checkpoint into this rank's Megatron chunk (its TP shard of its PP stage's layers, and its
    EP rank's experts, each its expert-TP shard)."""
    from megatron.core import parallel_state as ps

    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    ep, ep_rank, etp, etp_rank = expert_layout()
    local_experts = arch.num_experts // ep if arch.num_experts else 0
    first, per = _stage_layers(arch)
    reader = HFReader(model_dir)
    params = local_params(model)
    done = set()

    def put(name: str, names: list[str], layout: str, expert: bool) -> None:
        size, rank = (etp, etp_rank) if expert else (tp, tp_rank)
        shard = full_to_shard([reader.get(n) for n in names], layout, size, rank, arch)
        target = params[name]
        if target.shape != shard.shape:
            raise CheckpointError(f"{name}: checkpoint shard {tuple(shard.shape)} != model {tuple(target.shape)}")
        with torch.no_grad():
            target.copy_(shard.to(target.dtype))
        done.add(name)

    for mname, layout, names, gi, e in export_order(arch, use_te=use_te, order="table"):
        if gi is not None and not first <= gi < first + per:
            continue
        if e is not None and e // local_experts != ep_rank:
            continue
        name = local_param_name(mname, gi, e, first, local_experts)
        if name in params:
            put(name, names, layout, e is not None)
    if arch.tie_word_embeddings and "output_layer.weight" in params:
        put("output_layer.weight", ["model.embed_tokens.weight"], "vocab", False)  # last stage's copy
    missing = set(params) - done
    if missing:
        raise CheckpointError(f"parameters not covered by the HF weight table: {sorted(missing)}")


def local_param_name(mname: str, gi: int | None, e: int | None, first_layer: int, local_experts: int) -> str:
    """A table name with its layer and expert made local to this stage and EP rank."""
    if gi is None:
        return mname
    return mname.format(i=gi - first_layer, e=e % local_experts if e is not None else None)


def export_hf_weights(model, arch, *, use_te: bool = False, dtype: torch.dtype | None = None,
                      tensors: dict[str, torch.Tensor] | None = None, order: str = "layer"
                      ) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields (HF name, full tensor) for the whole model on every rank; a collective, see module docstring.

    `tensors` replaces the parameters by other tensors of the same names and shapes (gradients, for tests
    and debugging). `order`: see `export_order`."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    tp_group, pp_group = ps.get_tensor_model_parallel_group(), ps.get_pipeline_model_parallel_group()
    tp = ps.get_tensor_model_parallel_world_size()
    pp = ps.get_pipeline_model_parallel_world_size()
    pp_ranks = dist.get_process_group_ranks(pp_group) if pp > 1 else [dist.get_rank()]
    ep, ep_rank, etp, _ = expert_layout()
    if arch.num_experts:
        ep_group, etp_group = ps.get_expert_model_parallel_group(), ps.get_expert_tensor_parallel_group()
        ep_ranks = dist.get_process_group_ranks(ep_group) if ep > 1 else [dist.get_rank()]
    local_experts = arch.num_experts // ep if arch.num_experts else 0
    my_stage = ps.get_pipeline_model_parallel_rank()
    per = arch.num_layers // pp
    params = tensors if tensors is not None else local_params(model)
    shapes = hf_shapes(arch)
    out_dtype = dtype or next(iter(params.values())).dtype
    device = next(iter(params.values())).device
    for mname, layout, names, gi, e in export_order(arch, use_te=use_te, order=order):
        owner = owner_stage(mname, gi, pp, per)
        owner_ep = e // local_experts if e is not None else ep_rank
        size, group = (etp, etp_group) if e is not None else (tp, tp_group)
        fulls: list[torch.Tensor]
        if owner == my_stage and owner_ep == ep_rank:
            local = params[local_param_name(mname, gi, e, owner * per, local_experts or 1)].detach()
            if size > 1 and layout != "replicated":
                gathered = [torch.empty_like(local) for _ in range(size)]
                dist.all_gather(gathered, local.contiguous(), group=group)
            else:
                gathered = [local] * size
            fulls = [t.to(out_dtype).contiguous() for t in shards_to_full(gathered, layout, arch)]
        else:
            fulls = [torch.empty(shapes[n], dtype=out_dtype, device=device) for n in names]
        if e is not None and ep > 1 and owner == my_stage:  # the expert's EP rank hands it to the others
            for t in fulls:
                dist.broadcast(t, src=ep_ranks[owner_ep], group=ep_group)
        if pp > 1:
            for t in fulls:
                dist.broadcast(t, src=pp_ranks[owner], group=pp_group)
        for n, t in zip(names, fulls):
            yield n, t


EXPORT_ORDERS = ("layer", "table")


def export_order(arch, *, use_te: bool = False, order: str = "layer"
                 ) -> list[tuple[str, str, list[str], int | None, int | None]]:
    """(Megatron name with `{i}` / `{e}`, layout, HF names, global layer or None, global expert or None) of every
    exported row, in send order.

    `layer` (the default): the embedding, then layer by layer every tensor of that layer (norms, q/k/v
    weights *and* biases, q/k norms, o, then gate/up, down, or an MoE layer's router and experts in expert
    order), then the final norm and the output layer. vLLM's layerwise reload keeps a module's tensors until
    all of them have arrived, so in this order an engine holds at most the one layer being loaded. `table`:
    `WEIGHT_TABLE`'s row order for every layer, then `EXPERT_TABLE`'s (every layer's q/k/v weights before any
    q/k/v bias), the order before; it makes the engine hold every layer's q/k/v weights until the biases
    come (kept for the before/after benchmark). A tied output layer is not exported: the embedding already
    carries it."""
    if order not in EXPORT_ORDERS:
        raise ValueError(f"weight export order {order!r}: expected one of {EXPORT_ORDERS}")
    shapes = hf_shapes(arch)
    rows = [r for r in _rows(use_te) if not (r[0] == "output_layer.weight" and arch.tie_word_embeddings)]
    head = [(r, None) for r in rows[:next(k for k, r in enumerate(rows) if "{i}" in r[0])] if "{i}" not in r[0]]
    tail = [(r, None) for r in rows if "{i}" not in r[0] and (r, None) not in head]
    if order == "table":
        dense = [(r, local not in DENSE_MLP_ROWS) for r, (local, *_) in zip(_rows(use_te), WEIGHT_TABLE)]
        cells = ([(r, gi) for r, in_moe in dense if "{i}" in r[0] for gi in range(arch.num_layers)
                  if in_moe or not arch.is_moe_layer(gi)]
                 + [(r, gi) for r in _rows(use_te, EXPERT_TABLE) for gi in range(arch.num_layers)
                    if arch.is_moe_layer(gi)])
    else:
        cells = [(r, gi) for gi in range(arch.num_layers) for r in _layer_rows(arch, gi, use_te)]
    out = []
    for (mname, hf_names, layout), gi in head + cells + tail:
        for e in range(arch.num_experts) if "{e}" in mname else [None]:
            names = [n.format(i=gi, e=e) for n in hf_names]
            if names[0] in shapes:  # (not: e.g. the qkv bias of a model without one)
                out.append((mname, layout, names, gi, e))
    return out

