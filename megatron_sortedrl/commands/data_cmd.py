"""`python -m megatron_sortedrl data [config.yaml] [key=value ...] [--split train|eval] [--show N]`.

Loads (or generates) the prompts of a config exactly as a run would, reports malformed rows, and prints
the length distribution of prompts and worked solutions.
"""

from __future__ import annotations

import argparse
import json

from megatron_sortedrl.cli import add_config_arguments, config_from_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    parser.add_argument("--split", choices=("train", "eval"), default="train")
    parser.add_argument("--show", type=int, default=0, help="print the first N prompts with their solutions")


def run(args: argparse.Namespace) -> int:
    from megatron_sortedrl.data.loaders import LoadReport, load_prompts
    from megatron_sortedrl.data.stats import length_summary

    cfg = config_from_args(args)
    report = LoadReport()
    prompts = load_prompts(cfg.data, args.split, report)
    print(report.summary())
    for line in report.skipped:
        print(f"  skipped {line}")
    for p in prompts[: args.show]:
        print(f"--- {p.prompt_id} (difficulty {p.difficulty})\n{p.text}{p.solution}\n[truth] {p.ground_truth}")
    print(json.dumps(length_summary(prompts), indent=2))
    return 0
