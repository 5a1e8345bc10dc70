"""The architecture table: which config.json files every command accepts (Qwen2, Llama-3, Qwen3, Qwen3-MoE),
what it refuses in one line naming the key, and what `read_hf_config` derives (explicit head_dim, q/k norms,
experts, the MoE / dense layer pattern). Pure logic, no processes: a second or two.

    pytest tests/test_models.py -q
"""

from __future__ import annotations

import json

import pytest

from megatron_sortedrl.convert.architectures import check_architecture
from megatron_sortedrl.errors import UserError

QWEN3 = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 128, "hidden_size": 64,
         "intermediate_size": 96, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 32, "rms_norm_eps": 1e-6, "max_position_embeddings": 1024, "tie_word_embeddings": True,
         "rope_theta": 10000.0, "hidden_act": "silu", "attention_bias": False, "use_sliding_window": False,
         "sliding_window": None, "layer_types": ["full_attention"] * 4}
QWEN3_MOE = {**QWEN3, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "num_experts": 8,
             "num_experts_per_tok": 2, "moe_intermediate_size": 32, "norm_topk_prob": True, "decoder_sparse_step": 1,
             "mlp_only_layers": [], "router_aux_loss_coef": 0.001, "output_router_logits": False}


@pytest.mark.parametrize("cfg", [QWEN3, QWEN3_MOE, {**QWEN3_MOE, "num_experts": None, "num_local_experts": 8}])
def test_qwen3_and_qwen3_moe_are_accepted(cfg):
    check_architecture(dict(cfg), "config.json")


@pytest.mark.parametrize("change, key", [
    ({"use_sliding_window": True}, "use_sliding_window=True"),
    ({"layer_types": ["full_attention", "sliding_attention"] * 2}, "layer_types="),
    ({"kv_lora_rank": 512}, "kv_lora_rank=512"),  # MLA
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"num_experts": 8}, "num_experts=8"),  # experts on a dense family
])
def test_qwen3_refuses_what_the_table_does_not_model(change, key):
    with pytest.raises(UserError) as info:
        check_architecture({**QWEN3, **change}, "m/config.json")
    line = str(info.value)
    assert "\n" not in line and line.startswith("m/config.json: architecture Qwen3ForCausalLM with ") and key in line


@pytest.mark.parametrize("change, key", [
    ({"scoring_func": "sigmoid"}, "scoring_func='sigmoid'"),  # DeepSeek-V3's router
    ({"topk_method": "noaux_tc"}, "topk_method='noaux_tc'"),
    ({"n_group": 8}, "n_group=8"),
    ({"shared_expert_intermediate_size": 256}, "shared_expert_intermediate_size=256"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok=9"),
    ({"num_experts": 0}, "num_experts="),
])
def test_qwen3_moe_refuses_an_unsupported_router(change, key):
    with pytest.raises(UserError, match="is not supported") as info:
        check_architecture({**QWEN3_MOE, **change}, "m/config.json")
    assert key in str(info.value)


@pytest.mark.parametrize("archs, model_type", [(["Qwen2ForCausalLM"], "qwen3"), (["Qwen3ForCausalLM"], "qwen3_moe"),
                                               (["Qwen3MoeForCausalLM"], "qwen3"), (["MixtralForCausalLM"], "mixtral")])
def test_an_architecture_that_does_not_match_its_model_type_is_refused(archs, model_type):
    with pytest.raises(UserError, match=f"architecture {archs[0]} with model_type '{model_type}' is not supported"):
        check_architecture({**QWEN3, "architectures": archs, "model_type": model_type}, "config.json")


def test_read_hf_config_derives_head_dim_norms_and_the_moe_layer_pattern(tmp_path):
    from megatron_sortedrl.trainer.model import read_hf_config

    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({**QWEN3, "head_dim": 48}))
    a = read_hf_config(d)
    assert (a.head_dim, a.qk_norm, a.qkv_bias, a.num_experts, a.moe_layers) == (48, True, False, 0, ())
    # transformers' Qwen3MoeDecoderLayer: sparse unless in mlp_only_layers, every decoder_sparse_step-th layer
    (d / "config.json").write_text(json.dumps({**QWEN3_MOE, "decoder_sparse_step": 2, "mlp_only_layers": [3],
                                               "norm_topk_prob": False}))
    a = read_hf_config(d)
    assert (a.num_experts, a.moe_topk, a.moe_ffn_size, a.norm_topk_prob) == (8, 2, 32, False)
    assert a.moe_layers == (False, True, False, False)


def test_expert_layout_is_checked_naming_the_key(tmp_path):
    from megatron_sortedrl.config import ParallelConfig
    from megatron_sortedrl.errors import ConfigError
    from megatron_sortedrl.trainer.model import read_hf_config
    from megatron_sortedrl.trainer.moe import check_expert_layout

    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(QWEN3))
    dense = read_hf_config(d)
    (d / "config.json").write_text(json.dumps(QWEN3_MOE))
    moe = read_hf_config(d)

    def par(**kw):
        p = ParallelConfig()
        for k, v in kw.items():
            setattr(p, k, v)
        return p

    check_expert_layout(moe, par(data_parallel_size=2, expert_model_parallel_size=2))
    check_expert_layout(moe, par(tensor_model_parallel_size=2, expert_model_parallel_size=2,
                                 expert_tensor_parallel_size=1))
    check_expert_layout(dense, par(tensor_model_parallel_size=2))
    for arch, kw, key, what in [
        (dense, {"data_parallel_size": 2, "expert_model_parallel_size": 2}, "expert_model_parallel_size", "dense"),
        (moe, {"data_parallel_size": 3, "expert_model_parallel_size": 3}, "expert_model_parallel_size",
         "number of experts (8)"),
        (moe, {"tensor_model_parallel_size": 2, "expert_model_parallel_size": 2}, "expert_model_parallel_size",
         "divides TP x DP"),
        (moe, {"expert_tensor_parallel_size": 3}, "expert_tensor_parallel_size", "expert FFN size (32)"),
    ]:
        with pytest.raises(ConfigError, match=f"parallel.{key}=") as info:
            check_expert_layout(arch, par(**kw))
        assert what in str(info.value) and "\n" not in str(info.value)


def test_moe_settings_reach_megatrons_config(tmp_path):
    """Router and losses as documented (trainer/moe.py): fp32 router, norm_topk_prob as top-k-then-softmax,
    aux and z losses off unless set, grouped GEMM only with TE on a GPU, the dense/MoE layer pattern."""
    import torch

    from megatron_sortedrl.config import load_config
    from megatron_sortedrl.trainer.model import read_hf_config, transformer_config
    from megatron_sortedrl.trainer.moe import MoESettings

    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({**QWEN3_MOE, "decoder_sparse_step": 2}))
    arch = read_hf_config(d)
    c = transformer_config(arch, torch.float32, tp=2, ep=2, etp=1)
    assert (c.num_moe_experts, c.moe_router_topk, c.moe_ffn_hidden_size, c.moe_layer_freq) == (8, 2, 32, [0, 1, 0, 1])
    assert (c.moe_router_dtype, c.moe_router_pre_softmax, c.moe_router_score_function) == ("fp32", False, "softmax")
    assert (c.moe_router_load_balancing_type, c.moe_aux_loss_coeff, c.moe_z_loss_coeff) == ("none", 0.0, None)
    assert not c.moe_grouped_gemm and c.sequence_parallel and c.qk_layernorm and c.kv_channels == 32
    assert (c.expert_model_parallel_size, c.expert_tensor_parallel_size) == (2, 1)
    cfg = load_config(None, ["model.moe_aux_loss_coef=0.001", "model.moe_z_loss_coef=0.0001"])
    c = transformer_config(arch, torch.float32, moe=MoESettings.from_config(cfg), on_gpu=True, use_te=True)
    assert (c.moe_router_load_balancing_type, c.moe_aux_loss_coeff, c.moe_z_loss_coeff) == ("aux_loss", 0.001, 0.0001)
    assert c.moe_grouped_gemm
    (d / "config.json").write_text(json.dumps({**QWEN3_MOE, "norm_topk_prob": False}))
    assert transformer_config(read_hf_config(d), torch.float32).moe_router_pre_softmax  # softmax, then top-k


def test_train_preflight_refuses_expert_parallelism_on_a_dense_model(tmp_path):
    from megatron_sortedrl.config import load_config
    from megatron_sortedrl.errors import ConfigError
    from megatron_sortedrl.preflight import check_expert_parallel

    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(QWEN3))
    cfg = load_config(None, [f"model.path={d}", "parallel.data_parallel_size=2", "parallel.expert_model_parallel_size=2"])
    with pytest.raises(ConfigError, match=r"parallel.expert_model_parallel_size=2 .*1 for a dense model \(qwen3"):
        check_expert_parallel(cfg)
    (d / "config.json").write_text(json.dumps(QWEN3_MOE))
    check_expert_parallel(cfg)
