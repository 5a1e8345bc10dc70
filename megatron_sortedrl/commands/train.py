"""`python -m megatron_sortedrl train [config.yaml] [key=value ...]`: the RL run (see `megatron_sortedrl/driver.py`).

Builds the tiny model when the config asks for it, warm-starts it with a short supervised phase, then runs
RL with the configured scheduling policy, printing one progress line per step. Results land in
`logging.run_dir` (metrics.jsonl, timeline.jsonl, summary.json, checkpoints). Left out for now: resume.
"""

from __future__ import annotations

import argparse

from megatron_sortedrl.cli import add_config_arguments, config_from_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from megatron_sortedrl.driver import Driver

    cfg = config_from_args(args)
    driver = Driver(cfg)
    try:
        summary = driver.run()
    finally:
        driver.close()
    return 0 if summary["steps"] > 0 else 1
