"""`python -m megatron_sortedrl report <run_dir> [-o OUT]`: render the RL run report (one HTML page with
embedded PNG figures) of a run directory and print its path.

    python -m megatron_sortedrl report runs/my_run              # -> runs/my_run/report/report.html
    python -m megatron_sortedrl report runs/my_run -o /tmp/rep

What the figures mean: docs/telemetry.md ("The run report"). Rendering lives in
megatron_sortedrl/telemetry/run_report.py. GPU utilization is the other report: `nvml-report`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from megatron_sortedrl.errors import UserError
from megatron_sortedrl.metrics import METRICS_FILE


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", help=f"run directory (with {METRICS_FILE}, timeline*.jsonl, summary.json)")
    parser.add_argument("-o", "--out", default=None, help="report directory (default: <run_dir>/report)")


def run(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        raise UserError(f"{run_dir} is not a directory; pass the run directory of a train run (logging.run_dir)")
    if not (run_dir / METRICS_FILE).is_file():
        raise UserError(f"{run_dir} has no {METRICS_FILE}; is it a run directory (logging.run_dir of a train run)?")
    # Imported here: matplotlib is slow to load and other subcommands should not pay for it.
    from megatron_sortedrl.telemetry.run_report import write_run_report

    print(write_run_report(run_dir, args.out))
    return 0
