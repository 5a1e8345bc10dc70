"""`python -m megatron_sortedrl build-tiny-model [config.yaml] [key=value ...] [--out DIR] [--overwrite]`."""

from __future__ import annotations

import argparse

from megatron_sortedrl.cli import add_config_arguments, config_from_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    parser.add_argument("--out", default=None, help="output directory (default: model.path of the config)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing directory")


def run(args: argparse.Namespace) -> int:
    from megatron_sortedrl.tiny_model import build_tiny_model

    cfg = config_from_args(args)
    out = build_tiny_model(args.out or cfg.model.path, cfg.model.tiny, overwrite=args.overwrite)
    print(f"tiny model at {out}")
    return 0
