"""The launch planner on Qwen3 dense and Qwen3-MoE shapes: parameter counts against transformers, the expert
layout's memory per GPU by hand, the distributed optimizer over expert-data-parallel, and the one-line
refusals of an expert layout megatron-core cannot build or that cannot fit. CPU only, config.json files only.

    python -m pytest tests/test_plan_moe.py -q
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from megatron_sortedrl.config import load_config
from megatron_sortedrl.errors import UserError
from megatron_sortedrl.plan.arch import Arch
from megatron_sortedrl.plan.moe_memory import moe_dispatch_bytes, moe_mlp_activations
from megatron_sortedrl.plan.planner import check_plan, make_plan
from megatron_sortedrl.plan.trainer_memory import stage_param_split, trainer_memory

REPO = Path(__file__).resolve().parent.parent
SHAPES = REPO / "configs" / "model_shapes"
QWEN3 = ("qwen3-8b", "qwen3-32b", "qwen3-30b-a3b", "qwen3-235b-a22b")
ENV = {"MSRL_MODEL_DIR": "/unset/model", "MSRL_DATA_DIR": "/unset/data", "MSRL_RUN_DIR": "/unset/run"}

# A small Qwen3-MoE: 4 layers, every second one sparse except layer 1 (mlp_only_layers), 8 experts, top-2.
TOY = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 64,
       "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
       "intermediate_size": 96, "moe_intermediate_size": 16, "num_experts": 8, "num_experts_per_tok": 2,
       "decoder_sparse_step": 1, "mlp_only_layers": [1], "norm_topk_prob": True, "vocab_size": 128,
       "max_position_embeddings": 512, "tie_word_embeddings": False}


def _recipe(name: str, overrides=()):
    old = {k: os.environ.get(k) for k in ENV}
    os.environ.update({k: v for k, v in ENV.items() if not os.environ.get(k)})
    try:
        return load_config(REPO / "configs" / name, list(overrides))
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)


def _transformers_count(cfg_dir_or_dict) -> int:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if isinstance(cfg_dir_or_dict, dict):
        from transformers import Qwen3MoeConfig

        hf = Qwen3MoeConfig(**{k: v for k, v in cfg_dir_or_dict.items() if k not in ("architectures", "model_type")})
    else:
        hf = AutoConfig.from_pretrained(cfg_dir_or_dict)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf)
    return sum(p.numel() for p in model.parameters())


# ------------------------------------------------------------------------------------------- shapes


@pytest.mark.parametrize("name", QWEN3)
def test_qwen3_param_count_matches_transformers(name):
    """Our count from the shapes (q/k norms, head_dim, every expert, the router) equals transformers' model."""
    assert Arch.from_path(SHAPES / name).num_params == _transformers_count(SHAPES / name)


def test_sparse_layers_follow_decoder_sparse_step_and_mlp_only_layers():
    for step, dense_only in ((1, [1]), (2, []), (2, [3]), (1, [])):
        cfg = {**TOY, "decoder_sparse_step": step, "mlp_only_layers": dense_only}
        arch = Arch.from_dict(cfg)
        assert arch.moe_layers == tuple(i for i in range(4) if i not in dense_only and (i + 1) % step == 0)
        assert arch.num_params == _transformers_count(cfg), (step, dense_only)


def test_head_dim_and_active_params_of_the_public_shapes():
    q32 = Arch.from_path(SHAPES / "qwen3-32b")
    assert q32.q_dim == 64 * 128 != q32.hidden_size  # planned as Qwen2 this would be 5120
    assert q32.kv_bytes_per_token(2) == 2 * 64 * 8 * 128 * 2
    a3b = Arch.from_path(SHAPES / "qwen3-30b-a3b")
    a22b = Arch.from_path(SHAPES / "qwen3-235b-a22b")
    # The published sizes: 30.5B total / 3.3B activated, 235B / 22B.
    assert round(a3b.num_params / 1e9, 1) == 30.5 and round(a3b.active_params / 1e9, 1) == 3.4
    assert round(a22b.num_params / 1e9) == 235 and round(a22b.active_params / 1e9) == 22
    for a in (a3b, a22b):  # active = total less the experts a token does not use
        unused = len(a.moe_layers) * (a.num_experts - a.experts_per_token) * 3 * a.hidden_size * a.moe_intermediate_size
        assert a.active_params == a.num_params - unused
    dense = Arch.from_path(SHAPES / "qwen3-8b")
    assert dense.active_params == dense.num_params and not dense.is_moe


# ------------------------------------------------------------------------------------------- trainer memory


def test_expert_layout_params_per_gpu_by_hand():
    arch = Arch.from_dict(TOY)
    h, E, f = 64, 8, 16
    attn = h * (128 + 2 * 64) + 128 * h  # q 4x32, k/v 2x32 each, o; no bias
    repl = 2 * h + 2 * 32  # two norms + q/k norms (head_dim each)
    expert = 3 * h * f
    emb = 128 * h
    # TP=2, PP=2, EP=4, ETP=1: stage 0 holds layers 0 (sparse) and 1 (dense), stage 1 layers 2 and 3 (sparse)
    dense0, experts0 = stage_param_split(arch, tp=2, pp=2, stage=0, ep=4, etp=1)
    assert dense0 == int(attn / 2 + repl + h * E) + int(attn / 2 + 3 * h * 96 / 2 + repl) + emb // 2
    assert experts0 == E // 4 * expert  # two experts of layer 0 on this EP rank
    dense1, experts1 = stage_param_split(arch, tp=2, pp=2, stage=1, ep=4, etp=1)
    assert dense1 == 2 * int(attn / 2 + repl + h * E) + h + emb // 2
    assert experts1 == 2 * E // 4 * expert
    # ETP=2 halves every expert again; EP=1 holds all of them
    assert stage_param_split(arch, tp=2, pp=2, stage=1, ep=4, etp=2)[1] == experts1 // 2
    assert stage_param_split(arch, tp=2, pp=2, stage=1, ep=1, etp=1)[1] == 4 * experts1
    # one GPU with the whole model holds every parameter once
    assert sum(stage_param_split(arch, tp=1, pp=1, stage=0, ep=1, etp=1)) == arch.num_params


def test_distributed_optimizer_shards_experts_over_expert_data_parallel():
    """Dense state / DP, expert state / EDP (= TP x DP / (EP x ETP)), as megatron's distributed optimizer does."""
    arch = Arch.from_dict(TOY)
    kw = {"tp": 2, "pp": 1, "dp": 8, "micro_batch_tokens": 256, "longest_sequence": 256, "spec": "te",
          "sequence_parallel": True, "dtype": "bfloat16"}
    dense, experts = stage_param_split(arch, tp=2, pp=1, stage=0, ep=4, etp=1)
    mem = trainer_memory(arch, distributed_optimizer=True, ep=4, etp=1, **kw)
    edp = 2 * 8 // (4 * 1)
    assert mem.stages[0].items["optimizer"] == int(dense * 12 / 8 + experts * 12 / edp)
    assert mem.stages[0].items["optimizer_other"] == (dense + experts) * 12
    assert mem.stages[0].items["weights"] == (dense + experts) * 2
    assert mem.stages[0].items["gradients"] == (dense + experts) * 4
    # more EP: fewer experts per GPU, but each expert's state is shared by fewer replicas
    more = trainer_memory(arch, distributed_optimizer=True, ep=8, etp=1, **kw).stages[0].items
    assert more["weights"] < mem.stages[0].items["weights"]


def test_moe_activation_terms():
    arch = Arch.from_dict(TOY)
    base = moe_mlp_activations(arch, tokens=1024, tp=2, spd=2, dtype_bytes=2, spec="te", ep=4, etp=1, imbalance=1.0)
    # the busiest EP rank receives top-k x its local tokens: 1024 / 2 (SP) x 2 (top-2), hidden 64, bf16
    assert base["expert inputs (dispatched tokens, x ETP after its all-gather)"] == 512 * 2 * 64 * 2
    assert base["expert SwiGLU (per ETP slice)"] == 512 * 2 * 3 * 16 * 2
    assert base["router (fp32 input, logits, probabilities)"] == 512 * (64 + 2 * 8) * 4
    hot = moe_mlp_activations(arch, tokens=1024, tp=2, spd=2, dtype_bytes=2, spec="te", ep=4, etp=1, imbalance=1.5)
    assert hot["expert SwiGLU (per ETP slice)"] == 1.5 * base["expert SwiGLU (per ETP slice)"]
    assert moe_dispatch_bytes(arch, tokens=1024, spd=2, dtype_bytes=2, imbalance=1.0) == 2 * 512 * 2 * 64 * 2
    # full recompute keeps no expert activation between layers; none keeps them for every sparse layer
    kw = {"tp": 2, "pp": 1, "dp": 4, "micro_batch_tokens": 1024, "longest_sequence": 1024, "spec": "te",
          "sequence_parallel": True, "ep": 4, "etp": 1}
    none = trainer_memory(arch, recompute="none", **kw).stages[0]
    full = trainer_memory(arch, recompute="full", **kw).stages[0]
    assert none.activation_items["expert SwiGLU (per ETP slice)"] == 3 * int(1.5 * base["expert SwiGLU (per ETP slice)"])
    assert "expert SwiGLU (per ETP slice)" not in full.activation_items
    assert none.items["moe_dispatch"] == full.items["moe_dispatch"] > 0
    assert full.total < none.total


# ------------------------------------------------------------------------------------------- the plan


def _plan_lines(args: list[str]) -> tuple[int, list[str]]:
    import contextlib
    import io

    from megatron_sortedrl.cli import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = main(args)
    return rc, [line for line in err.getvalue().strip().splitlines() if not line.startswith("(planning only")]


@pytest.mark.parametrize("override, text", [
    ("parallel.expert_model_parallel_size=3", "EP=3 does not divide the 128 experts"),
    ("parallel.expert_model_parallel_size=64", "EP=64 x ETP=1 does not divide TP x DP = 32"),
    ("parallel.sequence_parallel=false", "set parallel.sequence_parallel=true"),
])
def test_plan_refuses_an_expert_layout_megatron_cannot_build(override, text):
    rc, lines = _plan_lines(["plan", str(REPO / "configs" / "qwen3_235b_a22b_128gpu.yaml"), "--model-config",
                             str(SHAPES / "qwen3-235b-a22b"), override])
    assert rc == 2 and len(lines) == 1 and text in lines[0], lines


def test_expert_parallelism_on_a_dense_model_is_refused():
    cfg = _recipe("qwen3_8b_8gpu.yaml", ["parallel.expert_model_parallel_size=2"])
    with pytest.raises(UserError, match="dense model"):
        make_plan(cfg, Arch.from_path(SHAPES / "qwen3-8b"))


def test_train_refuses_an_moe_layout_that_cannot_fit():
    """235B at EP=1 puts all 128 experts of every layer on each GPU: one line naming the expert parallelism."""
    cfg = _recipe("qwen3_235b_a22b_128gpu.yaml", ["parallel.expert_model_parallel_size=1"])
    with pytest.raises(UserError) as exc:
        check_plan(cfg, Arch.from_path(SHAPES / "qwen3-235b-a22b"), log=lambda *_: None)
    line = str(exc.value)
    assert "\n" not in line and "trainer stage" in line and "parallel.expert_model_parallel_size" in line, line
    assert make_plan(_recipe("qwen3_235b_a22b_128gpu.yaml"), Arch.from_path(SHAPES / "qwen3-235b-a22b")).fits


def test_engines_hold_total_parameters_and_plan_json_has_the_moe_fields(tmp_path):
    arch = Arch.from_path(SHAPES / "qwen3-30b-a3b")
    cfg = _recipe("qwen3_30b_a3b_32gpu.yaml")
    plan = make_plan(cfg, arch)
    tp = cfg.rollout.tensor_parallel_size
    assert plan.engines["short"]["weights"] == arch.num_params * 2 / tp
    assert plan.sync["bytes"] == arch.num_params * 2
    doc = json.loads(json.dumps(plan.to_dict()))
    assert doc["model"]["num_experts"] == 128 and doc["model"]["experts_per_token"] == 8
    assert any("active params" in line for line in plan.explain)
