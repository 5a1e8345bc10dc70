#!/usr/bin/env python
"""Render the NVML utilization report of a run directory or of a sample file recorded elsewhere.

    python tools/nvml_report.py runs/my_run [-o OUT] [--timeline timeline.jsonl] [--max-batch N]

Same as `python -m megatron_sortedrl nvml-report`; see docs/telemetry.md.
"""

import sys

from megatron_sortedrl.cli import main

if __name__ == "__main__":
    sys.exit(main(["nvml-report", *sys.argv[1:]]))
