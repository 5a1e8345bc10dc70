"""gpu-check's record of progress: a pytest plugin that rewrites the check's JSON after every test.

    python -m pytest -p gpu_check_progress ...      # with tools/ on PYTHONPATH and MSRL_GPU_CHECK_JSON set

`tools/gpu_check.py` writes the JSON first (environment, budget, `"status": "running"`), then runs pytest with
this plugin: as each test starts, its node id goes into `"running"`; as it ends, its outcome, seconds and the
first line of its reason join `"tests"`; a file skipped or failing as a whole at import joins under its name. Every write replaces the file atomically (a temporary file renamed over
it), so a run cut short at any moment, by the check's own budget or by the machine's, leaves valid JSON that
names the tests done and the one that was running.

Left out: anything but the JSON (pytest's own output goes to the log the check keeps beside it).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

ENV = "MSRL_GPU_CHECK_JSON"


def write_json(path: Path, data: dict) -> None:
    """Replaces `path` with `data` in one rename: a reader (or a kill) never sees half a file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)


def read_json(path: Path) -> dict:
    return json.loads(path.read_text())


def _short(nodeid: str) -> str:
    """`tests/test_x.py::test_y[p]` -> `test_x::test_y[p]` (the form docs/gpu.md's table shows)."""
    file, _, name = nodeid.partition("::")
    return f"{Path(file).stem}::{name}"


def _reason(report) -> str:
    if report.skipped and isinstance(report.longrepr, tuple):
        return str(report.longrepr[2]).removeprefix("Skipped: ")[:300]
    text = getattr(report, "longreprtext", "") or ""
    lines = [ln for ln in text.splitlines() if ln.startswith("E ")] or text.splitlines()[-1:]
    return lines[0][1:].strip()[:300] if lines and lines[0].startswith("E ") else (lines[0][:300] if lines else "")


class Progress:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.started: dict[str, float] = {}

    def _update(self, change) -> None:
        data = read_json(self.path)
        change(data)
        write_json(self.path, data)

    def pytest_runtest_logstart(self, nodeid, location) -> None:
        self._update(lambda d: d.update(running=_short(nodeid)))

    def pytest_runtest_logreport(self, report) -> None:
        # one entry per test: its failing phase, else its call (a skip or error in setup ends it there)
        final = report.when == "call" or (report.when == "setup" and not report.passed) or (
            report.when == "teardown" and report.failed)
        if not final:
            return
        outcome = "passed" if report.passed else ("skipped" if report.skipped else "failed")
        entry = {"test": _short(report.nodeid), "outcome": outcome, "seconds": round(report.duration, 1),
                 "detail": "" if report.passed else _reason(report)}

        def add(d: dict) -> None:
            tests = [t for t in d.setdefault("tests", []) if t["test"] != entry["test"] or outcome != "failed"]
            if not any(t["test"] == entry["test"] for t in tests):
                tests.append(entry)
            d["tests"] = tests

        self._update(add)

    def pytest_collectreport(self, report) -> None:
        # a whole file skipped at import (no GPU, `pytest.importorskip("ray")` on a bare image) or failing to import
        if report.nodeid.endswith(".py") and not report.passed:
            outcome = "skipped" if report.skipped else "failed"
            entry = {"test": Path(report.nodeid).stem, "outcome": outcome, "seconds": None, "detail": _reason(report)}
            self._update(lambda d: d.setdefault("tests", []).append(entry))

    def pytest_sessionfinish(self, session, exitstatus) -> None:
        self._update(lambda d: d.update(running=None))


def pytest_configure(config) -> None:
    path = os.environ.get(ENV)
    if path:
        config.pluginmanager.register(Progress(Path(path)), "gpu_check_progress_writer")
