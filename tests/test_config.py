"""Config loading and validation: defaults, overrides, and one-line errors naming the dotted key."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from megatron_sortedrl.config import DEFAULT_CONFIG, RunConfig, field_help, load_config, to_yaml
from megatron_sortedrl.errors import ConfigError

REPO = Path(__file__).resolve().parent.parent


def test_default_config_loads_typed():
    cfg = load_config()
    assert isinstance(cfg, RunConfig)
    assert cfg.scheduler.policy == "twotier" and cfg.speculative.method == "histospec"
    assert cfg.parallel.world_size == 1


def test_every_recipe_in_configs_validates():
    for path in sorted((REPO / "configs").glob("*.yaml")):
        if path.name.startswith("sim_") or "${oc.env:" in path.read_text():
            continue  # simulator parameter files have their own schema; cluster recipes: tests/test_layout.py
        load_config(path)


def test_overrides_change_values_with_types():
    cfg = load_config(None, ["rollout.num_workers=3", "trainer.lr=0.5", "speculative.enabled=false"])
    assert cfg.rollout.num_workers == 3 and cfg.trainer.lr == 0.5 and cfg.speculative.enabled is False


@pytest.mark.parametrize(
    "override, key, fragment",
    [
        (["data.foo=1"], "data.foo", "unknown key"),
        (["nonsense=1"], "nonsense", "unknown key"),
        (["rollout.num_workers=abc"], "rollout.num_workers", "a positive integer"),
        (["scheduler.policy=fastest"], "scheduler.policy", "sync, sorted, tail, twotier"),
        (["parallel.tensor_model_parallel_size=3"], "parallel.tensor_model_parallel_size", "divisor"),
        (["parallel.pipeline_model_parallel_size=4"], "parallel.pipeline_model_parallel_size", "layers (2)"),
        (["scheduler.update_batch_size=1024"], "scheduler.rollout_batch_size", "cannot fill an update batch"),
        (["scheduler.update_batch_size=30"], "scheduler.update_batch_size", "multiple of rollout.n_samples_per_prompt"),
        (["rollout.n_samples_per_prompt=1", "scheduler.update_batch_size=16"], "rollout.n_samples_per_prompt", "grpo"),
        (["data.task=file"], "data.train_files", "jsonl/parquet"),
        (["algorithm.clip_low=1.5"], "algorithm.clip_low", "[0, 1)"),
        (["rollout.top_p=0"], "rollout.top_p", "(0, 1]"),
    ],
)
def test_bad_values_name_the_key(override, key, fragment):
    with pytest.raises(ConfigError) as info:
        load_config(None, override)
    message = str(info.value)
    assert "\n" not in message
    assert key in message and fragment in message


def test_yaml_unknown_key_and_missing_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("rollout:\n  num_wokers: 2\n")
    with pytest.raises(ConfigError, match="unknown key rollout.num_wokers; allowed here: num_workers"):
        load_config(bad)
    with pytest.raises(ConfigError, match="existing YAML file"):
        load_config(tmp_path / "missing.yaml")
    broken = tmp_path / "broken.yaml"
    broken.write_text("rollout: [unclosed\n")
    with pytest.raises(ConfigError, match="valid YAML"):
        load_config(broken)


def test_every_field_has_help():
    rows = field_help()
    assert len(rows) > 60
    missing = [key for key, _, text in rows if not text]
    assert missing == []


def test_resolved_yaml_round_trips(tmp_path):
    cfg = load_config(None, ["rollout.num_workers=2"])
    out = tmp_path / "resolved.yaml"
    out.write_text(to_yaml(cfg))
    assert load_config(out) == cfg


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "megatron_sortedrl", *args], capture_output=True, text=True, cwd=REPO)


def test_cli_help_lists_subcommands():
    result = _cli("--help")
    assert result.returncode == 0
    for name in ("config", "build-tiny-model", "data"):
        assert name in result.stdout


def test_cli_unknown_key_is_one_line_without_traceback():
    result = _cli("config", str(DEFAULT_CONFIG), "data.foo=1")
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().count("\n") == 0
    assert "data.foo" in result.stderr


def test_cli_prints_resolved_config_with_override():
    result = _cli("config", "rollout.num_workers=7")
    assert result.returncode == 0
    assert load_config(None, ["rollout.num_workers=7"]).rollout.num_workers == 7
    assert "num_workers: 7" in result.stdout


def test_worker_niceness_reaches_the_local_ray_only_and_is_bounded():
    from megatron_sortedrl.config import ClusterConfig
    from megatron_sortedrl.placement import local_ray_env

    assert local_ray_env(ClusterConfig()) == {}  # -1: Ray's own default
    assert local_ray_env(ClusterConfig(worker_niceness=0)) == {"RAY_worker_niceness": "0"}
    assert local_ray_env(ClusterConfig(worker_niceness=0, ray_address="10.0.0.1:6379")) == {}  # not ours to start
    assert local_ray_env(load_config("configs/tiny_cpu.yaml").cluster) == {"RAY_worker_niceness": "0"}
    with pytest.raises(ConfigError, match="worker_niceness"):
        ClusterConfig(worker_niceness=20)
