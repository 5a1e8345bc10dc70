"""A colocated relayout (or HistoSpec switch) starts its new engines with the trainer's state away from the devices.

    python -m pytest tests/test_colocate_relayout.py -q        # CPU, under a second

vLLM sizes a new engine's KV cache from the device memory it finds free at start, so an engine started beside a
resident trainer gets the cache of (1 - trainer state) of the GPU, or refuses to start when the trainer holds more
than 1 - gpu_memory_utilization. The lifecycle (colocate/lifecycle.py) and the pool are stand-ins here that log the
order of events and refuse what a GPU would refuse: reading the trainer's weights while its state is away. The
memory effect itself is `tests/test_colocate_gpu.py::test_colocated_relayout_starts_engines_beside_an_offloaded_trainer`.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from megatron_sortedrl.colocate import lifecycle
from megatron_sortedrl.colocate.lifecycle import Colocated
from megatron_sortedrl.relayout import apply_layout


class _Trainer:
    def __init__(self, log):
        self.log, self.resident = log, True

    def offload_state(self):
        self.log.append("offload")
        self.resident = False
        return {"bytes": 100}

    def reload_state(self):
        self.log.append("reload")
        self.resident = True
        return {"bytes": 100}


class _Pool:
    """Engines by key; `set_layout` replaces them all; a sync reads the trainer's weights."""

    def __init__(self, trainer, log):
        self.trainer, self.log = trainer, log
        self.layout, self.version, self.transport, self.generation = (2, 1), 3, "ipc", 0
        self.keys = ["e0-0", "e0-1"]
        self.versions = {k: 3 for k in self.keys}

    def set_layout(self, n, tp, reload=True):
        self.log.append(("set_layout", "trainer resident" if self.trainer.resident else "trainer away", reload))
        if reload and not self.trainer.resident:
            raise RuntimeError("the new engines' weight reload read an offloaded trainer")
        self.generation += 1
        self.layout, self.keys = (n, tp), [f"e{self.generation}-{i}" for i in range(n)]
        self.versions = {k: self.version if reload else 0 for k in self.keys}
        return {"total_s": 0.0}

    def sync_weights(self, trainer, version):
        if not trainer.resident:
            raise RuntimeError("hand-off from an offloaded trainer")
        self.log.append("handoff")
        self.versions = {k: version for k in self.keys}
        return SimpleNamespace(bytes=50, transport=self.transport)

    def load(self):
        return [SimpleNamespace(version=self.versions[k]) for k in self.keys]


@pytest.fixture
def colocated(monkeypatch):
    log: list = []
    trainer = _Trainer(log)
    pool = _Pool(trainer, log)
    monkeypatch.setattr(lifecycle, "ready_engines", lambda p: dict.fromkeys(p.keys))

    def sleep(p, level, keys):
        log.append(("sleep", len(keys)))
        return {k: {"weights": 10, "kv_cache": 20, "freed": True} for k in keys}

    monkeypatch.setattr(lifecycle, "sleep_engines", sleep)
    monkeypatch.setattr(lifecycle, "wake_engines", lambda p, tags, keys: log.append(("wake", tags[0], len(keys))))
    colo = Colocated(trainer, pool, sleep_level=2, offload_trainer=True)
    colo.to_train()  # between phases: the trainer resident, the engines asleep
    log.clear()
    return colo, pool, trainer, log


def test_relayout_starts_new_engines_with_the_trainer_state_away(colocated):
    colo, pool, trainer, log = colocated
    d = SimpleNamespace(pool=pool, colo=colo, version=3, step=1, say=lambda s: None, _phase=lambda *a, **k: None,
                        cfg=SimpleNamespace(speculative=SimpleNamespace(enabled=False)),
                        policy=SimpleNamespace(planner=None))
    row: dict = {}
    apply_layout(d, SimpleNamespace(layout=SimpleNamespace(num_engines=1, tp=2), requests=[], index=0, kind="long"),
                 row)
    assert log == ["offload", ("set_layout", "trainer away", False),  # the new engine sizes its cache now
                   ("sleep", 1), "reload",  # it sleeps, the trainer's state comes back
                   ("wake", "weights", 1), "handoff"]  # and it gets the current weights
    assert pool.layout == (1, 2) and row["rollout/relayouts"] == 1
    assert trainer.resident and colo.engines == {"e1-0": "weights"}
    log.clear()
    colo.to_rollout()  # the round: the trainer's state leaves, then the new engine's KV cache wakes
    assert log == ["offload", ("wake", "kv_cache", 1)]


def test_a_switch_without_offload_keeps_the_trainer_and_still_syncs_the_new_engines(colocated):
    colo, pool, trainer, log = colocated
    colo.offload_trainer = False
    colo.replace_engines(lambda reload: pool.set_layout(2, 1, reload=reload))
    assert log == [("set_layout", "trainer resident", False), ("sleep", 2), ("wake", "weights", 2), "handoff"]
    assert {w.version for w in pool.load()} == {3}
