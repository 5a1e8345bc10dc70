"""Weight delivery of the rollout pool: `sync_weights` (the trainer's stage senders push, a (name, tensor) iterator,
or a directory), the reload a new or restarted engine gets, and the single-sender GPU path.

    pool.sync_weights(trainer_group, version=3)   # RolloutPool inherits it from `PoolWeights`

Split out of `pool.py` (the running pool: layout, streaming, abort, failures), whose state it uses: `self.slots`,
`self.opts`, `self.version` and the kept buckets; see the pool's docstring for the guarantees.
"""

from __future__ import annotations

import time
from typing import Any

from megatron_sortedrl.rollout.types import EngineSlot, SyncReport
from megatron_sortedrl.rollout.weight_sync import (
    WeightPusher,
    WeightSource,
    iter_packed,
    iter_source,
    replay,
    rereadable,
    sync_cpu,
    sync_push,
)
from megatron_sortedrl.rollout.weight_sync_gpu import GpuWeightSync


class PoolWeights:
    """The pool's weight sync and reload, a base of `RolloutPool` (kept apart to keep each file readable)."""

    @property
    def transport(self) -> str:
        t = self.opts.weight_transport
        if t == "auto":
            t = "object_store" if self.opts.device == "cpu" else ("ipc" if self.opts.colocate else "nccl")
        return t

    def sync_weights(self, source: WeightSource | WeightPusher, version: int) -> SyncReport:
        """Loads new weights into every engine and sets the policy version samples record.

        `source`: the trainer group (it pushes from one sender per pipeline stage; the pool only
        orchestrates), a (name, tensor) iterator, or a safetensors directory. An engine that dies during the
        sync is failed like one that dies in a round, the sync is done again on the others, and the engine
        restarts afterwards, so it loads this sync's weights and version (a one-shot iterator source cannot
        be read twice: then the error is raised)."""
        import ray

        # Engines still restarting are waited for without their reload: this sync brings them up to date.
        self._wait_started([s for s in self.slots if s.state == "starting"], reload=False)
        died: list[EngineSlot] = []
        while True:
            ready = [s for s in self.slots if s.state == "ready"]
            try:
                report, replay_src = self._sync_to(ready, source, version)
                break
            except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as exc:
                dead = self._dead(ready)
                if not dead or len(dead) == len(ready) or not rereadable(source):
                    raise
                for slot in dead:
                    self._fail(slot, f"died during weight sync: {type(exc).__name__}", restart=False)
                died += dead
        self.version = version
        self._replay_src = None  # drop kept buckets of the previous sync before anything else holds them
        self._replay_src = replay_src
        self.events.append({"event": "sync", "time": time.monotonic(), **report.to_dict()})
        if self.opts.restart_failed:
            for slot in died:  # started now, they load the weights and version just synced (`_reload`)
                self.events.append({"event": "worker_restart", "time": time.monotonic(), "worker": slot.index})
                self._launch(slot)
        return report

    def _sync_to(self, ready: list[EngineSlot], source: WeightSource | WeightPusher, version: int) -> tuple[SyncReport, Any]:
        actors = [s.actor for s in ready]
        o = self.opts
        if hasattr(source, "push_weights"):
            return self._push(actors, source, version), ("push", source, source.weights_epoch)
        if self.transport == "object_store":
            from pathlib import Path

            is_dir = isinstance(source, (str, Path))
            report, kept = sync_cpu(actors, source, version, bucket_bytes=o.bucket_bytes,
                                    keep_buckets=o.keep_weights and not is_dir)
            return report, (("dir", str(source)) if is_dir else (("kept", kept) if kept else None))
        report, kept = self._sync_gpu(ready, source, version)
        return report, (("kept", kept) if kept else None)

    def _dead(self, slots: list[EngineSlot]) -> list[EngineSlot]:
        """The slots whose engine actor no longer answers a ping."""
        import ray

        dead = []
        for slot in slots:
            try:
                ray.get(slot.actor.ping.remote(), timeout=30)
            except Exception:
                dead.append(slot)
        return dead

    def _push(self, actors: list[Any], pusher: WeightPusher, version: int) -> SyncReport:
        # Multi-sender GPU transfer: NCCL, or CUDA IPC for colocated engines that see every sender's GPU (one
        # node, colocate/placement.py); anything else goes through the object-store / shared-memory path.
        shared = self.opts.shared_placement
        t = self.transport if self.transport == "nccl" or (shared is not None and shared.one_node) else "object_store"
        return sync_push(actors, pusher, version, bucket_bytes=self.opts.bucket_bytes,
                         transport=t, nccl={} if t == "nccl" else None,
                         mode=self.opts.weight_sync_mode)

    def _reload(self, slots: list[EngineSlot]) -> None:
        """Gives freshly started engines the last synced weights and version (see `_replay_src`)."""
        if self._replay_src is None or not slots:
            return
        actors = [s.actor for s in slots]
        kind = self._replay_src[0]
        if kind == "push":
            _, pusher, epoch = self._replay_src
            if pusher.weights_epoch != epoch:
                raise RuntimeError(f"the trainer's weights changed after version {self.version} was synced; "
                                   "sync again before a layout switch or an engine restart")
            self._push(actors, pusher, self.version)
        elif kind == "dir":
            sync_cpu(actors, self._replay_src[1], self.version, bucket_bytes=self.opts.bucket_bytes)
        else:
            replay(actors, self._replay_src[1], self.version)

    def _sync_gpu(self, ready: list[EngineSlot], source: WeightSource, version: int) -> tuple[SyncReport, list[Any]]:
        """Single-sender GPU path for (name, tensor) sources: this process broadcasts through vLLM's engines."""
        import ray

        if self._gpu_sync is None:
            import socket

            with socket.socket() as sock:  # a free port for the NCCL rendezvous, chosen now
                sock.bind(("", 0))
                port = sock.getsockname()[1]
            self._gpu_sync = GpuWeightSync([s.actor for s in ready], [s.tp for s in ready], self.transport,
                                           ray.util.get_node_ip_address(), port)
        kept: list[Any] = []
        if self.opts.keep_weights:
            # Host copies for engines started later (relayout, restart), packed into the object store as we go.
            pending: list[tuple[str, Any]] = []

            def tee():
                for name, t in iter_source(source):
                    pending.append((name, t.detach().to("cpu")))
                    yield name, t
            report = self._gpu_sync.sync(tee(), version, bucket_bytes=self.opts.bucket_bytes)
            kept = [(ray.put(flat.numpy()), meta) for flat, meta in iter_packed(iter(pending), self.opts.bucket_bytes)]
        else:
            report = self._gpu_sync.sync(source, version, bucket_bytes=self.opts.bucket_bytes)
        return report, kept
