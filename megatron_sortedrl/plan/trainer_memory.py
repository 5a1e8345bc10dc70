"""Trainer memory per GPU and per pipeline stage: weights, gradients, optimizer state, activations, logits.

    from megatron_sortedrl.plan.trainer_memory import trainer_memory, trainer_memory_for_config
    mem = trainer_memory(arch, tp=8, pp=2, dp=4, sequence_parallel=True, distributed_optimizer=True,
                         dtype="bfloat16", micro_batch_tokens=65536, longest_sequence=34816, spec="te")
    mem.peak_bytes, mem.worst_stage.items, print("\\n".join(mem.explain))
    python benchmarks/plan_vs_measured.py          # checks the `local` model against CPU measurement

Pure arithmetic on a model's shape (an `HFArch` from `trainer/model.py read_hf_config`, or any object with
the same attributes): no torch, no GPU, no weights. Written here because no library models Megatron-core's
memory for our two layer specs; Megatron-LM's `theoretical_memory_usage.py` is the nearest thing and is
used as a reference in tests/test_plan_memory.py and docs/benchmarks/plan_vs_megatron.md, where the
differences are explained.

What is counted (bytes per GPU of one stage):

* weights: this stage's parameters / TP (norms are replicated), in the model dtype;
* gradients: fp32 main gradients (the trainer's DDP uses grad_reduce_in_fp32=True);
* optimizer: Adam moments (8 B/param) plus an fp32 master copy for bf16/fp16 (4 B/param), divided by DP
  with the distributed optimizer; the other variant is reported as `optimizer_other` (not in the total);
* activations saved for backward by one micro-batch, for (a) the longest sequence alone and (b) a full
  micro-batch of `micro_batch_tokens` in rows of up to min(longest, micro_batch_tokens) tokens (a bound:
  the packer keeps rows x longest row <= the budget), under the configured recompute; 1F1B keeps `pp - stage` micro-batches in flight on a stage, all assumed worst-case;
* the backward transient of recompute (one recomputed group's activations), and the backward working set:
  the gradients alive while one layer's backward runs: the incoming residual gradient plus the larger of
  fc1's output gradient (2 ffn / TP per token) and the attention's (local: the s x s fp32 score gradient;
  te: dq, dk, dv and the output gradient), plus the largest weight-gradient temporary. Checked against
  the heap peak of a CPU forward + backward (docs/benchmarks/plan_vs_measured.md: the estimate is 0.93x
  to 1.36x of the measured peak);
* on the last stage the logits transient of the chunked log-prob path (trainer/logprobs.py: it keeps the
  logits in the model dtype and three fp32 values per token for backward, and works on chunks of
  `logits_chunk_tokens` rows): the vocab-parallel logits, their gradient, the per-token statistics, four
  fp32 chunk buffers (the backward's scaled logits, probabilities, gradient and log-probabilities) and,
  when top-p/top-k truncate, the chunk's all-gathered full-vocabulary logits, their concatenation and sort.

Two layer specs. `local` is megatron-core 0.16's local spec as the CPU trainer builds it (the counts below
were read from its forward code and confirmed with autograd's saved-tensor hooks, see
measure_activations.py): a composite RMSNorm that keeps an fp32 copy of its input, the fp32 rsqrt and the
fp32 normalised tensor; key/value heads repeated to the query heads before an unfused attention that keeps
the s x s fp32 softmax (and its cast to the model dtype) and an s x s boolean causal mask; rotary cos/sin
per layer; SwiGLU keeping fc1's output, silu's output, the offset linear half and fc2's input.
`te` is the Transformer Engine spec (GPU): fused norm+linear keeping input, normalised output and rsigma;
flash attention keeping q, k, v (GQA-sized; v is a view of the fused qkv output, so all of it stays), the
output and the fp32 log-sum-exp, no s x s tensors. The `te` counts are not measurable on CPU; `make
gpu-check` is where they meet hardware.

Mixture of Experts (an `Arch` with `num_experts`; the terms are in `plan/moe_memory.py`): megatron-core's layout with the
alltoall dispatcher. Attention, norms and shared experts are split over TP and replicated over DP; the
routed experts of a layer are split over EP ranks (`num_experts / EP` each) and each expert over ETP
(expert tensor parallelism), the EP x ETP groups carved out of TP x DP, leaving expert-data-parallel
EDP = TP x DP / (EP x ETP) replicas of each expert. The router (hidden x experts) is replicated. Gradients are
fp32 for both parts; the distributed optimizer shards the dense part's state over DP and the experts' over
EDP, as megatron's does. A sparse layer's activations replace the dense MLP's with: the router's fp32 input,
logits and probabilities; the tokens this rank's experts receive (each local token goes to top-k experts, so
on average `k` x the rank's tokens arrive, times `MOE_IMBALANCE` for the busiest rank, and x ETP after the
ETP all-gather) as expert inputs, their SwiGLU activations (fc1 output and activation, per ETP slice) and
their outputs before un-permutation; shared experts like a dense MLP. Recompute (full) drops them as for a
dense layer. The all-to-all send and receive buffers of one layer (`moe_dispatch`) are a transient of
forward and backward. Not measurable on CPU here (the trainer has no MoE on this code path yet): a GPU
run with `make gpu-check` is where these terms meet hardware.

Deliberately left out: virtual pipeline stages, context parallelism, MoE token dropping and capacity
factors (no tokens are dropped, as in the recipes), the allgather and flex dispatchers, CUDA caching-allocator
fragmentation, NCCL/communication buffers, the CUDA context and cuBLAS workspaces (the planner adds a
reserve for those), DDP bucket padding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from megatron_sortedrl.plan.moe_memory import (MOE_IMBALANCE, check_expert_layout, moe_dispatch_bytes,
                                               moe_mlp_activations, moe_received_tokens)

GIB = 1024 ** 3
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
SPECS = ("local", "te")
RECOMPUTE = ("none", "selective", "full")


def gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB"


@dataclass
class StageMemory:
    """One pipeline stage's memory per GPU, in bytes. `items` holds everything; `total` is their peak sum."""

    stage: int
    layers: int
    in_flight: int  # micro-batches whose activations the stage holds at once under 1F1B
    items: dict[str, int] = field(default_factory=dict)
    activation_items: dict[str, int] = field(default_factory=dict)  # one worst micro-batch, by tensor kind

    # Keys of `items` that add up to the stage's peak (the others are for information).
    TOTAL_KEYS = ("weights", "gradients", "optimizer", "activations", "recompute_transient", "backward_working_set",
                  "logits", "moe_dispatch")  # moe_dispatch only for MoE models

    @property
    def total(self) -> int:
        return sum(self.items.get(k, 0) for k in self.TOTAL_KEYS)


@dataclass
class TrainerMemory:
    """Per-stage memory per GPU (`stages[i]`), the worst stage, and the arithmetic as text lines."""

    stages: list[StageMemory]
    explain: list[str]
    params_total: int  # parameters of the whole model (all stages, unsharded)

    @property
    def worst_stage(self) -> StageMemory:
        return max(self.stages, key=lambda s: s.total)

    @property
    def peak_bytes(self) -> int:
        return self.worst_stage.total


# ----------------------------------------------------------------------------------------- parameters

def _moe(arch) -> bool:
    if getattr(arch, "num_experts", 0) and not hasattr(arch, "moe_layers"):  # would silently plan it dense
        raise ValueError(f"an MoE shape needs plan.arch.Arch (it knows which layers are sparse), not {type(arch).__name__}")
    return bool(getattr(arch, "num_experts", 0) and getattr(arch, "moe_layers", ()))


def layer_params(arch, i: int = 0) -> tuple[int, int]:
    """(parameters of layer `i` split over TP, replicated ones (the two norms, q/k norms, the router)); a sparse
    layer's routed experts are not in either (`expert_layer_params`)."""
    qd, kvd = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    qkv = arch.hidden_size * (qd + 2 * kvd) + ((qd + 2 * kvd) if arch.qkv_bias else 0)
    proj = qd * arch.hidden_size
    repl = 2 * arch.hidden_size + (2 * arch.head_dim if getattr(arch, "qk_norm", False) else 0)
    if _moe(arch) and i in arch.moe_layers:
        return qkv + proj + 3 * arch.hidden_size * arch.shared_expert_intermediate_size, repl + arch.router_params
    return qkv + proj + 3 * arch.hidden_size * arch.intermediate_size, repl


def expert_layer_params(arch, i: int) -> int:
    """Routed-expert parameters of layer `i` (0 for a dense layer)."""
    return arch.num_experts * arch.expert_params if _moe(arch) and i in arch.moe_layers else 0


def padded_vocab(arch, tp: int) -> int:
    """As trainer/model.py pads it: up to a multiple of TP."""
    return -(-arch.vocab_size // tp) * tp


def stage_param_split(arch, tp: int, pp: int, stage: int, ep: int = 1, etp: int = 0) -> tuple[int, int]:
    """(dense, expert) parameters held by one GPU of `stage`: the TP shard of the split layers + replicated norms
    (+ router), and the routed experts of this EP rank split over ETP (`etp` 0: the same as TP)."""
    etp = etp or tp
    per_stage = arch.num_layers // pp
    layers = range(stage * per_stage, (stage + 1) * per_stage)
    n = 0.0
    for i in layers:
        split, repl = layer_params(arch, i)
        n += split / tp + repl
    experts = sum(expert_layer_params(arch, i) for i in layers) / ep / etp
    emb = padded_vocab(arch, tp) * arch.hidden_size / tp
    if stage == 0:
        n += emb
    if stage == pp - 1:
        n += arch.hidden_size  # final norm
        if not arch.tie_word_embeddings or pp > 1:  # tied and pp > 1: the last stage keeps its own copy
            n += emb
    return int(n), int(experts)


def stage_params(arch, tp: int, pp: int, stage: int, ep: int = 1, etp: int = 0) -> int:
    """Parameters held by one GPU of `stage` (TP shard of the split layers + replicated norms + its experts)."""
    return sum(stage_param_split(arch, tp, pp, stage, ep, etp))


def total_params(arch) -> int:
    emb = arch.vocab_size * arch.hidden_size
    layers = sum(sum(layer_params(arch, i)) + expert_layer_params(arch, i) for i in range(arch.num_layers))
    return layers + arch.hidden_size + emb * (1 if arch.tie_word_embeddings else 2)


# ---------------------------------------------------------------------------------------- activations

def layer_activations(arch, *, rows: float, row_len: int, tp: int, sequence_parallel: bool, dtype_bytes: int,
                      spec: str, selective: bool = False, moe: dict | None = None) -> dict[str, float]:
    """Bytes one transformer layer saves for backward for one micro-batch of `rows` x `row_len` tokens, by kind.

    `moe` ({"ep", "etp", "imbalance"}): a sparse layer, whose MLP items are `moe_mlp_activations`'s."""
    e, h, hd = dtype_bytes, arch.hidden_size, arch.head_dim
    tokens = rows * row_len
    spd = tp if (sequence_parallel and tp > 1) else 1  # tensors of the residual stream are split under SP
    qd, kvd = arch.num_heads // tp * hd, arch.num_kv_heads // tp * hd
    nq = arch.num_heads // tp
    f = arch.intermediate_size / tp
    out: dict[str, float] = {}
    if spec == "local":
        out["norms (fp32 input copy, rsqrt, normalised)"] = 2 * tokens / spd * (8 * h + 4)
        out["qkv/fc1 inputs (norm outputs)"] = 2 * tokens / spd * h * e
        out["rotary cos/sin (q and k)"] = 4 * row_len * hd * e
        if selective:  # the checkpointed core attention keeps its inputs: roped q, roped k, v (a view of qkv)
            out["core-attention inputs (q, k roped; qkv output)"] = tokens * (qd + kvd + qd + 2 * kvd) * e
        else:
            out["q, k, v (k, v repeated to query heads)"] = 3 * tokens * qd * e
            out["causal mask (bool s x s)"] = row_len * row_len
            out["softmax (fp32 s x s per head)"] = rows * nq * row_len * row_len * 4
            if e != 4:
                out["softmax cast to model dtype"] = rows * nq * row_len * row_len * e
        out["attention output (proj input)"] = tokens * qd * e
        if moe is None:
            out["SwiGLU (fc1 out 2f, silu out, linear half, fc2 in)"] = tokens * 5 * f * e
    elif spec == "te":
        out["fused norms (input, normalised output, rsigma)"] = 2 * tokens / spd * (2 * h * e + 4)
        out["qkv output (held by v) + roped q, k"] = tokens * ((qd + 2 * kvd) + (qd + kvd)) * e
        if not selective:
            out["flash-attention log-sum-exp (fp32)"] = tokens * nq * 4
        out["attention output (proj input)"] = tokens * qd * e
        if moe is None:
            out["SwiGLU (fc1 out 2f, activation out)"] = tokens * 3 * f * e
    else:
        raise ValueError(f"spec {spec!r}: expected one of {SPECS}")
    if moe is not None:
        out.update(moe_mlp_activations(arch, tokens=tokens, tp=tp, spd=spd, dtype_bytes=e, spec=spec, **moe))
    return out


def _edge_activations(arch, *, first: bool, last: bool, tokens: float, row_len: int, tp: int, spd: int,
                      dtype_bytes: int, spec: str) -> dict[str, float]:
    e, h = dtype_bytes, arch.hidden_size
    out: dict[str, float] = {}
    if spec == "te":  # fused rope keeps the (s, 1, 1, head_dim) fp32 frequencies, one tensor shared by all layers
        out["rotary frequencies (fp32, shared)"] = row_len * arch.head_dim * 4
    if first:
        # token ids (int64); a vocab-parallel embedding also keeps its boolean out-of-range mask
        out["embedding input ids"] = tokens * (8 + (1 if tp > 1 else 0))
    if last:
        norm = (8 * h + 4) if spec == "local" else (h * e + 4)
        out["final norm"] = tokens / spd * norm
        out["output-layer input"] = tokens / spd * h * e
    return out


def microbatch_activations(arch, *, rows: float, row_len: int, layers: int, first: bool, last: bool, tp: int = 1,
                           sequence_parallel: bool = False, dtype_bytes: int = 2, spec: str = "local",
                           recompute: str = "none", recompute_method: str = "uniform",
                           recompute_num_layers: int = 1, moe_layers: int = 0,
                           moe: dict | None = None) -> tuple[dict[str, float], float]:
    """Bytes saved for backward by one micro-batch on one stage (by kind), and the recompute backward transient.

    `moe_layers` of the stage's `layers` are sparse (`moe`: {"ep", "etp", "imbalance"}). This is what
    `measure_activations.py` measures on CPU for a dense model (forward of the model chunk, no loss)."""
    spd = tp if (sequence_parallel and tp > 1) else 1
    tokens = rows * row_len
    kw = {"rows": rows, "row_len": row_len, "tp": tp, "sequence_parallel": sequence_parallel, "dtype_bytes": dtype_bytes,
              "spec": spec}
    if moe_layers:
        if moe is None:
            raise ValueError("moe_layers > 0 needs moe={'ep': ..., 'etp': ..., 'imbalance': ...}")
        sparse = layer_activations(arch, **kw, moe=moe)

        def mixed(d: dict, m: dict) -> dict:
            """The stage's layers: `moe_layers` sparse ones and the rest dense, per layer on average."""
            keys = dict.fromkeys([*d, *m])
            return {k: ((layers - moe_layers) * d.get(k, 0.0) + moe_layers * m.get(k, 0.0)) / layers for k in keys}
    full_layer = layer_activations(arch, **kw)
    if moe_layers:  # recompute and transients use the heavier layer kind (a sparse one in Qwen3-MoE)
        full_layer = sparse if sum(sparse.values()) >= sum(full_layer.values()) else full_layer
    items: dict[str, float] = {}
    transient = 0.0
    if recompute == "full":
        n = recompute_num_layers
        if recompute_method == "uniform":
            checkpoints, kept = math.ceil(layers / n), 0
            transient = min(n, layers) * sum(full_layer.values())
        else:  # block: the first n layers of the stage are checkpointed one by one, the rest keep everything
            checkpoints, kept = min(n, layers), max(layers - n, 0)
            # backward reaches the checkpointed (first) layers last, when the kept layers' activations are
            # already freed: a recomputed layer only adds memory when no layer was kept
            transient = sum(full_layer.values()) if checkpoints and not kept else 0.0
        # each checkpoint keeps its input hidden states and the rotary frequencies (one fp32 s x head_dim
        # tensor shared by every checkpoint, so counted once)
        items["checkpointed layer-group inputs"] = checkpoints * tokens / spd * arch.hidden_size * dtype_bytes
        if spec == "local":
            items["rotary frequencies (fp32, shared)"] = row_len * arch.head_dim * 4
        for k, v in full_layer.items():
            items[k] = kept * v
    else:
        sel = recompute == "selective"
        per_layer = layer_activations(arch, **kw, selective=sel) if sel else full_layer
        if moe_layers:
            per_layer = mixed(layer_activations(arch, **kw, selective=sel) if moe_layers < layers else {},
                              layer_activations(arch, **kw, selective=sel, moe=moe))
        for k, v in per_layer.items():
            items[k] = layers * v
        if sel:  # backward recomputes one layer's core attention at a time
            transient = sum(full_layer.values()) - sum(per_layer.values())
    items.update(_edge_activations(arch, first=first, last=last, tokens=tokens, row_len=row_len, tp=tp, spd=spd,
                                   dtype_bytes=dtype_bytes, spec=spec))
    return {k: v for k, v in items.items() if v}, transient


def backward_working_set(arch, *, rows: float, row_len: int, tp: int, sequence_parallel: bool, dtype_bytes: int,
                         spec: str, vocab_weights: bool = False, moe: dict | None = None) -> float:
    """Gradient bytes alive at once while one layer's backward runs (see the module docstring).

    Activation gradients plus the largest weight-gradient temporary (fc1's, or the embedding / output
    layer's on the first and last stages, `vocab_weights`), computed before it is added to the fp32 main
    gradient."""
    tokens = rows * row_len
    spd = tp if (sequence_parallel and tp > 1) else 1
    e = dtype_bytes
    qd, kvd = arch.num_heads // tp * arch.head_dim, arch.num_kv_heads // tp * arch.head_dim
    mlp = tokens * 2 * arch.intermediate_size / tp * e
    if spec == "local":
        attention = rows * (arch.num_heads // tp) * row_len * row_len * 4
    else:
        attention = tokens * (2 * qd + 2 * kvd) * e
    weight = arch.hidden_size * 2 * arch.intermediate_size / tp * e
    if moe is not None:  # a sparse layer: the received tokens' fc1 gradient, the local experts' fc1 weight gradient
        recv = moe_received_tokens(arch, tokens=tokens, spd=spd, imbalance=moe.get("imbalance", MOE_IMBALANCE))
        mlp = recv * 2 * arch.moe_intermediate_size * e
        weight = arch.num_experts / moe["ep"] * arch.hidden_size * 2 * arch.moe_intermediate_size / moe["etp"] * e
    if vocab_weights:
        weight = max(weight, padded_vocab(arch, tp) / tp * arch.hidden_size * e)
    return tokens / spd * arch.hidden_size * e + max(mlp, attention) + weight


# ------------------------------------------------------------------------------------------ the model

def trainer_memory(arch, *, tp: int = 1, pp: int = 1, dp: int = 1, sequence_parallel: bool = False,
                   distributed_optimizer: bool = False, dtype: str = "bfloat16", micro_batch_tokens: int,
                   longest_sequence: int, recompute: str = "none", recompute_method: str = "uniform",
                   recompute_num_layers: int = 1, spec: str = "te", logits_chunk_tokens: int = 512,
                   num_microbatches: int | None = None, truncated_sampling: bool = False, ep: int = 1,
                   etp: int = 0, moe_imbalance: float = MOE_IMBALANCE) -> TrainerMemory:
    """Per-GPU memory of every pipeline stage of the trainer (see the module docstring for what is counted).

    MoE models: `ep` expert parallelism, `etp` expert tensor parallelism (0: TP), `moe_imbalance` the busiest
    EP rank's tokens over the mean.
    `longest_sequence` is prompt + response tokens of the longest sample; `num_microbatches` (per step and
    DP replica) caps the micro-batches in flight when it is below PP (None: assume at least PP).
    `truncated_sampling` (rollout top-p < 1 or top-k > 0) adds the log-prob path's full-vocabulary chunk."""
    if spec not in SPECS:
        raise ValueError(f"spec {spec!r}: expected one of {SPECS}")
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute {recompute!r}: expected one of {RECOMPUTE} (resolve 'auto' first)")
    if recompute_method not in ("uniform", "block"):
        raise ValueError(f"recompute_method {recompute_method!r}: expected uniform or block")
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype {dtype!r}: expected one of {tuple(DTYPE_BYTES)}")
    if arch.num_layers % pp or arch.num_heads % tp or arch.num_kv_heads % tp:
        raise ValueError(f"layout TP={tp} PP={pp} does not divide the model ({arch.num_layers} layers, "
                         f"{arch.num_heads} heads, {arch.num_kv_heads} key/value heads)")
    if min(tp, pp, dp, micro_batch_tokens, longest_sequence, recompute_num_layers, logits_chunk_tokens) < 1:
        raise ValueError("tp, pp, dp, micro_batch_tokens, longest_sequence, recompute_num_layers and "
                         "logits_chunk_tokens must be >= 1")
    etp = etp or tp
    is_moe = _moe(arch)
    edp = (tp * dp) // (ep * etp) if is_moe else dp  # expert-data-parallel replicas of each expert
    if is_moe:
        check_expert_layout(arch, tp=tp, dp=dp, ep=ep, etp=etp)
    moe = {"ep": ep, "etp": etp, "imbalance": moe_imbalance} if is_moe else None
    e = DTYPE_BYTES[dtype]
    sp = sequence_parallel and tp > 1
    master = 4 if e != 4 else 0  # bf16/fp16 keep an fp32 master copy; fp32 params are their own master
    opt_full = 8 + master
    layers = arch.num_layers // pp
    row_len_mb = min(longest_sequence, micro_batch_tokens)
    rows_mb = micro_batch_tokens / row_len_mb
    vocab_local = padded_vocab(arch, tp) // tp
    recompute_desc = recompute if recompute != "full" else f"full ({recompute_method}, num_layers={recompute_num_layers})"
    explain = [
        (f"trainer layout TP={tp} PP={pp} DP={dp}" + (f" EP={ep} ETP={etp} EDP={edp}" if is_moe else "")
         + f", sequence parallel {'on' if sp else 'off'}, "
         f"{'distributed' if distributed_optimizer else 'plain'} optimizer, {dtype}, spec {spec}, "
         f"recompute {recompute_desc}"),
        (f"model: {total_params(arch) / 1e9:.2f} B parameters, {arch.num_layers} layers ({layers} per stage), "
         f"hidden {arch.hidden_size}, ffn {arch.intermediate_size}, heads {arch.num_heads}/{arch.num_kv_heads} kv "
         f"x {arch.head_dim}, vocab {arch.vocab_size} (padded {padded_vocab(arch, tp)})"),
        (f"micro-batch (a): the longest sequence alone, 1 x {longest_sequence} tokens; "
         f"(b) a full micro-batch, {micro_batch_tokens} tokens in rows of up to {row_len_mb} (a bound: rows x len <= budget)"),
    ]
    if is_moe:
        explain.insert(2, (
            f"MoE: {arch.num_experts} experts of ffn {arch.moe_intermediate_size} in {len(arch.moe_layers)} sparse layers "
            f"(ffn {arch.intermediate_size} above: dense layers only), top-{arch.experts_per_token}"
            + (" (top-k weights renormalised)" if arch.norm_topk_prob else "")
            + (f", shared experts ffn {arch.shared_expert_intermediate_size}" if arch.shared_expert_intermediate_size else "")
            + f"; {arch.num_experts // ep} experts per EP rank, each split over ETP={etp}; the busiest EP rank receives "
            f"{moe_imbalance:g} x the mean tokens (plan/moe_memory.py)"))
    stages = []
    for st in range(pp):
        first, last = st == 0, st == pp - 1
        n_dense, n_expert = stage_param_split(arch, tp, pp, st, ep, etp)
        n = n_dense + n_expert
        stage_moe = sum(1 for i in range(st * layers, (st + 1) * layers) if is_moe and i in arch.moe_layers)
        in_flight = pp - st if num_microbatches is None else max(1, min(pp - st, num_microbatches))
        kw = {"layers": layers, "first": first, "last": last, "tp": tp, "sequence_parallel": sp, "dtype_bytes": e,
              "spec": spec, "recompute": recompute, "recompute_method": recompute_method,
              "recompute_num_layers": recompute_num_layers, "moe_layers": stage_moe, "moe": moe}
        act_a, tr_a = microbatch_activations(arch, rows=1, row_len=longest_sequence, **kw)
        act_b, tr_b = microbatch_activations(arch, rows=rows_mb, row_len=row_len_mb, **kw)
        sum_a, sum_b = sum(act_a.values()), sum(act_b.values())
        worst, worst_items, transient = (sum_a, act_a, tr_a) if sum_a >= sum_b else (sum_b, act_b, tr_b)
        rows_w, len_w = (1, longest_sequence) if sum_a >= sum_b else (rows_mb, row_len_mb)
        working = backward_working_set(arch, rows=rows_w, row_len=len_w, tp=tp, sequence_parallel=sp,
                                       dtype_bytes=e, spec=spec, vocab_weights=first or last)
        if stage_moe:
            working = max(working, backward_working_set(arch, rows=rows_w, row_len=len_w, tp=tp, sequence_parallel=sp,
                                                        dtype_bytes=e, spec=spec, vocab_weights=first or last, moe=moe))
        # the distributed optimizer shards the dense part over DP and the experts over expert-DP
        opt_sharded = n_dense * opt_full / dp + n_expert * opt_full / edp
        opt_plain = n * opt_full
        items = {
            "weights": n * e,
            "gradients": n * 4,
            "optimizer": int(opt_sharded if distributed_optimizer else opt_plain),
            "optimizer_other": int(opt_plain if distributed_optimizer else opt_sharded),
            "activations_longest": int(sum_a),
            "activations_microbatch": int(sum_b),
            "activations": int(in_flight * worst),
            "recompute_transient": int(transient),
            "backward_working_set": int(working),
            "logits": 0,
        }
        if stage_moe:
            items["moe_dispatch"] = int(moe_dispatch_bytes(arch, tokens=rows_w * len_w, spd=tp if sp else 1,
                                                           dtype_bytes=e, imbalance=moe_imbalance))
        if last:
            worst_tokens = max(longest_sequence, micro_batch_tokens)
            chunk = min(logits_chunk_tokens, worst_tokens)
            vocab_full = vocab_local * tp
            truncation = 3 * chunk * vocab_full * 4 if truncated_sampling else 0
            items["logits"] = int(2 * worst_tokens * vocab_local * e + 3 * worst_tokens * 4
                                  + 4 * chunk * vocab_local * 4 + truncation)
        stage = StageMemory(st, layers, in_flight, items, {k: int(v) for k, v in worst_items.items()})
        stages.append(stage)
        edges = (", embedding" if first else "") + (", final norm + output layer" if last else "")
        explain += [
            f"stage {st} ({layers} layers{edges}): {n / 1e9:.3f} B parameters per GPU",
            f"  weights    {n:,} x {e} B ({dtype}) = {gib(items['weights'])}",
            f"  gradients  {n:,} x 4 B (fp32 main grads, grad_reduce_in_fp32) = {gib(items['gradients'])}",
            (f"  optimizer  {n:,} x ({'4 master + ' if master else ''}8 Adam)"
             f"{' / DP ' + str(dp) if distributed_optimizer and not stage_moe else ''}"
             + (f" (dense {n_dense:,} / DP {dp}, experts {n_expert:,} / EDP {edp})"
                if distributed_optimizer and stage_moe else "")
             + f" B = {gib(items['optimizer'])}  "
             f"({'plain' if distributed_optimizer else 'distributed'} optimizer would be {gib(items['optimizer_other'])})"),
            f"  activations per micro-batch: (a) longest {gib(sum_a)}, (b) full micro-batch {gib(sum_b)}; worst one:",
        ]
        explain += [f"    {k}: {gib(v)}" for k, v in worst_items.items()]
        explain.append(f"  activations in flight (1F1B, {in_flight} micro-batch{'es' if in_flight > 1 else ''}):"
                       f" {in_flight} x {gib(worst)} = {gib(items['activations'])}")
        if transient:
            explain.append(f"  recompute transient in backward (one recomputed group): {gib(transient)}")
        explain.append(f"  backward working set (one layer's gradients in flight): {gib(working)}")
        if stage_moe:
            explain.append(f"  MoE: {stage_moe} sparse layers; this GPU holds {n_expert:,} expert parameters "
                           f"({arch.num_experts // ep} experts / ETP {etp} per layer); token dispatch buffers (one "
                           f"layer's all-to-all send + receive) {gib(items['moe_dispatch'])}")
        if last:
            explain.append(f"  logits transient: 2 x {worst_tokens} tokens x {vocab_local} vocab/TP x {e} B (logits and"
                           f" their gradient) + 3 fp32 per token + 4 fp32 chunks of {chunk} tokens"
                           + (f" + 3 x {chunk} x {vocab_full} fp32 (top-p/top-k)" if truncation else "")
                           + f" = {gib(items['logits'])}")
        explain.append(f"  stage {st} total per GPU: {gib(stage.total)}")
    worst_stage = max(stages, key=lambda s: s.total)
    explain.append(f"worst stage: {worst_stage.stage}, {gib(worst_stage.total)} per GPU")
    return TrainerMemory(stages, explain, total_params(arch))


def trainer_memory_for_config(cfg, arch, *, spec: str | None = None, recompute: str | None = None,
                              on_gpu: bool | None = None, **kwargs) -> TrainerMemory:
    """`trainer_memory` for a `RunConfig` as the trainer would build it.

    The longest sequence is data.max_prompt_length + rollout.max_response_length. On CPU the trainer uses
    the plain optimizer whatever the config says (see trainer/optimizer.py) and the local spec; on GPU the
    TE spec. `recompute` overrides parallel.recompute.granularity (needed when it is `auto`). The log-prob
    chunk is trainer.logprob_chunk_tokens where the config has it."""
    p = cfg.parallel
    gpu = cfg.cluster.device == "gpu" if on_gpu is None else on_gpu
    granularity = recompute or p.recompute.granularity
    if granularity == "auto":
        raise ValueError("parallel.recompute.granularity is auto: resolve it (or pass recompute=) before planning")
    kwargs.setdefault("logits_chunk_tokens", getattr(cfg.trainer, "logprob_chunk_tokens", 512))
    kwargs.setdefault("truncated_sampling", getattr(cfg.rollout, "top_p", 1.0) < 1.0
                      or getattr(cfg.rollout, "top_k", 0) > 0)
    return trainer_memory(
        arch, tp=p.tensor_model_parallel_size, pp=p.pipeline_model_parallel_size, dp=p.data_parallel_size,
        sequence_parallel=p.sequence_parallel, distributed_optimizer=bool(gpu and p.use_distributed_optimizer),
        dtype=cfg.model.dtype, micro_batch_tokens=cfg.trainer.micro_batch_tokens,
        longest_sequence=cfg.data.max_prompt_length + cfg.rollout.max_response_length,
        recompute=granularity, recompute_method=p.recompute.method, recompute_num_layers=p.recompute.num_layers,
        spec=spec or ("te" if gpu else "local"), ep=p.expert_model_parallel_size,
        etp=p.expert_tensor_parallel_size, **kwargs)
