"""The rollout pool: engine actors in a layout that can change between rounds, streaming, abort, failures.

    from megatron_sortedrl.rollout import RolloutPool, PoolOptions, GenRequest
    pool = RolloutPool(PoolOptions.from_config(cfg))       # starts Ray locally if needed, then the engines
    pool.submit(GenRequest("p0/e0/0", prompt_ids, {"max_tokens": 256, "temperature": 1.0}), worker=0)
    for c in pool.completions():                           # each Completion as soon as it finishes
        ...
    partial = pool.abort(["p0/e0/1"])                      # partial tokens + log-probs
    pool.sync_weights(trainer_group, version=1)           # the trainer's stage senders push to the engines
    pool.set_layout(num_engines=1, tp=2)                   # long round: fewer, wider engines
    pool.shutdown()

Guarantees the scheduler relies on:
* Every submitted request id comes back exactly once: finished (stop/length) through `poll`/`completions`,
  partial (abort) from `abort`, or `lost` through `poll` when its worker died or hung. A lost request has
  no tokens; the scheduler resubmits it (the pool never resubmits on its own, so it cannot duplicate).
* A worker that raises Ray's actor-died error, or that holds requests and makes no progress for
  `request_timeout_s`, is killed and reported; it is restarted with the current weights and version
  (`restart_failed`) or its slot stays dead and `submit` to it raises `WorkerUnavailable`.
* A layout switch (`set_layout`) stops every engine and starts the new ones with dummy weights, then
  loads the last synced weights again, so outputs and the policy version carry over. With the trainer as
  the source they are pulled from the trainer again (no host copy is kept; the pool refuses if the trainer
  has changed its weights since that sync); a directory is re-read; only a (name, tensor) iterator source
  is kept, packed in Ray's object store (`keep_weights`, one model copy, replaced at the next sync).
  Each engine is one actor holding all TP ranks' devices in one placement-group bundle of its own, so a TP
  group never spans nodes; with `gpus_per_node` declared on GPU the bundles are pinned to the layout's
  rollout nodes (`megatron_sortedrl.placement`). Reserving the bundles and starting the engines are each
  bounded by `startup_timeout_s`; a timeout raises `ClusterError` naming the engines or resources missing.

Deliberately left out: choosing the layout and the placement (the scheduler's planner does), queueing
beyond the engines' own waiting queues, and resubmission policy.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any

from megatron_sortedrl.rollout.engine_worker import EngineWorker, engine_env, engine_kwargs
from megatron_sortedrl.rollout.pool_options import PoolOptions, executor_for
from megatron_sortedrl.rollout.pool_weights import PoolWeights
from megatron_sortedrl.rollout.types import Completion, EngineSlot, GenRequest, WorkerLoad
from megatron_sortedrl.rollout.weight_sync_gpu import GpuWeightSync


class WorkerUnavailable(RuntimeError):
    """A request was sent to a worker slot that died and was not restarted."""


class RolloutPool(PoolWeights):
    def __init__(self, opts: PoolOptions, *, start: bool = True) -> None:
        import ray

        if not ray.is_initialized():
            ray.init(address="local", include_dashboard=False, log_to_driver=True)
        self.opts = opts
        self.version = 0
        self.slots: list[EngineSlot] = []
        self.events: list[dict[str, Any]] = []  # failures, restarts, layout switches (for the run timeline)
        self._owner: dict[str, int] = {}  # request id -> slot, for every request not yet returned
        self._ready: list[Completion] = []  # lost records waiting for the next poll
        # How engines started later get the last synced weights: ("push", trainer, weights epoch) re-pulls from
        # the trainer, ("dir", path) re-reads, ("kept", [(ref, meta)]) replays kept packed buckets; None: files.
        self._replay_src: tuple | None = None
        self._gpu_sync: GpuWeightSync | None = None  # built lazily per layout
        self._placement: Any = None  # the current layout's placement group (one bundle per engine)
        if start:
            self.set_layout(opts.num_engines, opts.tp)

    # ------------------------------------------------------------------------------------------- layout
    @property
    def layout(self) -> tuple[int, int]:
        return len(self.slots), (self.slots[0].tp if self.slots else 0)

    def set_layout(self, num_engines: int, tp: int, reload: bool = True) -> dict[str, float]:
        """Replaces every engine by `num_engines` engines of TP `tp`; needs no request in flight. `reload`: the
        new engines take the last synced weights as they start (False: they start on dummy weights and the
        caller syncs them, as a colocated relayout does once the trainer's state is back)."""
        if self._owner:
            raise RuntimeError(f"set_layout with {len(self._owner)} requests in flight; abort or drain them first")
        t0 = time.monotonic()
        for slot in self.slots:
            self._stop(slot)
        t1 = time.monotonic()
        if self._gpu_sync is not None:
            self._gpu_sync.close()  # its NCCL communicators, before the new engines' group is made
        self._gpu_sync = None
        self.slots = []
        self._reserve(num_engines, tp)
        self.slots = [self._launch(EngineSlot(i, tp)) for i in range(num_engines)]
        try:
            self._wait_started(self.slots, reload=reload)
        except BaseException:
            self.shutdown()  # no half-started layout left holding its GPUs
            raise
        t2 = time.monotonic()
        report = {"num_engines": num_engines, "tp": tp, "stop_s": t1 - t0, "start_s": t2 - t1, "total_s": t2 - t0,
                  "engine_start_s": max(s.info.get("engine_start_s", 0.0) for s in self.slots),
                  "weight_load_s": max(s.info.get("weight_load_s", 0.0) for s in self.slots)}
        self.events.append({"event": "layout", "time": t2, **report})
        return report

    def _reserve(self, num_engines: int, tp: int) -> None:
        """One bundle per engine (all its TP devices), replacing the previous layout's placement group."""
        from megatron_sortedrl import placement as P

        o = self.opts
        self._release_placement()
        if o.shared_placement is not None:  # colocated: the trainer's reservation, released by the trainer
            self._placement = o.shared_placement.reservation
            return
        bundles = P.engine_bundles(num_engines, tp, gpu=o.device == "gpu", cpus_per_rank=o.cpus_per_rank,
                                   gpus_per_node=o.gpus_per_node, first_gpu=o.first_gpu)
        self._placement = P.reserve(bundles, f"rollout ({num_engines} engines x TP {tp})", o.startup_timeout_s)

    def _release_placement(self) -> None:
        if self._placement is not None and self.opts.shared_placement is None:
            self._placement.release()
        self._placement = None

    def _launch(self, slot: EngineSlot) -> EngineSlot:
        import ray

        o = self.opts
        kw = engine_kwargs(o.model_path, tp=slot.tp, dtype=o.dtype, max_num_seqs=o.max_num_seqs,
                           max_model_len=o.max_model_len, seed=o.seed, enforce_eager=o.enforce_eager,
                           gpu_memory_utilization=o.gpu_memory_utilization,
                           load_format="dummy" if self._replay_src else "auto",
                           speculative_config=o.speculative_config, worker_extension_cls=o.worker_extension_cls,
                           weight_transfer_backend=self.transport if self.transport != "object_store" else None,
                           executor=executor_for(o.executor, o.device, slot.tp), **o.engine_extra)
        if o.device == "gpu":
            resources: dict[str, Any] = {"num_gpus": slot.tp, "num_cpus": 1}
            cpu_ids = None
        else:
            resources = {"num_cpus": o.cpus_per_rank * slot.tp}
            ncpu = os.cpu_count() or 1
            cpu_ids = ([[(slot.index * slot.tp + r) % ncpu] for r in range(slot.tp)]
                       if o.cpu_bind == "spread" else None)
        env = engine_env(device=o.device, kv_cache_gib=o.kv_cache_gib, cpu_ids=cpu_ids)
        bundle = slot.index
        if o.shared_placement is not None:  # colocated: on its trainer ranks' devices, in their bundle
            resources, env = o.shared_placement.engine_options(slot.index, slot.tp, resources, env)
            bundle = o.shared_placement.bundle_of(slot.index, slot.tp)
        actor_cls = ray.remote(EngineWorker).options(max_concurrency=1000, runtime_env={"env_vars": env},
                                                     scheduling_strategy=self._placement.strategy(bundle), **resources)
        slot.actor = actor_cls.remote(slot.index, kw, self.version)
        slot.start_ref = slot.actor.start.remote(self.version)
        slot.state, slot.poll_ref, slot.generated = "starting", None, 0
        return slot

    def _wait_started(self, slots: list[EngineSlot], reload: bool = True) -> None:
        from megatron_sortedrl.placement import wait_ready

        if not slots:
            return
        infos = wait_ready([s.start_ref for s in slots], "rollout engine start", self.opts.startup_timeout_s,
                           labels=[f"engine {s.index} (TP {s.tp}) on node {self._placement.node_of(s.index)[:8]}"
                                   for s in slots])
        if reload:
            self._reload(slots)
        for slot, info in zip(slots, infos):
            self._finish_start(slot, info)

    def _finish_start(self, slot: EngineSlot, info: dict[str, Any]) -> None:
        slot.info, slot.pid, slot.state, slot.start_ref = info, info["pid"], "ready", None
        slot.clock_offset = self._clock_offset(slot)
        slot.last_progress = time.monotonic()
        if slot.pending:
            slot.actor.submit.remote(slot.pending)
            slot.pending = []

    @staticmethod
    def _clock_offset(slot: EngineSlot) -> float:
        """Driver clock minus the worker's, from the fastest of three pings (the start-up reply can reach the
        driver long after the worker stamped it, e.g. behind the weight reload)."""
        import ray

        best = (float("inf"), 0.0)
        for _ in range(3):
            t_a = time.monotonic()
            t_w = ray.get(slot.actor.ping.remote(), timeout=60)
            t_b = time.monotonic()
            best = min(best, (t_b - t_a, (t_a + t_b) / 2 - t_w))
        return best[1]

    def _stop(self, slot: EngineSlot) -> None:
        import ray

        if slot.actor is None:
            return
        try:
            ray.get(slot.actor.shutdown.remote(), timeout=60)
        except Exception:
            pass  # dead or hung: killing is all that is left
        ray.kill(slot.actor, no_restart=True)
        slot.actor, slot.state = None, "dead"

    def shutdown(self) -> None:
        for slot in self.slots:
            self._stop(slot)
        self.slots = []
        self._release_placement()

    def worker_pids(self) -> list[int]:
        return [s.pid for s in self.slots]

    # --------------------------------------------------------------------------------------- generation
    def submit(self, request: GenRequest, worker: int) -> None:
        self.submit_many([(request, worker)])

    def submit_many(self, items: list[tuple[GenRequest, int]]) -> None:
        import ray

        by_slot: dict[int, list[GenRequest]] = {}
        for req, w in items:
            if req.request_id in self._owner:
                raise ValueError(f"request {req.request_id} is already in flight")
            if not 0 <= w < len(self.slots):
                raise ValueError(f"worker {w} out of range 0..{len(self.slots) - 1}")
            if self.slots[w].state == "dead":
                raise WorkerUnavailable(f"worker {w} died and was not restarted")
            by_slot.setdefault(w, []).append(req)
        acks = {}
        for w, reqs in by_slot.items():
            slot = self.slots[w]
            if not any(s == w for s in self._owner.values()):
                slot.last_progress = time.monotonic()  # an idle worker's clock starts now
            for r in reqs:
                self._owner[r.request_id] = w
            if slot.state == "starting":
                slot.pending.extend(reqs)
            else:
                acks[slot.actor.submit.remote(reqs)] = slot
        # Waiting for the acknowledgement orders the submit before any later call (load, abort) and surfaces
        # refused requests here; a worker that died meanwhile is failed and its requests reported lost.
        for ref, slot in acks.items():
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError as exc:
                self._fail(slot, f"worker died: {type(exc).__name__}")

    @property
    def in_flight(self) -> int:
        return len(self._owner)

    def poll(self, timeout_s: float | None = None) -> list[Completion]:
        """Returns the completions (finished or lost) that arrived within `timeout_s` (at least one if any)."""
        import ray

        timeout_s = self.opts.poll_wait_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        out = self._take_ready()
        while True:
            self._service_starting()
            refs = {}
            for slot in self.slots:
                if slot.state == "ready":
                    if slot.poll_ref is None:
                        slot.poll_ref = slot.actor.poll.remote(self.opts.poll_wait_s)
                    refs[slot.poll_ref] = slot
            remaining = max(0.0, deadline - time.monotonic())
            done, _ = ray.wait(list(refs), num_returns=1, timeout=remaining if refs else 0) if refs else ([], [])
            if not refs and not out:
                time.sleep(min(remaining, 0.05))
            for ref in done:
                slot = refs[ref]
                slot.poll_ref = None
                try:
                    res = ray.get(ref)
                except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as exc:
                    self._fail(slot, f"worker died: {type(exc).__name__}")
                    continue
                self._accept(slot, res)
            self._check_hung()
            out.extend(self._take_ready())
            if out or time.monotonic() >= deadline:
                return out

    def completions(self, timeout_s: float | None = None) -> Iterator[Completion]:
        """Yields completions as they arrive until nothing is in flight (or `timeout_s` passes)."""
        end = None if timeout_s is None else time.monotonic() + timeout_s
        while self._owner or self._ready:
            if end is not None and time.monotonic() >= end:
                return
            yield from self.poll()

    def abort(self, request_ids: list[str]) -> list[Completion]:
        """Aborts requests; returns the record of each one the pool still held (partial ones: "abort").

        Ids not returned were already delivered, or finished on the engine and will arrive through `poll`.
        """
        import ray

        by_slot: dict[int, list[str]] = {}
        out: list[Completion] = []
        for rid in request_ids:
            w = self._owner.get(rid)
            if w is None:
                continue
            slot = self.slots[w]
            queued = next((r for r in slot.pending if r.request_id == rid), None)
            if queued is not None:  # never reached an engine
                slot.pending.remove(queued)
                del self._owner[rid]
                out.append(Completion(rid, w, finish_reason="abort", num_prompt_tokens=len(queued.prompt_tokens),
                                      finish_time=time.monotonic()))
            else:
                by_slot.setdefault(w, []).append(rid)
        refs = {self.slots[w].actor.abort.remote(ids): w for w, ids in by_slot.items()}
        for ref, w in refs.items():
            try:
                recs = ray.get(ref, timeout=self.opts.request_timeout_s)
            except Exception as exc:
                self._fail(self.slots[w], f"abort failed: {type(exc).__name__}")
                continue
            out.extend(self._claim(self.slots[w], recs))
        return out

    def load(self) -> list[WorkerLoad]:
        import ray

        loads = []
        for slot in self.slots:
            if slot.state == "ready":
                loads.append(ray.get(slot.actor.load.remote()))
            else:
                n = sum(1 for w in self._owner.values() if w == slot.index)
                loads.append(WorkerLoad(slot.index, n, 0, 0, self.version if slot.state != "dead" else -1, slot.tp))
        return loads

    def collective_rpc(self, method: str, *args: Any, **kwargs: Any) -> list[list[Any]]:
        """Calls a worker-extension method on every TP rank of every ready engine (e.g. "histospec_update")."""
        import ray

        return ray.get(self.collective_rpc_async(method, *args, **kwargs))

    def collective_rpc_async(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """As `collective_rpc`, without waiting: the calls' references, one per ready engine (`rpc_results`)."""
        return [s.actor.rpc.remote(method, args, kwargs) for s in self.slots if s.state == "ready"]

    def rpc_results(self, refs: list[Any], timeout: float | None = 0.0) -> list[list[Any]] | None:
        """The answers of `collective_rpc_async`'s calls, or None while one is still running after `timeout`
        seconds (None: wait for all)."""
        import ray

        if not refs:
            return []
        _, pending = ray.wait(list(refs), num_returns=len(refs), timeout=timeout)
        return None if pending else ray.get(list(refs))

    def weights_digests(self) -> list[list[str]]:
        import ray

        return [ray.get(s.actor.weights_digest.remote()) for s in self.slots if s.state == "ready"]

    # ---------------------------------------------------------------------------------------- internals
    def _accept(self, slot: EngineSlot, res: dict[str, Any]) -> None:
        if res["generated_tokens"] != slot.generated or res["completions"]:
            slot.last_progress = time.monotonic()
        slot.generated = res["generated_tokens"]
        self._ready.extend(self._claim(slot, res["completions"]))

    def _claim(self, slot: EngineSlot, recs: list[Completion]) -> list[Completion]:
        """Keeps only records this slot still owns (so a request is returned once), on the driver clock."""
        out = []
        for rec in recs:
            if self._owner.get(rec.request_id) == slot.index:
                del self._owner[rec.request_id]
                out.append(rec.shifted(slot.clock_offset))
        return out

    def _take_ready(self) -> list[Completion]:
        out, self._ready = self._ready, []
        return out

    def _service_starting(self) -> None:
        import ray

        for slot in self.slots:
            if slot.state != "starting":
                continue
            done, _ = ray.wait([slot.start_ref], timeout=0)
            if done:
                try:
                    info = ray.get(slot.start_ref)
                    self._reload([slot])
                    self._finish_start(slot, info)
                except Exception as exc:
                    self._fail(slot, f"restart failed: {type(exc).__name__}: {exc}", restart=False)

    def _check_hung(self) -> None:
        now = time.monotonic()
        busy = set(self._owner.values())
        for slot in self.slots:
            if slot.state == "ready" and slot.index in busy and now - slot.last_progress > self.opts.request_timeout_s:
                self._fail(slot, f"no progress for {now - slot.last_progress:.0f} s")

    def _fail(self, slot: EngineSlot, reason: str, restart: bool | None = None) -> None:
        import ray

        now = time.monotonic()
        lost = [rid for rid, w in self._owner.items() if w == slot.index]
        for rid in lost:
            del self._owner[rid]
            self._ready.append(Completion(rid, slot.index, finish_reason="lost", finish_time=now))
        slot.pending = []
        if slot.actor is not None:
            ray.kill(slot.actor, no_restart=True)
        slot.actor, slot.poll_ref, slot.state = None, None, "dead"
        self._gpu_sync = None  # the GPU transfer group included the dead engine; rebuilt at the next sync
        restart = self.opts.restart_failed if restart is None else restart
        self.events.append({"event": "worker_failed", "time": now, "worker": slot.index, "reason": reason,
                            "lost": len(lost), "restart": restart})
        if restart:
            self._launch(slot)
