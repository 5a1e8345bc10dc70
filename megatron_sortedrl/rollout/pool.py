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
from dataclasses import dataclass, field
from typing import Any

from megatron_sortedrl.rollout.engine_worker import DEFAULT_EXTENSION, EngineWorker, engine_env, engine_kwargs
from megatron_sortedrl.rollout.types import Completion, GenRequest, SyncReport, WorkerLoad
from megatron_sortedrl.rollout.weight_sync import (
    DEFAULT_BUCKET_BYTES,
    GpuWeightSync,
    WeightPusher,
    WeightSource,
    iter_packed,
    iter_source,
    replay,
    rereadable,
    sync_cpu,
    sync_push,
)


class WorkerUnavailable(RuntimeError):
    """A request was sent to a worker slot that died and was not restarted."""


@dataclass
class PoolOptions:
    model_path: str
    device: str = "cpu"  # cpu | gpu (resolved, not "auto")
    num_engines: int = 1
    tp: int = 1
    dtype: str = "float32"
    max_num_seqs: int = 64
    max_model_len: int | None = None
    seed: int = 0
    enforce_eager: bool = True
    gpu_memory_utilization: float = 0.5
    kv_cache_gib: float = 1.0
    speculative_config: dict | None = None
    worker_extension_cls: str = DEFAULT_EXTENSION
    cpus_per_rank: float = 1.0  # Ray CPUs reserved per TP rank on CPU machines
    cpu_bind: str = "spread"  # spread: engine k rank r on core (k*tp+r) % cores; auto: vLLM's NUMA binding
    request_timeout_s: float = 600.0
    poll_wait_s: float = 0.5
    restart_failed: bool = True
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    keep_weights: bool = True  # keep the last synced buckets in Ray's object store for relayout/restart
    # object_store: buckets through Ray + shared memory (any device); nccl | ipc: vLLM's GPU transfer engines
    # (the caller must hold a CUDA device); auto: object_store on CPU, ipc when colocated, else nccl.
    weight_transport: str = "auto"
    # pipelined: stages send at once, layer by layer, bounded shared memory; serial: the path before (to compare)
    weight_sync_mode: str = "pipelined"
    colocate: bool = False
    shared_placement: Any = None  # colocated: the trainer's bundles and GPUs (colocate/placement.SharedPlacement)
    # Placement: with gpus_per_node > 0 on GPU, engine e of TP t sits on layout GPUs first_gpu + e*t onwards,
    # i.e. on the nodes `python -m megatron_sortedrl layout` names; 0 places engines anywhere Ray packs them.
    gpus_per_node: int = 0
    first_gpu: int = 0
    startup_timeout_s: float = 900.0
    engine_extra: dict[str, Any] = field(default_factory=dict)  # more AsyncEngineArgs keywords
    # vLLM executor per engine: auto = uni for a CPU engine of TP 1 (docs/benchmarks/engine_executor.json), else mp
    executor: str = "auto"

    @classmethod
    def from_config(cls, cfg, **overrides: Any) -> PoolOptions:
        """Options from a `RunConfig` (short-round layout); `overrides` replace single fields.

        `max_model_len` is the longest prompt plus the longest response (checked against the model's positions
        when the config was loaded), not the model's `max_position_embeddings`, so a response is only ever cut
        by `max_tokens`; the rope scaling the trainer uses reaches the engines through `hf_overrides`."""
        import json
        from pathlib import Path

        import torch

        from megatron_sortedrl.rope import resolve_rope

        device = cfg.cluster.device
        if device == "auto":
            device = "gpu" if torch.cuda.is_available() else "cpu"
        hf_config = Path(cfg.model.path) / "config.json"
        shape = json.loads(hf_config.read_text()) if hf_config.is_file() else {}
        if shape:
            cfg.validate_context(shape)  # the model directory may have been built or replaced since loading
        rope = resolve_rope(shape, dict(cfg.model.rope_scaling), source=str(hf_config)) if shape else None
        opts = cls(model_path=cfg.model.path, device=device, num_engines=cfg.rollout.num_workers,
                   tp=cfg.rollout.tensor_parallel_size, dtype=cfg.rollout.dtype or cfg.model.dtype, max_num_seqs=cfg.rollout.max_num_seqs,
                   max_model_len=cfg.max_model_len, seed=cfg.seed, enforce_eager=cfg.rollout.enforce_eager,
                   gpu_memory_utilization=cfg.rollout.gpu_memory_utilization, kv_cache_gib=cfg.rollout.kv_cache_gib,
                   speculative_config=speculative_config_from(cfg.speculative),
                   request_timeout_s=cfg.rollout.request_timeout_s, colocate=cfg.cluster.colocate,
                   executor=cfg.rollout.executor)
        from megatron_sortedrl.rollout.engine_worker import capture_routed_experts

        opts.engine_extra.update(capture_routed_experts(cfg.rollout.return_routed_experts, cfg.algorithm.routing_replay,
                                                        shape, device, opts.speculative_config))
        opts.gpus_per_node, opts.first_gpu, opts.startup_timeout_s = engine_placement_from(cfg)
        if rope is not None and rope.hf_overrides():
            opts.engine_extra["hf_overrides"] = rope.hf_overrides()
        for key, value in overrides.items():
            setattr(opts, key, value)
        return opts


def executor_for(choice: str, device: str, tp: int) -> str:
    """The vLLM executor of one engine: `auto` runs a CPU engine of TP 1 in one process (`uni`: 1.22x the
    tokens/s of `mp` on 2 cores, docs/benchmarks/engine_executor.json) and every other engine with a worker
    process per rank (`mp`; GPU engines are unmeasured, so they keep it); `uni` asked for a TP > 1 layout (an
    elastic long round) falls back to `mp`, the only executor that can run it."""
    if choice == "auto":
        return "uni" if device == "cpu" and tp == 1 else "mp"
    return "mp" if tp > 1 else choice


def engine_placement_from(cfg) -> tuple[int, int, float]:
    """(gpus_per_node, first rollout GPU, start-up timeout) of a RunConfig, as the layout plans them."""
    from megatron_sortedrl.layout import rollout_first_gpu

    gpn = cfg.cluster.gpus_per_node
    return gpn, (rollout_first_gpu(cfg) if gpn else 0), cfg.cluster.startup_timeout_s


def speculative_config_from(spec) -> dict | None:
    """vLLM `speculative_config` for a `SpeculativeConfig` section (None when disabled); the mapping is
    HistoSpec's own (`speculative.proposer.vllm_speculative_config`), so there is one definition of it."""
    from speculative.proposer import vllm_speculative_config

    return vllm_speculative_config(spec)


@dataclass
class _Slot:
    index: int
    tp: int
    actor: Any = None
    state: str = "starting"  # starting | ready | dead
    start_ref: Any = None
    poll_ref: Any = None
    pending: list[GenRequest] = field(default_factory=list)  # submitted while starting
    clock_offset: float = 0.0
    pid: int = -1
    generated: int = 0
    last_progress: float = 0.0
    info: dict[str, Any] = field(default_factory=dict)


class RolloutPool:
    def __init__(self, opts: PoolOptions, *, start: bool = True) -> None:
        import ray

        if not ray.is_initialized():
            ray.init(address="local", include_dashboard=False, log_to_driver=True)
        self.opts = opts
        self.version = 0
        self.slots: list[_Slot] = []
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

    def set_layout(self, num_engines: int, tp: int) -> dict[str, float]:
        """Replaces every engine by `num_engines` engines of TP `tp`; needs no request in flight."""
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
        self.slots = [self._launch(_Slot(i, tp)) for i in range(num_engines)]
        try:
            self._wait_started(self.slots)
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

    def _launch(self, slot: _Slot) -> _Slot:
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

    def _wait_started(self, slots: list[_Slot], reload: bool = True) -> None:
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

    def _finish_start(self, slot: _Slot, info: dict[str, Any]) -> None:
        slot.info, slot.pid, slot.state, slot.start_ref = info, info["pid"], "ready", None
        slot.clock_offset = self._clock_offset(slot)
        slot.last_progress = time.monotonic()
        if slot.pending:
            slot.actor.submit.remote(slot.pending)
            slot.pending = []

    @staticmethod
    def _clock_offset(slot: _Slot) -> float:
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

    def _stop(self, slot: _Slot) -> None:
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

    # ----------------------------------------------------------------------------------------- weights
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
        died: list[_Slot] = []
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

    def _sync_to(self, ready: list[_Slot], source: WeightSource | WeightPusher, version: int) -> tuple[SyncReport, Any]:
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

    def _dead(self, slots: list[_Slot]) -> list[_Slot]:
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

    def _reload(self, slots: list[_Slot]) -> None:
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

    def _sync_gpu(self, ready: list[_Slot], source: WeightSource, version: int) -> tuple[SyncReport, list[Any]]:
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
    def _accept(self, slot: _Slot, res: dict[str, Any]) -> None:
        if res["generated_tokens"] != slot.generated or res["completions"]:
            slot.last_progress = time.monotonic()
        slot.generated = res["generated_tokens"]
        self._ready.extend(self._claim(slot, res["completions"]))

    def _claim(self, slot: _Slot, recs: list[Completion]) -> list[Completion]:
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

    def _fail(self, slot: _Slot, reason: str, restart: bool | None = None) -> None:
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
