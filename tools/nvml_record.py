#!/usr/bin/env python
"""Sample every GPU of this node with NVML while a command runs, then render the utilization report.

    python tools/nvml_record.py -o runs/baseline -- python train.py --my-args

Works for any framework (the command is run as is). Details: megatron_sortedrl/telemetry/record.py and
docs/telemetry.md.
"""

import sys

from megatron_sortedrl.telemetry.record import main

if __name__ == "__main__":
    sys.exit(main())
