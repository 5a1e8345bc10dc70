"""The finished runs of a real-run benchmark, kept in its work directory so a stopped benchmark goes on.

    log = RunLog(work, key=("variant", "repeat"), command="python benchmarks/x.py --work-dir w")
    if ("sync", 0) not in log:
        log.add({"variant": "sync", "repeat": 0, ...})   # one JSON line in <work>/runs.jsonl, written at once
    setup = {**log.setup(), ...}                         # the first start's command, every start, total seconds

Benchmarks that run the real system for hours (policy_comparison, learning_parity, moe_mismatch) append each
finished run to `runs.jsonl`; started again with the same `--work-dir` (after a crash, the OOM killer, or only
to redraw the summary) they skip what is there. Each start is also recorded in `starts.jsonl` when it ends
(`finish`), so the summary names the command that produced the runs and the seconds all starts took, not
those of the last start only (a summary-only start once wrote its own command and a 9 s benchmark time over a
ten-hour run's).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any


class RunLog:
    def __init__(self, work: Path, key: tuple[str, ...], command: str | None = None) -> None:
        self.work, self.key = Path(work), tuple(key)
        self.path = self.work / "runs.jsonl"
        self.command = command or "python " + " ".join(sys.argv)
        self.t0, self.date = time.monotonic(), time.strftime("%Y-%m-%d")
        self.done: dict[tuple, dict[str, Any]] = {}
        self.finished = False
        if self.path.exists():
            for line in self.path.read_text().splitlines():
                if line.strip():
                    rec = json.loads(line)
                    self.done[self._key(rec)] = rec

    def _key(self, rec: dict[str, Any]) -> tuple:
        return tuple(rec[k] for k in self.key)

    def __contains__(self, key: tuple) -> bool:
        return tuple(key) in self.done

    def __getitem__(self, key: tuple) -> dict[str, Any]:
        return self.done[tuple(key)]

    def __len__(self) -> int:
        return len(self.done)

    def add(self, rec: dict[str, Any]) -> dict[str, Any]:
        """Records a finished run (its key fields inside it) and appends it to runs.jsonl at once."""
        self.done[self._key(rec)] = rec
        with open(self.path, "a") as f:
            f.write(json.dumps(rec) + "\n")
        return rec

    def starts(self) -> list[dict[str, Any]]:
        """Every start of this benchmark on this work directory, oldest first, this one last."""
        path = self.work / "starts.jsonl"
        old = [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []
        return old + ([] if self.finished else [self._this_start()])

    def _this_start(self) -> dict[str, Any]:
        return {"command": self.command, "date": self.date, "seconds": round(time.monotonic() - self.t0, 1),
                "runs_after": len(self.done)}

    def setup(self) -> dict[str, Any]:
        """What a summary's setup says of how it was made: the first start's command, the date of the last,
        the seconds of all starts together, and the starts themselves."""
        starts = self.starts()
        return {"command": starts[0]["command"], "date": starts[-1]["date"],
                "benchmark_s": round(sum(s["seconds"] for s in starts), 1), "starts": starts}

    def finish(self) -> None:
        """Records this start (when its runs end, whether or not it ran anything); idempotent."""
        if not self.finished:
            with open(self.work / "starts.jsonl", "a") as f:
                f.write(json.dumps(self._this_start()) + "\n")
            self.finished = True
