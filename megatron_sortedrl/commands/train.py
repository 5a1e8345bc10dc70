"""`python -m megatron_sortedrl train [config.yaml | run_dir] [key=value ...]`: the RL run (see `megatron_sortedrl/driver.py`).

Builds the tiny model when the config asks for it, warm-starts it with a short supervised phase, then runs
RL with the configured scheduling policy, printing one progress line per step, and ends with the run report.
Results land in `logging.run_dir` (config.yaml, metrics.jsonl, timeline.jsonl, checkpoints, summary.json,
report/report.html).

Resuming: by default (`checkpoint.resume=auto`) a run directory that already holds a complete checkpoint is
continued from the newest one. `resume=true` insists on that (an error when there is none), `resume=false`
starts over; giving a run directory instead of a config file continues the run with the config it saved.
SIGTERM or SIGUSR1 make the run checkpoint after the step in progress and exit 0, ready to resume.

Before anything starts, the launch plan (`python -m megatron_sortedrl plan`, docs/scaling.md) is checked:
`parallel.recompute.granularity=auto` becomes the least recompute that fits (logged), and a recipe whose
trainer GPUs, engines or nodes cannot hold it is refused in one line (exit 2) unless `plan.check=warn`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from megatron_sortedrl.cli import add_config_arguments, config_from_args
from megatron_sortedrl.errors import ConfigError

RESUME_ALIASES = {"true": "required", "false": "never"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)


def _translate(args: argparse.Namespace) -> argparse.Namespace:
    """`resume=true|false` is shorthand for checkpoint.resume; a run directory stands for its saved config."""
    overrides = []
    config, items = args.config, list(args.overrides)
    if config is not None and "=" in config and not config.endswith((".yaml", ".yml")):
        config, items = None, [config, *items]  # `train resume=true`: no config file, the first word is an override
    for item in items:
        key, _, value = item.partition("=")
        if key == "resume":
            if value.lower() not in RESUME_ALIASES:
                raise ConfigError("resume", value, "true or false (or set checkpoint.resume to a path)")
            item = f"checkpoint.resume={RESUME_ALIASES[value.lower()]}"
        overrides.append(item)
    if config is not None and Path(config).is_dir():
        saved = Path(config) / "config.yaml"
        if not saved.is_file():
            raise ConfigError("config", config, "a YAML file, or a run directory holding the config.yaml a run saved")
        config = str(saved)
        overrides = [f"logging.run_dir={Path(args.config)}", *overrides]
        if not any(o.startswith("checkpoint.resume=") for o in overrides):
            overrides.append("checkpoint.resume=required")
    return argparse.Namespace(**{**vars(args), "config": config, "overrides": overrides})


def run(args: argparse.Namespace) -> int:
    from megatron_sortedrl.plan.planner import check_plan

    cfg = config_from_args(_translate(args))
    # The memory plan before anything starts (no Ray, no processes): resolves recompute `auto` and refuses a
    # recipe that cannot fit, naming the number and the key to turn (plan.check=warn|skip to override).
    check_plan(cfg)
    from megatron_sortedrl.driver import Driver

    driver = Driver(cfg)
    try:
        summary = driver.run()
    finally:
        driver.close()
    return 0 if summary["steps"] > 0 or summary.get("interrupted") else 1
