"""Command line: `python -m megatron_sortedrl <subcommand> --help` (also the `megatron-sortedrl` script).

Subcommands are a plain table below: name -> (module, one-line help). Each module defines
`add_arguments(parser)` and `run(args) -> int`, and is imported only when its subcommand runs so that
`--help` stays fast. A `UserError` (bad config, bad data, missing checkpoint) prints one line and exits 2;
anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from megatron_sortedrl.errors import UserError

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "config": ("megatron_sortedrl.commands.config_cmd", "print the resolved config (or every key's help with --explain)"),
    "report": ("megatron_sortedrl.commands.report", "render the RL run report (HTML, PNG): rewards, accuracy, step time, rollout bubbles"),
    "nvml-report": ("megatron_sortedrl.commands.nvml_report", "render the NVML utilization report (HTML, PNG, CSV) of a run dir or sample file"),
    "build-tiny-model": ("megatron_sortedrl.commands.build_tiny", "write the built-in tiny Qwen2 model as a Hugging Face directory"),
    "data": ("megatron_sortedrl.commands.data_cmd", "generate, load and summarise the prompts of a config"),
    "layout": ("megatron_sortedrl.commands.layout_cmd", "print where trainer ranks and rollout engines go (dry run)"),
    "plan": ("megatron_sortedrl.commands.plan", "memory plan before launch: trainer GPUs, engines' KV cache, weight sync, host memory"),
    "ray-check": ("megatron_sortedrl.commands.ray_check", "wait until a Ray cluster has all its nodes and list them"),
    "smoke": ("megatron_sortedrl.commands.smoke", "build the tiny model, generate and score a few prompts"),
    "simulate": ("megatron_sortedrl.commands.simulate", "simulate the scheduling policies on a modelled cluster (bubble ratios, throughput)"),
    "train": ("megatron_sortedrl.commands.train", "run RL: warm start, then rollout, reward, train, weight sync per step"),
    "convert": ("megatron_sortedrl.commands.convert", "convert checkpoints: hf-to-mcore / mcore-to-hf at any TP/PP, with --verify"),
}


class _OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage mistake is one line (argparse prints the usage block first), exit 2 as before."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"error: {self.prog}: {message} ({self.prog} --help shows the usage)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megatron-sortedrl", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", metavar="<subcommand>")
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module)
        # Arguments are added lazily in main() for the chosen subcommand only.
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in SUBCOMMANDS:
        if argv and argv[0] not in ("-h", "--help"):
            print(f"error: unknown subcommand '{argv[0]}'; choose one of: {', '.join(SUBCOMMANDS)} "
                  "(python -m megatron_sortedrl --help lists them)", file=sys.stderr)
            return 2
        parser.print_help()
        return 0
    module = importlib.import_module(SUBCOMMANDS[argv[0]][0])
    sub = _OneLineParser(prog=f"megatron-sortedrl {argv[0]}", description=SUBCOMMANDS[argv[0]][1])
    module.add_arguments(sub)
    try:  # key=value overrides may follow options, as users type them
        args = sub.parse_intermixed_args(argv[1:])
    except TypeError:  # a subcommand with a sub-parser (convert) cannot intermix; it parses as usual
        args = sub.parse_args(argv[1:])
    try:
        return int(module.run(args) or 0)
    except UserError as exc:
        print(f"error: {user_message(exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def user_message(exc: UserError) -> str:
    """The error's one line. Raised inside a Ray actor (a trainer rank), it arrives wrapped in Ray's
    RayTaskError, which is also a UserError but whose text carries the remote traceback: print the cause."""
    cause = getattr(exc, "cause", None)
    return str(cause if isinstance(cause, UserError) else exc)


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """The common `[config.yaml] [key=value ...]` positional arguments; read them with `config_from_args`."""
    parser.add_argument("config", nargs="?", default=None, help="YAML config (default: configs/tiny_cpu.yaml)")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. rollout.num_workers=2")


def config_from_args(args: argparse.Namespace):
    """The validated RunConfig of `add_config_arguments`; a first `key=value` is an override, not a file."""
    from megatron_sortedrl.config import load_config

    path, overrides = args.config, list(args.overrides)
    if path is not None and "=" in path and not path.endswith((".yaml", ".yml")):
        path, overrides = None, [path, *overrides]
    return load_config(path, overrides)
