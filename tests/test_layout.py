"""Cluster recipes validate, and their layout arithmetic holds on the GPUs they declare."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_sortedrl.config import load_config
from megatron_sortedrl.errors import ConfigError
from megatron_sortedrl.layout import plan_layout

REPO = Path(__file__).resolve().parent.parent

# Shapes of the real models (from their Hugging Face config.json), enough for the validator.
SHAPES = {
    "qwen32b_128gpu": {"num_attention_heads": 40, "num_key_value_heads": 8, "num_hidden_layers": 64,
                       "max_position_embeddings": 32768, "rope_theta": 1000000.0},
    "qwen7b_16gpu": {"num_attention_heads": 28, "num_key_value_heads": 4, "num_hidden_layers": 28,
                     "max_position_embeddings": 32768, "rope_theta": 1000000.0},
    "llama8b_logic_8gpu": {"num_attention_heads": 32, "num_key_value_heads": 8, "num_hidden_layers": 32,
                           "max_position_embeddings": 131072, "rope_theta": 500000.0,
                           "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}},
    "qwen3_8b_8gpu": {"num_attention_heads": 32, "num_key_value_heads": 8, "num_hidden_layers": 36,
                      "max_position_embeddings": 40960, "rope_theta": 1000000.0},
    "qwen3_30b_a3b_32gpu": {"num_attention_heads": 32, "num_key_value_heads": 4, "num_hidden_layers": 48,
                            "max_position_embeddings": 40960, "rope_theta": 1000000.0},
    "qwen3_235b_a22b_128gpu": {"num_attention_heads": 64, "num_key_value_heads": 4, "num_hidden_layers": 94,
                               "max_position_embeddings": 40960, "rope_theta": 1000000.0},
}


@pytest.fixture
def recipe_env(tmp_path, monkeypatch):
    def use(name: str) -> Path:
        model = tmp_path / name
        model.mkdir()
        (model / "config.json").write_text(json.dumps(SHAPES[name]))
        monkeypatch.setenv("MSRL_MODEL_DIR", str(model))
        monkeypatch.setenv("MSRL_DATA_DIR", str(tmp_path / "data"))
        monkeypatch.setenv("MSRL_RUN_DIR", str(tmp_path / "run"))
        return REPO / "configs" / f"{name}.yaml"
    return use


def _check_plan(plan, cfg):
    used = [(p.node, g) for group in (plan.trainer, plan.rollout_short) for p in group for g in p.gpus]
    assert len(used) == len(set(used))  # no GPU given twice
    assert all(0 <= n < cfg.cluster.num_nodes and 0 <= g < cfg.cluster.gpus_per_node for n, g in used)
    for group in (plan.rollout_short, plan.rollout_long):
        # an engine's GPUs are consecutive on one node, and both layouts cover the same GPUs
        assert all(p.gpus == list(range(p.gpus[0], p.gpus[0] + len(p.gpus))) for p in group)
    short = sorted((p.node, g) for p in plan.rollout_short for g in p.gpus)
    long = sorted((p.node, g) for p in plan.rollout_long for g in p.gpus)
    assert short == long
    # each TP group of the trainer sits in one node
    tp = cfg.parallel.tensor_model_parallel_size
    for start in range(0, len(plan.trainer), tp):
        assert len({p.node for p in plan.trainer[start:start + tp]}) == 1


def test_qwen32b_recipe_fills_16_nodes_of_8(recipe_env):
    cfg = load_config(recipe_env("qwen32b_128gpu"))
    p, r = cfg.parallel, cfg.rollout
    assert (cfg.cluster.num_nodes, cfg.cluster.gpus_per_node) == (16, 8)
    assert p.tensor_model_parallel_size * p.pipeline_model_parallel_size * p.data_parallel_size == 64
    assert r.num_workers * r.tensor_parallel_size == 64
    assert r.max_response_length == 32768
    plan = plan_layout(cfg)
    assert len(plan.trainer) + sum(len(e.gpus) for e in plan.rollout_short) == 128
    assert {e.node for e in plan.rollout_short} == set(range(8, 16))
    assert len(plan.rollout_long) == 16 and all(len(e.gpus) == 4 for e in plan.rollout_long)
    _check_plan(plan, cfg)


@pytest.mark.parametrize("name", ["qwen7b_16gpu", "llama8b_logic_8gpu", "qwen3_8b_8gpu", "qwen3_30b_a3b_32gpu",
                                  "qwen3_235b_a22b_128gpu"])
def test_smaller_recipes(recipe_env, name):
    cfg = load_config(recipe_env(name))
    plan = plan_layout(cfg)
    assert len(plan.trainer) + sum(len(e.gpus) for e in plan.rollout_short) <= plan.total_gpus
    _check_plan(plan, cfg)


@pytest.mark.parametrize(
    "override, key",
    [
        (["cluster.num_nodes=12"], "cluster.num_nodes"),  # 64 trainer + 64 rollout GPUs do not fit 96
        (["rollout.long_round_tensor_parallel_size=16"], "rollout.long_round_tensor_parallel_size"),  # crosses nodes
        (["parallel.tensor_model_parallel_size=16", "parallel.data_parallel_size=2"], "parallel.tensor_model_parallel_size"),
        (["parallel.tensor_model_parallel_size=3"], "parallel.tensor_model_parallel_size"),  # 40 heads
    ],
)
def test_impossible_layouts_name_the_key(recipe_env, override, key):
    with pytest.raises(ConfigError) as info:
        load_config(recipe_env("qwen32b_128gpu"), override)
    assert str(info.value).startswith(f"config error: {key}=")


def test_unset_path_variable_is_one_clear_line(monkeypatch):
    monkeypatch.delenv("MSRL_MODEL_DIR", raising=False)
    with pytest.raises(ConfigError, match="environment variable MSRL_MODEL_DIR to be set"):
        load_config(REPO / "configs" / "qwen32b_128gpu.yaml")


def test_layout_command_dry_run(recipe_env):
    path = recipe_env("qwen32b_128gpu")
    out = subprocess.run([sys.executable, "-m", "megatron_sortedrl", "layout", str(path)],
                         capture_output=True, text=True, cwd=REPO, check=True).stdout
    assert "16 nodes x 8 GPUs = 128 GPUs" in out
    assert "rollout, long rounds: 16 engines, 64 GPUs on nodes 8-15" in out


@pytest.mark.parametrize("tp, dp, pp, ep, etp", [(2, 2, 2, 2, 1), (1, 4, 2, 4, 1), (2, 4, 1, 2, 2), (2, 2, 1, 4, 1)])
def test_expert_groups_are_megatrons(tp, dp, pp, ep, etp):
    """`layout` shows the EP groups Megatron forms (its own rank generator, no process group needed)."""
    from megatron.core.parallel_state import RankGenerator

    over = {"tensor_model_parallel_size": tp, "data_parallel_size": dp, "pipeline_model_parallel_size": pp,
            "expert_model_parallel_size": ep, "expert_tensor_parallel_size": etp}
    cfg = load_config(None, ["cluster.num_nodes=2", "cluster.gpus_per_node=8", "rollout.num_workers=4",
                             "rollout.tensor_parallel_size=2", "rollout.long_round_tensor_parallel_size=2",
                             *(f"parallel.{k}={v}" for k, v in over.items())])
    plan = plan_layout(cfg)
    megatron = RankGenerator(tp=etp, ep=ep, dp=tp * dp // (ep * etp), pp=pp, cp=1, order="tp-cp-ep-dp-pp")
    assert sorted(plan.expert_groups) == sorted(megatron.get_ranks("ep"))
    assert f"expert-parallel groups (EP {ep}): [" in plan.format()
    for p in plan.trainer:  # each rank's ep= coordinate is its position in its group
        group = next(g for g in plan.expert_groups if p.index in g)
        assert f"ep={group.index(p.index)} " in p.detail + " "


def test_an_expert_layout_megatron_cannot_build_is_refused_at_load():
    with pytest.raises(ConfigError, match=r"parallel.expert_model_parallel_size=2 .*divides TP x DP \(2 x 1\)"):
        load_config(None, ["parallel.tensor_model_parallel_size=2", "parallel.expert_model_parallel_size=2"])
