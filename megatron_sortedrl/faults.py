"""Fault injection for the failure tests: named points where a test makes a real run fail on purpose.

    MSRL_FAULTS="checkpoint.after_shards=enospc@iter_0000002" python -m megatron_sortedrl train ...
    MSRL_FAULTS="checkpoint.after_shards=sleep5" ...               # hold every save there for 5 s

`MSRL_FAULTS` is a comma-separated list of `point=action[@match]`; `match` restricts it to calls whose
`name` contains that text (a checkpoint directory name). Actions: `enospc` raises `OSError(ENOSPC)` (a full
disk), `sleepN` sleeps N seconds (so a test can SIGKILL the run at that moment). The variable is read at each
call, so Ray workers started by the run see it through their inherited environment.

Points: `checkpoint.after_shards` (`trainer/checkpoint.py`: every rank's model and optimizer shards are in
the partial directory; the trainer state file and the COMPLETE marker are not).

Unset, as in every real run, a point costs one environment lookup. Left out: faults in engines and reward
workers (tests kill those processes directly) and random faults (tests choose the moments).
"""

from __future__ import annotations

import errno
import os
import time

ENV = "MSRL_FAULTS"


def hit(point: str, name: str = "") -> None:
    """Performs the fault configured for `point` (and a `match` contained in `name`), if any."""
    spec = os.environ.get(ENV)
    if not spec:
        return
    for item in spec.split(","):
        key, _, action = item.strip().partition("=")
        action, _, match = action.partition("@")
        if key != point or (match and match not in name):
            continue
        if action == "enospc":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), name)
        if action.startswith("sleep"):
            time.sleep(float(action[len("sleep"):] or 1))
