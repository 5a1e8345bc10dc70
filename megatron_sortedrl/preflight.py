"""Checks that run before an RL run starts anything (Ray, trainer ranks, engines): what can be known from
the config and the files it names is checked here, so a mistake costs a second, not a cluster start.

    from megatron_sortedrl.preflight import preflight
    preflight(cfg, resume_from=None)          # raises a UserError with one line; the CLI exits 2

Checked: settings a real run cannot honour yet (`scheduler.layout_planner=preemption`, cost_model without a valid
scenario YAML for its engine model); the model directory (exists, has config.json and a tokenizer) unless the tiny model will be built
there, and its chat template when `data.apply_chat_template` is on; the reward function (imports, takes `(sample, ground_truth)`); the tools and the tool-call parser (`tools.*`: each
imports, has a valid schema and the signature the runner calls; the parser returns a `Parsed`); every directory the run writes (run
directory, checkpoint directory, TensorBoard directory: created and a file written and removed); the
checkpoint to resume from (its state file reads as plain data and was written by the same scheduling
policy). The config's own values and the parallel layout are checked when the config loads (`config/`),
the datasets when they load (`data/loaders.py`), both also before anything starts.

Left out: anything that needs the hardware (GPU memory, node count): the launch plan checks those.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import fields
from pathlib import Path
from typing import Any

from megatron_sortedrl.errors import CheckpointError, ConfigError, UserError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


def preflight(cfg, resume_from: Path | None = None, reward_fn: Any = None) -> None:
    from scheduler.sim.layout_driver import check_planner

    check_planner(cfg)  # a planner the driver cannot honour fails here, in one line
    check_model_dir(cfg.model)
    check_expert_parallel(cfg)
    if cfg.data.apply_chat_template:
        check_chat_template(Path(cfg.model.path))
    check_reward(cfg.data, reward_fn)
    check_tools(cfg)
    for path, key in written_paths(cfg):
        check_writable(path, key)
    if resume_from is not None:
        check_resume_state(resume_from, cfg.scheduler.policy)


def check_model_dir(model_cfg) -> None:
    path = Path(model_cfg.path)
    if not path.exists():
        if model_cfg.build_tiny_if_missing:
            return  # the driver builds the tiny model there
        raise UserError(f"model.path={path}: no such directory; point it at a Hugging Face model directory "
                        "(config.json, *.safetensors, tokenizer files) or set model.build_tiny_if_missing=true")
    if not path.is_dir():
        raise UserError(f"model.path={path} is a file; it must be a Hugging Face model directory")
    if not (path / "config.json").is_file():
        raise UserError(f"model.path={path} has no config.json; it must be a Hugging Face model directory")
    check_model_config(path / "config.json")
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise UserError(f"model.path={path} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}); copy the "
                        "tokenizer files of the model into it")


def check_model_config(file: Path) -> None:
    """The architecture check `plan` and `convert` run (convert/validate.py), so `train` with plan.check=skip
    refuses it too, with the same line, before Ray."""
    import json

    from megatron_sortedrl.convert.architectures import check_architecture

    try:
        cfg = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise UserError(f"{file}: cannot be read as JSON ({exc}); copy the model's config.json again") from None
    check_architecture(cfg if isinstance(cfg, dict) else {}, str(file))


def check_expert_parallel(cfg) -> None:
    """EP / expert TP against the model's experts (EP > 1 on a dense model included), before Ray; a model not
    built yet is the tiny one `model.tiny` describes."""
    from megatron_sortedrl.trainer.moe import check_expert_layout

    p = cfg.parallel
    if (Path(cfg.model.path) / "config.json").is_file():
        from megatron_sortedrl.trainer.model import read_hf_config

        check_expert_layout(read_hf_config(cfg.model.path, cfg.model.rope_scaling), p)
    elif cfg.model.tiny.architecture == "qwen3_moe":  # the tiny MoE model it will build (model.tiny)
        from types import SimpleNamespace

        t = cfg.model.tiny
        check_expert_layout(SimpleNamespace(model_type=t.architecture, num_experts=t.num_experts,
                                            moe_ffn_size=t.moe_intermediate_size), p)
    elif p.expert_model_parallel_size > 1:
        raise ConfigError("parallel.expert_model_parallel_size", p.expert_model_parallel_size,
                          "1 for the built-in tiny model (it is dense; model.tiny.architecture=qwen3_moe is not)")


def check_chat_template(path: Path) -> None:
    """data.apply_chat_template needs the tokenizer's template: in tokenizer_config.json or chat_template.jinja
    (read as files: loading the tokenizer would cost a second import of transformers here)."""
    import json

    config = path / "tokenizer_config.json"
    has = (path / "chat_template.jinja").is_file() or (path / "chat_template.json").is_file()
    if not has and config.is_file():
        try:
            has = bool(json.loads(config.read_text()).get("chat_template"))
        except (OSError, ValueError):
            has = False
    if not has and path.exists():
        raise ConfigError("data.apply_chat_template", True,
                          f"false for the model at {path}: its tokenizer has no chat template (a base model, or the "
                          "instruct model's tokenizer_config.json / chat_template.jinja was not copied there)")


def check_reward(data_cfg, reward_fn: Any = None) -> None:
    from megatron_sortedrl.rewards import check_signature, load_reward_fn, reward_path

    if reward_fn is None:
        load_reward_fn(reward_path(data_cfg))
    elif isinstance(reward_fn, str):
        load_reward_fn(reward_fn)
    else:
        check_signature(reward_fn, "reward function", getattr(reward_fn, "__qualname__", reward_fn))


def check_tools(cfg) -> None:
    """tools.tools (built-ins and dotted paths load, with valid schemas) and tools.parser (exists), in one
    line naming the key (agentic/tools.py: check_tools)."""
    from megatron_sortedrl.agentic.tools import check_tools as check

    check(cfg.tools, cfg.reward.sandbox)


def written_paths(cfg) -> list[tuple[Path, str]]:
    """(directory, the key that sets it) of everything the run writes, so that an unwritable one is found
    here in one line rather than at the first checkpoint, after a step of work, as a trainer-rank traceback."""
    run_dir = Path(cfg.logging.run_dir)
    paths = [(run_dir, "logging.run_dir")]
    paths.append((Path(cfg.checkpoint.dir or run_dir / "checkpoints"), "checkpoint.dir"))
    if cfg.logging.tensorboard:
        paths.append((run_dir / "tensorboard", "logging.tensorboard"))
    for f in fields(cfg.logging):  # any other logging.*_dir a sink writes to (set ones only)
        if f.name.endswith("_dir") and f.name != "run_dir" and getattr(cfg.logging, f.name):
            paths.append((Path(getattr(cfg.logging, f.name)), f"logging.{f.name}"))
    return paths


def check_writable(path: Path, key: str) -> None:
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".write-check-"):
            pass
    except OSError as exc:
        raise UserError(f"{key}: {path} is not writable ({exc.strerror or exc}); choose a directory you can "
                        "write to") from None
    if not os.access(path, os.W_OK):
        raise UserError(f"{key}: {path} is not writable; choose a directory you can write to")


def check_resume_state(ckpt: Path, policy: str) -> None:
    from megatron_sortedrl.trainer.checkpoint import read_state

    extra = read_state(ckpt).get("extra", {})
    saved = (extra.get("scheduler") or {}).get("policy")
    if saved is not None and saved != policy:
        raise CheckpointError(f"{ckpt} was written by scheduler.policy={saved}, the config says {policy}; resume "
                              f"with scheduler.policy={saved}, or start over with checkpoint.resume=never")
