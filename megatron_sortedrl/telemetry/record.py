"""Standalone NVML recording around any command, for utilization figures of other frameworks.

    python tools/nvml_record.py -o runs/verl_baseline -- python -m verl.trainer.main_ppo ...
    python tools/nvml_record.py --interval 0.05 -- torchrun --nproc-per-node 8 train.py

Samples every GPU of this node while the command runs, writes a run directory in the same layout as a
megatron-sortedrl run (`nvml/<host>.jsonl`, `timeline.jsonl` with one phase named "command") and renders
the same report into `<out>/nvml_report/`. Exits with the command's exit status. Without an NVIDIA
driver it says so in one line, still runs the command, and reports the timeline only.

Left out: the phases of the other framework (it does not write our timeline; its GPUs' busy stretches
show in the heat map all the same), and sampling other nodes (run one recorder per node).
"""

from __future__ import annotations

import argparse
import datetime
import json
import signal
import socket
import subprocess
import sys
from pathlib import Path

from megatron_sortedrl.telemetry.nvml import NvmlSampler, Samples, read_samples
from megatron_sortedrl.telemetry.report import render
from megatron_sortedrl.telemetry.timeline import RunClock, TimelineWriter, read_run_timeline


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nvml_record.py", description=__doc__.split("\n")[0],
                                     usage="%(prog)s [-o OUT] [--interval S] [--no-report] -- command [args ...]")
    parser.add_argument("-o", "--out", default=None, help="run directory to write (default: nvml_runs/<date-time>)")
    parser.add_argument("--interval", type=float, default=0.1, help="seconds between samples (default 0.1 = 10 Hz)")
    parser.add_argument("--no-report", action="store_true", help="only record; render later with nvml-report")
    return parser


def record(command: list[str], out: Path, interval_s: float = 0.1, report: bool = True) -> int:
    """Run `command` under the sampler; returns its exit status (128 + signal if it was killed)."""
    out.mkdir(parents=True, exist_ok=True)
    clock = RunClock()
    host = socket.gethostname()
    sampler = NvmlSampler(out / "nvml" / f"{host}.jsonl", clock=clock, interval_s=interval_s, host=host)
    sampler.start()
    with TimelineWriter(out / "timeline.jsonl", clock=clock) as timeline:
        timeline.record("phase", "start", 0, phase="command")
        try:
            proc = subprocess.Popen(command)
        except OSError as exc:
            timeline.record("phase", "end", 0, phase="command")
            sampler.stop()
            print(f"error: cannot run {command[0]!r}: {exc}", file=sys.stderr)
            return 127
        try:
            rc = proc.wait()
        except KeyboardInterrupt:
            # Ctrl-C reaches the child too (same process group); wait for it so the recording covers its
            # shutdown and the report still gets written.
            proc.send_signal(signal.SIGINT)
            rc = proc.wait()
        timeline.record("phase", "end", 0, phase="command")
    stats = sampler.stop()
    (out / "command.json").write_text(json.dumps({"command": command, "returncode": rc, "host": host,
                                                  "epoch": clock.epoch, "sampler": stats}, indent=1))
    if sampler.unavailable_reason is None:
        print(f"nvml_record: {stats['ticks']} samples of {stats['rows'] // max(1, stats['ticks'])} GPU(s); "
              f"sampler cost {stats['ms_per_tick']} ms per sample, "
              f"{100 * stats['cpu_fraction_of_one_core']:.3f} % of one CPU core", file=sys.stderr)
    if report:
        samples_dir = out / "nvml"
        samples = read_samples(samples_dir) if samples_dir.is_dir() else Samples(rows=[])
        result = render(samples, read_run_timeline(out), out / "nvml_report",
                        title=f"NVML utilization: {' '.join(command)[:80]}", source=str(out))
        print(f"nvml_record: report in {result.html}", file=sys.stderr)
    return rc if rc >= 0 else 128 - rc


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        build_parser().print_usage(sys.stderr)
        print("error: put the command to record after `--`", file=sys.stderr)
        return 2
    split = argv.index("--")
    args = build_parser().parse_args(argv[:split])
    command = argv[split + 1:]
    if not command:
        print("error: no command after `--`", file=sys.stderr)
        return 2
    if args.interval <= 0:
        print(f"error: --interval must be > 0, got {args.interval}", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else Path("nvml_runs") / datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    return record(command, out, args.interval, report=not args.no_report)
