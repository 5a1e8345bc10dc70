"""`python -m megatron_sortedrl nvml-report <run_dir | samples.jsonl | samples.csv>`: render the NVML
utilization report (HTML + PNG + CSV) of a run directory or of a sample file recorded elsewhere.

    python -m megatron_sortedrl nvml-report runs/my_run                  # -> runs/my_run/nvml_report/
    python -m megatron_sortedrl nvml-report gpu3.jsonl --timeline t.jsonl -o /tmp/report

What the figures mean: docs/telemetry.md. Rendering lives in megatron_sortedrl/telemetry/report.py.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from megatron_sortedrl.errors import UserError
from megatron_sortedrl.telemetry.nvml import Samples, read_samples
from megatron_sortedrl.telemetry.report import render
from megatron_sortedrl.telemetry.timeline import TIMELINE_GLOB, read_run_timeline, read_timeline


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("source", help="run directory (with nvml/ and timeline*.jsonl), or one NVML sample file (.jsonl or .csv)")
    parser.add_argument("-o", "--out", default=None, help="report directory (default: <run_dir>/nvml_report or <file>_report)")
    parser.add_argument("--timeline", default=None, help="timeline .jsonl to use instead of the run directory's")
    parser.add_argument("--max-batch", type=int, default=None,
                        help="one rollout engine's max concurrent sequences; adds the slot bubble ratio per step")
    parser.add_argument("--title", default=None, help="report title (default: the source's name)")


def load_inputs(source: Path, timeline: str | None) -> tuple[Samples, list]:
    """Samples and timeline events of a run directory or a sample file; UserError if there is neither."""
    if not source.exists():
        raise UserError(f"{source} does not exist; pass a run directory or an NVML sample file (.jsonl/.csv)")
    try:
        if source.is_dir():
            sample_dir = source / "nvml"
            if sample_dir.is_dir():
                samples = read_samples(sample_dir)
            else:  # a directory of sample files, e.g. copied from several nodes
                files = [p for p in sorted(source.iterdir()) if p.suffix in (".jsonl", ".csv") and not p.match(TIMELINE_GLOB)]
                samples = Samples(rows=[])
                for p in files:
                    part = read_samples(p)
                    samples.rows += part.rows
                    samples.meta += part.meta
                    samples.overhead += part.overhead
            events = read_timeline(timeline) if timeline else read_run_timeline(source)
        else:
            samples = read_samples(source)
            events = read_timeline(timeline) if timeline else []
    except (ValueError, KeyError) as exc:
        raise UserError(f"cannot read {source}: {exc}") from None
    if not samples.rows and not events:
        raise UserError(f"{source}: no NVML samples and no timeline events found; "
                        "expected nvml/*.jsonl and timeline*.jsonl in a run directory, or a sample file")
    return samples, events


def run(args: argparse.Namespace) -> int:
    source = Path(args.source)
    if args.timeline and not Path(args.timeline).is_file():
        raise UserError(f"--timeline {args.timeline} is not a file")
    samples, events = load_inputs(source, args.timeline)
    out = Path(args.out) if args.out else (source / "nvml_report" if source.is_dir() else source.with_name(source.stem + "_report"))
    report = render(samples, events, out, title=args.title or f"NVML utilization report: {source.name}",
                    max_batch=args.max_batch, source=str(source))
    for note in report.notes:
        print(f"note: {note}")
    print(f"wrote {report.html} ({len(report.figures)} figures, summary.csv, steps.csv)")
    return 0
