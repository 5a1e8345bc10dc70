"""Shared test setup: hardware markers and the tiny model.

Every test declares its hardware: unmarked tests run on CPU; `@pytest.mark.gpu` tests are skipped with a
reason when no CUDA device is visible; `@pytest.mark.slow` end-to-end tests are deselected by the default
command (`make test`) and run with `make test-all`.

The suite leaves no process behind: every process it starts carries `MSRL_TEST_SESSION` in its environment
(runs it SIGKILLs included, whose processes are re-parented to init). At the end of the session, those still
alive after a grace period, and any child of the test process, are listed and killed; with
`MSRL_LEFTOVERS=fail` they also fail the session. The default only lists and kills: a leak that shows in one
run of three (an in-process vLLM engine whose shutdown did not wait, once) must not decide whether a
submission lands, and the listing names it for fixing.
"""

from __future__ import annotations

import os
import time
import uuid

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

SESSION_VAR = "MSRL_TEST_SESSION"
_SESSION = uuid.uuid4().hex[:16]
# Appended, not replaced: a suite run from inside another (a test of the test tooling) stays visible to the outer.
os.environ[SESSION_VAR] = f"{os.environ[SESSION_VAR]}:{_SESSION}" if os.environ.get(SESSION_VAR) else _SESSION


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


def pytest_collection_modifyitems(config, items):
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A freshly built tiny Qwen2 model directory (default TinyModelConfig), shared by the session."""
    from megatron_sortedrl.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny")


@pytest.fixture(scope="module")
def local_ray():
    """A 2-CPU local Ray for one test module, unless one is already running (then it is left alone)."""
    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    if started:
        ray.shutdown()



def _leftovers() -> list:
    import psutil

    from megatron_sortedrl.lifetime import processes_with_token

    found = {p.pid: p for p in psutil.Process().children(recursive=True)}
    for pid in processes_with_token(_SESSION, var=SESSION_VAR):
        try:
            found.setdefault(pid, psutil.Process(pid))
        except psutil.Error:
            pass
    alive, me = [], os.getpid()
    for p in found.values():
        try:
            if p.ppid() == me and "resource_tracker" in " ".join(p.cmdline()):
                continue  # multiprocessing's tracker of this process: it ends when this process does
            if p.status() != psutil.STATUS_ZOMBIE:
                alive.append(p)
        except psutil.Error:
            pass
    return alive


def pytest_sessionfinish(session, exitstatus):
    """Lists and kills the processes the session started that outlive it (after a grace period for clean exits);
    with MSRL_LEFTOVERS=fail they also fail the session."""
    end = time.monotonic() + float(os.environ.get("MSRL_LEFTOVERS_GRACE_S", "20"))
    left = _leftovers()
    while left and time.monotonic() < end:
        time.sleep(0.5)
        left = _leftovers()
    if not left:
        return
    import psutil

    lines = []
    for p in left:
        try:
            lines.append(f"  pid {p.pid} (parent {p.ppid()}): {' '.join(p.cmdline())[:160]}")
            p.kill()
        except psutil.Error:
            pass
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    text = f"{len(lines)} process(es) started by the tests outlived them (killed now):\n" + "\n".join(lines)
    if reporter is not None:
        reporter.ensure_newline()
        reporter.write_line(text, red=True)
    else:
        print(text)
    if os.environ.get("MSRL_LEFTOVERS", "warn") == "fail" and session.exitstatus == 0:
        session.exitstatus = 1
