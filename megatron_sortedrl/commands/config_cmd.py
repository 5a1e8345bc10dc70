"""`python -m megatron_sortedrl config [config.yaml] [key=value ...] [--explain]`: print the resolved config."""

from __future__ import annotations

import argparse

from megatron_sortedrl.cli import add_config_arguments, config_from_args
from megatron_sortedrl.config import field_help, to_yaml


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    parser.add_argument("--explain", action="store_true", help="list every key with its default and help")


def run(args: argparse.Namespace) -> int:
    if args.explain:
        for key, default, text in field_help():
            print(f"{key:45s} {default:>14s}  {text}")
        return 0
    print(to_yaml(config_from_args(args)), end="")
    return 0
