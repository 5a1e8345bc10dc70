"""Weight sync: Hugging Face-named tensors from the trainer into every rollout engine, in packed buckets.

    report = pool.sync_weights(trainer_group, version=step)       # the usual call: the trainer pushes
    report = pool.sync_weights(iter(state.items()), version=step) # (name, tensor) pairs from this process
    report = pool.sync_weights("runs/ckpt/hf", version=step)      # a safetensors directory

Topology (the usual call). The source is a `WeightPusher` (`trainer.group.TrainerGroup`): the pool
pauses the engines (`begin_weight_update`), hands the engine actor handles to the trainer, and finishes
with the version. Inside the trainer one *sender per pipeline stage* (TP rank 0 of DP replica 0) gathers
its stage's TP shards tensor by tensor, layer by layer (`trainer.weights.export_order`: every tensor of a
layer together, so vLLM's layerwise reload waits on at most one layer per sender), packs them into buckets
and sends each bucket straight to every engine; all stages send at the same time. No process, the driver
included, ever holds the whole model. `mode="serial"` (`SYNC_MODES`) keeps the path before for
comparison: the weight table's order (every layer's q/k/v weights before any bias), buckets through Ray's
object store, and on GPU one group for all senders, bucket after bucket.

Packed buckets. A bucket is one flat contiguous uint8 buffer plus a small metadata list of
`(name, dtype, shape, offset)` (`pack_tensors` / `unpack_tensors`); offsets are 64-byte aligned so every
tensor is a zero-copy view of the buffer. One call per bucket per engine, not per tensor. `plan_packed`
computes the metadata from shapes alone (what an NCCL receiver is told before anything moves).

CPU transport (`stage_push`). Engines on the sender's node: the sender packs each bucket straight into a
slot of a `ShmRing` (two shared-memory files, reused round robin) and calls `load_shm_bucket(path, meta)`;
every vLLM worker of the engine memory-maps the slot and loads the views through vLLM's layerwise reload
(`worker_extension.WeightSyncExtension.msrl_load_packed`), copying out whatever the reload still holds of
the slot. The sender waits for a slot's loads right before packing into it again, so bucket k+1 packs
while bucket k loads and shared memory holds at most two buckets per sender. Engines on other nodes: each
bucket is put once into Ray's object store (which moves it between nodes), at most `max_buckets_in_flight`
(2) at once; the engine actor writes it to a shared-memory file the workers map (`push_packed`).

GPU transport (NCCL, pipelined). Every stage sender has its own NCCL group (the sender rank 0, then every
engine GPU), so the stages broadcast at once; the senders pack into two GPU buffers and broadcast back to
back on a side stream (`nccl_send_stage`); each engine receives the whole sync in one call, round robin
over the stages on one stream per stage into two buffers per stage, loading while the next buckets arrive
(`receive_schedule`; `worker_extension.msrl_nccl_receive_stages`). Serial: one group spans the stage
senders (ranks 0..S-1) and every engine GPU (ranks S..); buckets are broadcast stage after stage, each
announced by a Ray call (`nccl_send_buckets`). `GpuWeightSync` keeps the single-sender path (this process
is rank 0) for (name, tensor) sources. The GPU half lives in `weight_sync_gpu.py`, which builds on this file
(never the other way round): import its names from there. Written for GPU testing (`tests/test_weight_sync_gpu.py`,
`tests/test_rollout_gpu.py`).

Deliberately left out: delta/sparse updates, quantised transfer, CUDA IPC for colocated engines in the
multi-sender topology (the single-sender `ipc` path remains for (name, tensor) sources).
"""

from __future__ import annotations

import os
import tempfile
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, Protocol

import torch

from megatron_sortedrl.rollout.types import SyncReport

DEFAULT_BUCKET_BYTES = 256 * 2**20
WeightSource = Iterable[tuple[str, torch.Tensor]] | str | Path


def rereadable(source: Any) -> bool:
    """Whether a sync from `source` can be done again: the trainer, a directory, a list (not an iterator)."""
    return hasattr(source, "push_weights") or isinstance(source, (str, os.PathLike, list, tuple))


def iter_source(source: WeightSource) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs from an iterator or from every `*.safetensors` file of a directory (sorted)."""
    if isinstance(source, (str, Path)):
        from safetensors import safe_open

        files = sorted(Path(source).glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors files in {source}")
        for path in files:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
    else:
        yield from source


def iter_buckets(source: WeightSource, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 device: str = "cpu") -> Iterator[dict[str, torch.Tensor]]:
    """Groups (name, tensor) pairs into dicts of about `bucket_bytes` (a larger tensor gets its own bucket).

    Tensors are detached, moved to `device` (host memory by default; "cuda" for NCCL, which sends from
    device memory) and made contiguous: the trainer may reuse its buffers once the next pair is requested. A repeated name is an error (it would load twice, the last one winning).
    """
    bucket: dict[str, torch.Tensor] = {}
    size, seen = 0, set()
    for name, tensor in iter_source(source):
        if name in seen:
            raise ValueError(f"weight {name!r} appears twice in the sync source")
        seen.add(name)
        t = tensor.detach().to(device).contiguous()
        nbytes = t.numel() * t.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = {}, 0
        bucket[name] = t
        size += nbytes
    if bucket:
        yield bucket


def bucket_nbytes(bucket: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in bucket.values())


ALIGN = 64  # bytes; every tensor of a packed bucket starts at a multiple of this (any dtype's alignment)
Meta = list[tuple[str, str, list[int], int]]  # (name, dtype name, shape, byte offset) per tensor of a bucket


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"packed bucket names an unknown dtype {name!r}")
    return dt


def _place(used: int, cap: int, nbytes: int, bucket_bytes: int) -> tuple[bool, int, int]:
    """Where the next tensor of `nbytes` goes: (starts a new bucket, byte offset, bucket capacity)."""
    if cap and _align(used) + nbytes <= cap:
        return False, _align(used), cap
    return True, 0, max(bucket_bytes, nbytes)


def bucket_sizes(nbytes: Iterable[int], bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> list[int]:
    """Byte sizes of the buckets `iter_packed` makes from tensors of these sizes (a plan without the data)."""
    sizes: list[int] = []
    used = cap = 0
    for n in nbytes:
        new, off, cap = _place(used, cap, n, bucket_bytes)
        if new:
            sizes.append(0)
        used = off + n
        sizes[-1] = used
    return sizes


def plan_packed(entries: Iterable[tuple[str, torch.dtype, Iterable[int]]], bucket_bytes: int = DEFAULT_BUCKET_BYTES
                ) -> list[tuple[int, Meta]]:
    """(bytes, metadata) of every bucket `iter_packed` makes from tensors of these names, dtypes and shapes,
    without the data: what an NCCL receiver allocates and loads, known before anything is sent."""
    out: list[tuple[int, Meta]] = []
    used = cap = 0
    for name, dtype, shape in entries:
        shape = [int(d) for d in shape]
        nbytes = dtype.itemsize * int(torch.Size(shape).numel())
        new, off, cap = _place(used, cap, nbytes, bucket_bytes)
        if new:
            out.append((0, []))
        used = off + nbytes
        out[-1] = (used, out[-1][1] + [(name, str(dtype).removeprefix("torch."), shape, off)])
    return out


def iter_packed(source: WeightSource, bucket_bytes: int = DEFAULT_BUCKET_BYTES, device: str = "cpu",
                reuse_buffer: bool = False, alloc: Callable[[int], torch.Tensor] | None = None
                ) -> Iterator[tuple[torch.Tensor, Meta]]:
    """Packs (name, tensor) pairs into (flat uint8 buffer, metadata) buckets of at most `bucket_bytes`.

    Each tensor is copied into the bucket's buffer as soon as it arrives, so the caller may free it (the
    trainer's gathered tensor) before the next one is produced; a tensor larger than `bucket_bytes` gets a
    bucket of its own. A repeated name is an error (it would load twice, the last one winning).

    `reuse_buffer`: every bucket is packed into the same buffer (grown when a larger one is needed), so
    the caller must be done with a bucket before asking for the next one (`ray.put` copies; an NCCL
    broadcast is waited for). It saves an allocation per bucket, which otherwise fragments the heap.

    `alloc(capacity)`: where each bucket is packed (a flat uint8 tensor of at least `capacity` bytes), called
    once per bucket after the previous bucket was yielded, e.g. the next slot of a `ShmRing`."""
    buf: torch.Tensor | None = None
    meta: Meta = []
    used = cap = 0
    seen: set[str] = set()
    for name, tensor in iter_source(source):
        if name in seen:
            raise ValueError(f"weight {name!r} appears twice in the sync source")
        seen.add(name)
        t = tensor.detach()
        nbytes = t.numel() * t.element_size()
        new, off, cap = _place(used, cap, nbytes, bucket_bytes)
        if new:
            if buf is not None:
                yield buf[:used], meta
            meta = []
            if alloc is not None:
                buf = None
                buf = alloc(cap)
            elif not (reuse_buffer and buf is not None and buf.numel() >= cap):
                buf = None  # freed before the next allocation
                buf = torch.empty(cap, dtype=torch.uint8, device=device)
        assert buf is not None
        if nbytes:
            buf[off:off + nbytes].view(t.dtype).view(t.shape).copy_(t)
        meta.append((name, str(t.dtype).removeprefix("torch."), list(t.shape), off))
        used = off + nbytes
        del tensor, t  # before the next is produced: a trainer sender's full tensor is freed, not held twice
    if buf is not None:
        yield buf[:used], meta


def unpack_tensors(flat: torch.Tensor, meta: Meta) -> list[tuple[str, torch.Tensor]]:
    """Views of the tensors of a packed bucket (no copy)."""
    out = []
    for name, dtype, shape, off in meta:
        dt = _dtype(dtype)
        n = dt.itemsize
        for d in shape:
            n *= d
        out.append((name, flat[off:off + n].view(dt).view(shape)))
    return out


def packed_nbytes(meta: Meta) -> int:
    """Tensor bytes of a bucket (without alignment padding)."""
    return sum(_dtype(d).itemsize * int(torch.Size(s).numel()) for _, d, s, _ in meta)


class WeightPusher(Protocol):
    """A source that sends its weights to the engines itself (the trainer group: one sender per stage)."""

    def push_weights(self, engines: list[Any], *, bucket_bytes: int, max_buckets_in_flight: int,
                     transport: str = "object_store", nccl: dict | None = None,
                     mode: str = "pipelined") -> dict[str, Any]: ...

    @property
    def weights_epoch(self) -> int: ...


def push_packed(engines: list[Any], buckets: Iterable[tuple[torch.Tensor, Meta]], *, max_buckets_in_flight: int = 2,
                keep: bool = False) -> tuple[dict[str, int], list[tuple[Any, Meta]]]:
    """Sends packed buckets to engine actors through Ray's object store, at most `max_buckets_in_flight` at once.

    Runs wherever the buckets are made (a trainer stage sender, or the driver for (name, tensor) sources).
    Each buffer is put once; every engine reads it zero-copy. Unless `keep`, the ref is dropped as soon as
    all engines have loaded the bucket, which frees the object. Returns counts and the kept (ref, meta)."""
    import ray

    in_flight: list[tuple[list[Any], Meta]] = []
    kept: list[tuple[Any, Meta]] = []
    stats = {"num_tensors": 0, "bytes": 0, "num_buckets": 0}
    for flat, meta in buckets:
        stats["num_tensors"] += len(meta)
        stats["bytes"] += packed_nbytes(meta)
        stats["num_buckets"] += 1
        ref = ray.put(flat.numpy())
        del flat  # the object store holds the only copy now
        in_flight.append(([e.load_packed_bucket.remote(ref, meta) for e in engines], meta))
        if keep:
            kept.append((ref, meta))
        del ref
        while len(in_flight) >= max_buckets_in_flight:
            futs, sent = in_flight.pop(0)
            check_counts(ray.get(futs), sent)
    for futs, sent in in_flight:
        check_counts(ray.get(futs), sent)
    return stats, kept


SYNC_MODES = ("pipelined", "serial")


class ShmRing:
    """A few shared-memory files one stage sender packs its buckets into, reused round robin (CPU, one node).

    The engines' vLLM workers memory-map the slot a bucket was packed into and load from it; the sender
    packs the next bucket into the next slot meanwhile, and reuses a slot only after every engine has
    loaded the bucket in it (`push_ring`), so shared memory holds at most `slots` buckets per sender,
    whatever the model's size. `peak_bytes` is the most the files held at once. `close` removes them."""

    def __init__(self, slots: int = 2) -> None:
        shm = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        base = f"msrl-sync-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self.paths = [os.path.join(shm, f"{base}-{k}.bin") for k in range(max(1, slots))]
        self.sizes = [0] * len(self.paths)
        self.count, self.last, self.peak_bytes = 0, -1, 0

    def alloc(self, nbytes: int) -> torch.Tensor:
        """The next slot, at least `nbytes` long, as a flat uint8 tensor mapped from its file."""
        k = self.last = self.count % len(self.paths)
        self.count += 1
        if self.sizes[k] < nbytes:
            with open(self.paths[k], "ab") as f:
                f.truncate(nbytes)
            self.sizes[k] = nbytes
        self.peak_bytes = max(self.peak_bytes, sum(self.sizes))
        return torch.from_file(self.paths[k], shared=True, size=self.sizes[k], dtype=torch.uint8)

    def close(self) -> None:
        for path in self.paths:
            if os.path.exists(path):
                os.unlink(path)


def push_ring(engines: list[Any], buckets: Iterable[tuple[torch.Tensor, Meta]], ring: ShmRing) -> dict[str, int]:
    """Sends buckets packed into `ring`'s slots (`iter_packed(..., alloc=ring.alloc)`) to engine actors on this
    node: one `load_shm_bucket` call per bucket per engine, no copy on the way. The wait for a slot's loads
    comes right before the next bucket is packed into it, so packing overlaps the engines' loads."""
    import ray

    pending: deque[tuple[list[Any], Meta]] = deque()
    stats = {"num_tensors": 0, "bytes": 0, "num_buckets": 0}
    for flat, meta in buckets:
        stats["num_tensors"] += len(meta)
        stats["bytes"] += packed_nbytes(meta)
        stats["num_buckets"] += 1
        pending.append(([e.load_shm_bucket.remote(ring.paths[ring.last], flat.numel(), meta) for e in engines], meta))
        del flat
        while len(pending) >= len(ring.paths):  # the next bucket goes into the oldest slot
            futs, sent = pending.popleft()
            check_counts(ray.get(futs), sent)
    for futs, sent in pending:
        check_counts(ray.get(futs), sent)
    return {**stats, "shm_peak_bytes": ring.peak_bytes}


def stage_push(engines: list[Any], tensors: Iterable[tuple[str, torch.Tensor]], *, bucket_bytes: int,
               max_buckets_in_flight: int = 2, mode: str = "pipelined") -> dict[str, int]:
    """A stage sender's push over the CPU path (any device's tensors; buckets in host memory).

    `pipelined`: engines on this node get the buckets through a `ShmRing` of `max_buckets_in_flight` slots
    (no object store, no copy in the engine actor; shared memory bounded by the slots); engines elsewhere
    through Ray's object store as below. `serial`: the path before, kept to compare: every bucket is put
    into the object store and each engine actor writes it to a /dev/shm file of its own."""
    if mode not in SYNC_MODES:
        raise ValueError(f"weight sync mode {mode!r}: expected one of {SYNC_MODES}")
    if mode == "pipelined" and engines and _all_local(engines):
        ring = ShmRing(max(2, max_buckets_in_flight))
        try:
            return push_ring(engines, iter_packed(tensors, bucket_bytes, alloc=ring.alloc), ring)
        finally:
            ring.close()
    stats, _ = push_packed(engines, iter_packed(tensors, bucket_bytes, reuse_buffer=True),
                           max_buckets_in_flight=max_buckets_in_flight)
    return stats


def _all_local(engines: list[Any]) -> bool:
    """Whether every engine actor runs on this process's node (shared memory reaches it)."""
    import ray

    from megatron_sortedrl.placement import node_id

    try:
        return set(ray.get([e.node_id.remote() for e in engines])) == {node_id()}
    except (AttributeError, ray.exceptions.RayError):
        return False  # an engine without the method: the object store reaches anything


def sync_cpu(actors: list[Any], source: WeightSource, version: int, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
             max_buckets_in_flight: int = 2, keep_buckets: bool = False) -> tuple[SyncReport, list[tuple[Any, Meta]]]:
    """Streams a (name, tensor) or directory source from this process into every engine actor.

    Returns the report and, with `keep_buckets`, the packed (ref, meta) buckets for a later `replay`."""
    import ray

    t0 = time.monotonic()
    ray.get([a.begin_weight_update.remote() for a in actors])
    stats, kept = push_packed(actors, iter_packed(source, bucket_bytes), max_buckets_in_flight=max_buckets_in_flight,
                              keep=keep_buckets)
    ray.get([a.finish_weight_update.remote(version) for a in actors])
    return SyncReport(version=version, num_engines=len(actors), seconds=time.monotonic() - t0,
                      transport="object_store+shm", **stats), kept


def sync_push(actors: list[Any], pusher: WeightPusher, version: int, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
              max_buckets_in_flight: int = 2, transport: str = "object_store", nccl: dict | None = None,
              mode: str = "pipelined") -> SyncReport:
    """The driver's part of a sync: pause and prepare the engines, let the trainer's stage senders push, finish.

    The driver never touches a tensor. `nccl` (GPU): {"master_address", "master_port"} for the transfer
    group the senders and engines form. `mode`: `SYNC_MODES` ("serial" is the path before, kept to compare)."""
    import ray

    t0 = time.monotonic()
    ray.get([a.begin_weight_update.remote() for a in actors])
    stats = pusher.push_weights(actors, bucket_bytes=bucket_bytes, max_buckets_in_flight=max_buckets_in_flight,
                                transport=transport, nccl=nccl, mode=mode)
    ray.get([a.finish_weight_update.remote(version) for a in actors])
    senders = stats.get("senders", [])
    shm = any("shm_peak_bytes" in o for o in senders)
    return SyncReport(version=version, num_tensors=stats["num_tensors"], bytes=stats["bytes"],
                      num_buckets=stats["num_buckets"], num_engines=len(actors), seconds=time.monotonic() - t0,
                      transport=("shm" if shm else "object_store+shm") if transport == "object_store" else transport,
                      mode=mode, shm_peak_bytes=sum(o.get("shm_peak_bytes", 0) for o in senders))


def replay(actors: list[Any], kept: list[tuple[Any, Meta]], version: int) -> None:
    """Loads buckets kept by an earlier `sync_cpu(..., keep_buckets=True)` into (new) engine actors."""
    import ray

    ray.get([a.begin_weight_update.remote() for a in actors])
    for ref, meta in kept:
        check_counts(ray.get([a.load_packed_bucket.remote(ref, meta) for a in actors]), meta)
    ray.get([a.finish_weight_update.remote(version) for a in actors])


def check_counts(counts: list[int], meta: Meta) -> None:
    """Raises unless every engine loaded every tensor of the bucket (what each transport checks after a bucket)."""
    if any(c != len(meta) for c in counts):
        raise RuntimeError(f"engines loaded {counts} tensors from one bucket of {len(meta)}")

