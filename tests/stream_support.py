"""Shared by the stream training tests: an in-process trainer group and a spawned child process.

    from stream_support import in_process_group, run_child, free_port

Megatron's parallel state is per process, so each trainer runs in a fresh spawned child; a worker inside it is
driven without Ray (a loaded machine cannot time out its start-up).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers import free_port  # noqa: F401 - re-exported for the stream tests


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """The stream tests' tiny model (seed 5), built once per module (`from stream_support import model_dir`)."""
    from megatron_sortedrl.config import TinyModelConfig
    from megatron_sortedrl.tiny_model import build_tiny_model

    d = tmp_path_factory.mktemp("stream") / "tiny"
    build_tiny_model(d, TinyModelConfig(seed=5))
    return d


def in_process_group(cfg):
    """A `TrainerGroup` over one in-process TP=1 worker (no Ray, so a loaded machine cannot time out its start-up)."""
    from megatron_sortedrl.trainer.group import TrainerGroup
    from megatron_sortedrl.trainer.worker import TrainerWorker

    class InProcessGroup(TrainerGroup):
        def __init__(self, cfg):
            self.cfg, self.world_size, self.first_reporter, self.actors = cfg, 1, 0, []
            self.worker = TrainerWorker(cfg, 0, 1, "127.0.0.1", free_port())
            self.worker.setup()

        def _all(self, method, *args, **kwargs):
            return [getattr(self.worker, method)(*args, **kwargs)]

        def _submit(self, method, *args, **kwargs):  # runs at once; nothing left pending
            self._all(method, *args, **kwargs)
            return []

    return InProcessGroup(cfg)


def run_child(target, *args, timeout: float = 300.0):
    """Runs `target(*args, queue)` in a fresh spawned process (Megatron's parallel state is per process) and
    returns what it put on the queue."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=target, args=(*args, q))
    proc.start()
    res = None
    while res is None and (proc.is_alive() or not q.empty()):
        try:
            res = q.get(timeout=5)
        except Exception:  # queue.Empty: keep waiting while the child lives
            pass
    proc.join(60)
    assert res is not None, f"the trainer process ended without a result (exit code {proc.exitcode})"
    if isinstance(res, BaseException):
        raise res
    return res
