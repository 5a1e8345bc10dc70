"""RoPE scaling: the trainer's frequencies and attention factor equal `transformers`', and the context check.

    pytest tests/test_rope.py -q        # CPU, no processes, a few seconds

Reference: `transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS` on a `Qwen2Config`/`LlamaConfig` (the
functions HF's models call), for every rope type the trainer accepts and YaRN's optional keys. The config
cross-check: prompt + response longer than the model's positions fails at load time in one line that names
the keys, YaRN via `model.rope_scaling` lifts the limit, and the engines get the same rope and length.
"""

from __future__ import annotations

import json

import pytest
import torch

from megatron_sortedrl.config import RunConfig, load_config
from megatron_sortedrl.errors import ConfigError, UserError
from megatron_sortedrl.rope import resolve_rope
from megatron_sortedrl.trainer.model import (
    read_hf_config,
    rope_attention_factor,
    rope_inv_freq,
)

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
SCALINGS = [
    None,
    {"rope_type": "linear", "factor": 2.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
    YARN,
    {**YARN, "type": "yarn", "factor": 2.5, "beta_fast": 16, "beta_slow": 2},
    {**YARN, "attention_factor": 1.25},
    {**YARN, "mscale": 0.707, "mscale_all_dim": 1.0},
    {**YARN, "truncate": False},
    {"type": "yarn", "factor": 4.0},  # legacy key, original positions taken from max_position_embeddings
]


def _model_dir(tmp_path, rope_scaling, head_dim=32, theta=1e6):
    cfg = {"model_type": "qwen2", "vocab_size": 64, "hidden_size": 128, "intermediate_size": 256,
           "num_hidden_layers": 2, "num_attention_heads": 128 // head_dim, "num_key_value_heads": 2,
           "head_dim": head_dim, "max_position_embeddings": 64, "rope_theta": theta, "tie_word_embeddings": True}
    if rope_scaling is not None:
        cfg["rope_scaling"] = rope_scaling
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path, cfg


@pytest.mark.parametrize("scaling", SCALINGS, ids=lambda s: json.dumps(s))
@pytest.mark.parametrize("head_dim", [32, 128])
def test_frequencies_and_attention_factor_match_transformers(tmp_path, scaling, head_dim):
    from transformers import Qwen2Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    path, raw = _model_dir(tmp_path, scaling, head_dim)
    arch = read_hf_config(path)
    hf = Qwen2Config(**{k: v for k, v in raw.items() if k != "model_type"})
    kind = hf.rope_parameters["rope_type"]
    if kind == "default":
        ref_inv, ref_att = 1.0 / (1e6 ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)), 1.0
    else:
        ref_inv, ref_att = ROPE_INIT_FUNCTIONS[kind](hf, "cpu")
    torch.testing.assert_close(rope_inv_freq(arch), ref_inv, rtol=1e-6, atol=0)
    assert rope_attention_factor(arch) == pytest.approx(ref_att, rel=1e-12)


def test_override_replaces_the_files_rope(tmp_path):
    path, _ = _model_dir(tmp_path, None)
    arch = read_hf_config(path, YARN)
    assert arch.rope_scaling["rope_type"] == "yarn" and arch.max_position_embeddings == 256
    assert rope_attention_factor(arch) == pytest.approx(0.1 * torch.log(torch.tensor(4.0)).item() + 1)


def test_megatron_attention_applies_the_attention_factor():
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
        _yarn_get_concentration_factor_from_config,
    )

    from megatron_sortedrl.trainer.model import _set_attention_factor

    class Cfg:  # the attribute protocol Megatron's attention reads
        pass

    for factor in (1.1386, 1.25, 0.93):
        cfg = Cfg()
        _set_attention_factor(cfg, factor)
        assert _yarn_get_concentration_factor_from_config(cfg) == pytest.approx(factor, rel=1e-12)
    cfg = Cfg()
    _set_attention_factor(cfg, 1.0)
    assert _yarn_get_concentration_factor_from_config(cfg) == 1.0


@pytest.mark.parametrize("bad, key", [
    ({"rope_type": "dynamic", "factor": 2.0}, "model.rope_scaling.rope_type"),
    ({"rope_type": "longrope", "factor": 2.0}, "model.rope_scaling.rope_type"),
    ({"rope_type": "linear"}, "model.rope_scaling.factor"),
    ({"rope_type": "yarn", "factor": 0.5}, "model.rope_scaling.factor"),
])
def test_bad_rope_scaling_is_one_config_error(bad, key):
    with pytest.raises(ConfigError) as err:
        resolve_rope({"max_position_embeddings": 64}, bad)
    assert err.value.key == key and "\n" not in str(err.value)


def test_dynamic_rope_in_config_json_is_a_user_error(tmp_path):
    path, _ = _model_dir(tmp_path, {"rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(UserError, match="dynamic NTK .* model.rope_scaling"):
        read_hf_config(path)


def _write_yaml(tmp_path, model_dir, **sections) -> str:
    import yaml

    doc = {"model": {"path": str(model_dir), "build_tiny_if_missing": False}, **sections}
    p = tmp_path / "run.yaml"
    p.write_text(yaml.safe_dump(doc))
    return str(p)


def test_context_longer_than_the_model_fails_at_load_with_the_keys(tmp_path):
    (tmp_path / "m").mkdir()
    model_dir, _ = _model_dir(tmp_path / "m", None)
    yml = _write_yaml(tmp_path, model_dir, data={"max_prompt_length": 16}, rollout={"max_response_length": 100})
    with pytest.raises(ConfigError) as err:
        load_config(yml)
    msg = str(err.value)
    assert err.value.key == "rollout.max_response_length" and "\n" not in msg
    assert "data.max_prompt_length (16)" in msg and "116 tokens exceeds the model's 64 positions" in msg
    assert "model.rope_scaling={rope_type: yarn, factor: 2.0, original_max_position_embeddings: 64}" in msg
    # YaRN through the config key lifts the limit to factor x original positions, and no further
    cfg = load_config(yml, ["model.rope_scaling={rope_type: yarn, factor: 2.0}"])
    assert cfg.max_model_len == 116
    with pytest.raises(ConfigError, match="at most 112"):
        load_config(yml, ["model.rope_scaling={rope_type: yarn, factor: 2.0}", "rollout.max_response_length=113"])


def test_engines_get_the_run_length_and_the_rope(tmp_path):
    from megatron_sortedrl.rollout import PoolOptions

    model_dir, _ = _model_dir(tmp_path, None)
    cfg = RunConfig()
    cfg.model.path, cfg.model.rope_scaling = str(model_dir), dict(YARN)
    cfg.data.max_prompt_length, cfg.rollout.max_response_length = 40, 200
    cfg.cluster.device = "cpu"
    opts = PoolOptions.from_config(cfg)
    assert opts.max_model_len == 240
    over = opts.engine_extra["hf_overrides"]
    assert over["max_position_embeddings"] == 256
    assert over["rope_parameters"] == {**YARN, "rope_theta": 1e6}
    # without an override and within the model's positions nothing is overridden
    cfg.model.rope_scaling, cfg.rollout.max_response_length = {}, 20
    opts = PoolOptions.from_config(cfg)
    assert opts.max_model_len == 60 and "hf_overrides" not in opts.engine_extra
