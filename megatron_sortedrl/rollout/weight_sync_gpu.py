"""Weight sync over NCCL (GPU only): the stage senders' and the engines' halves, and the single-sender path.

    from megatron_sortedrl.rollout.weight_sync_gpu import nccl_send_stage, receive_schedule

Pipelined (the default mode): every stage sender has its own NCCL group, itself as rank 0 and every engine
GPU after it, so the stages broadcast at the same time; a sender packs into two GPU buffers and broadcasts
back to back on a side stream (`nccl_send_stage`, `DeviceRing`); each engine receives the whole sync in one
call, following `receive_schedule` (pure logic, tested on CPU). Serial (the path before, kept to compare):
one group of all senders and engine GPUs, stage after stage, a Ray call per bucket (`nccl_send_buckets`).
`GpuWeightSync` drives vLLM's own weight-transfer engines for (name, tensor) sources from this process.

Written for GPU testing (`tests/test_weight_sync_gpu.py`, `tests/test_rollout_gpu.py`); only
`receive_order` / `receive_schedule` run on CPU. A colocated hand-off from the stage senders goes over CUDA IPC
(`ipc_send_stage`: one GPU bucket buffer per sender, opened by every engine on its node). Left out: CUDA IPC
across nodes (a colocated run whose trainer spans nodes hands off through the shared-memory path).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from megatron_sortedrl.rollout.types import SyncReport
from megatron_sortedrl.rollout.weight_sync import (
    DEFAULT_BUCKET_BYTES,
    Meta,
    WeightSource,
    check_counts,
    bucket_nbytes,
    iter_buckets,
    iter_packed,
    packed_nbytes,
)


def nccl_ranks(num_senders: int, engine_tps: list[int]) -> tuple[int, list[int]]:
    """World size of the transfer group and each engine's first rank: senders first, then engine GPUs."""
    offsets = [num_senders + sum(engine_tps[:k]) for k in range(len(engine_tps))]
    return num_senders + sum(engine_tps), offsets


def nccl_send_buckets(comm: Any, my_rank: int, plan: list[tuple[int, int]], buckets: Iterator[tuple[torch.Tensor, Meta]],
                      engines: list[Any]) -> dict[str, int]:
    """One stage sender's part of an NCCL sync (GPU only).

    `plan` is every sender's (sender rank, bucket bytes) in broadcast order, the same list on all senders;
    this rank broadcasts its own buckets (first telling the engines what to receive) and joins the others'
    broadcasts with a scratch buffer. `comm` is vLLM's PyNcclCommunicator over senders + engine GPUs."""
    import ray

    stream = torch.cuda.current_stream()
    stats = {"num_tensors": 0, "bytes": 0, "num_buckets": 0}
    for src, nbytes in plan:
        if src == my_rank:
            flat, meta = next(buckets)
            futs = [e.nccl_receive_bucket.remote(src, flat.numel(), meta) for e in engines]
            comm.broadcast(flat, src=src, stream=stream)
            stream.synchronize()
            check_counts(ray.get(futs), meta)
            stats["num_tensors"] += len(meta)
            stats["bytes"] += packed_nbytes(meta)
            stats["num_buckets"] += 1
            del flat
        else:
            scratch = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
            comm.broadcast(scratch, src=src, stream=stream)
            stream.synchronize()
            del scratch
    return stats


class DeviceRing:
    """Two (or `slots`) GPU packing buffers for a stage sender: bucket k+1 is packed while bucket k is still
    being broadcast; a buffer is reused only once the broadcast that read it has finished (GPU only)."""

    def __init__(self, slots: int = 2) -> None:
        self.bufs: list[torch.Tensor | None] = [None] * slots
        self.events: list[Any] = [None] * slots
        self.count, self.last = 0, -1

    def alloc(self, nbytes: int) -> torch.Tensor:
        k = self.last = self.count % len(self.bufs)
        self.count += 1
        if self.events[k] is not None:
            self.events[k].synchronize()  # the broadcast of the bucket that last used this buffer is done
        buf = self.bufs[k]
        if buf is None or buf.numel() < nbytes:
            self.bufs[k] = None
            self.bufs[k] = buf = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        return buf

    def sent(self, event: Any) -> None:
        self.events[self.last] = event


def receive_order(counts: list[int]) -> list[tuple[int, int]]:
    """(stage, bucket) in the order an engine loads a pipelined sync: round robin over the stages."""
    return [(s, k) for k in range(max(counts, default=0)) for s in range(len(counts)) if k < counts[s]]


def receive_schedule(counts: list[int]) -> list[tuple[str, int]]:
    """An engine's ("post", i) / ("load", i) steps for the buckets of `receive_order(counts)` (pure logic; the
    GPU receiver `msrl_nccl_receive_stages` follows it). Each stage's buckets alternate between two buffers;
    a bucket's receive is posted once the bucket that used its buffer before is loaded, in order (each group
    must see its sender's order), so both buffers of every stage are receiving while earlier buckets load:
    the stages' transfers overlap each other and the loads."""
    order = receive_order(counts)
    where = {o: i for i, o in enumerate(order)}
    prev = [where.get((s, k - 2), -1) for s, k in order]
    ahead, steps, nxt = 2 * max(1, len(counts)), [], 0
    for done in range(-1, len(order)):
        if done >= 0:
            steps.append(("load", done))
        while nxt < len(order) and nxt <= done + ahead and prev[nxt] <= done:
            steps.append(("post", nxt))
            nxt += 1
    return steps


def nccl_send_stage(comm: Any, tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> dict[str, int]:
    """One stage sender's part of a pipelined NCCL sync (GPU only; `mode="pipelined"`).

    `comm` is this stage's own group (this sender rank 0, then every engine GPU), so the stages send at the
    same time and no sender takes part in another's broadcasts. The buckets go back to back on a side
    stream with no Ray call in between (the engines receive the whole sync in one call,
    `worker_extension.msrl_nccl_receive_stages`, from the plan `plan_packed` computes); packing bucket k+1
    overlaps the broadcast of bucket k (`DeviceRing`)."""
    ring = DeviceRing(2)
    send = torch.cuda.Stream()
    stats = {"num_tensors": 0, "bytes": 0, "num_buckets": 0}
    for flat, meta in iter_packed(tensors, bucket_bytes, alloc=ring.alloc):
        packed = torch.cuda.Event()
        packed.record()  # packing ran on the current stream
        send.wait_event(packed)
        comm.broadcast(flat, src=0, stream=send)
        done = torch.cuda.Event()
        done.record(send)
        ring.sent(done)
        stats["num_tensors"] += len(meta)
        stats["bytes"] += packed_nbytes(meta)
        stats["num_buckets"] += 1
        del flat
    send.synchronize()
    return stats


def ipc_handle(t: torch.Tensor) -> dict[str, tuple]:
    """{this GPU's uuid: `reduce_tensor`'s arguments} for a CUDA tensor another process opens (GPU only). The
    arguments hold classes and a torch.dtype, which collective_rpc carries only with pickling allowed
    (`engine_worker.engine_env`); the uuid lets the receiver find the device under its own numbering."""
    from torch.multiprocessing.reductions import reduce_tensor

    return {str(torch.cuda.get_device_properties(t.device).uuid): reduce_tensor(t)[1]}


def ipc_send_stage(engines: list[Any], tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> dict[str, int]:
    """One stage sender's part of a colocated hand-off over CUDA IPC (GPU only; `transport="ipc"`).

    Each bucket is packed into one reused GPU buffer of this rank; every engine opens its IPC handle (keyed by
    this GPU's uuid, so an engine finds the device whatever its CUDA_VISIBLE_DEVICES numbering) and loads the
    views on its own device (`worker_extension.msrl_load_ipc`, which copies out what vLLM's layerwise reload
    still holds). The call returns only after every engine has loaded it, so the buffer is reused safely."""
    import ray

    stats = {"num_tensors": 0, "bytes": 0, "num_buckets": 0}
    for flat, meta in iter_packed(tensors, bucket_bytes, device="cuda", reuse_buffer=True):
        torch.cuda.current_stream().synchronize()  # packed before another process reads it
        handle = ipc_handle(flat)
        check_counts(ray.get([e.load_ipc_bucket.remote(handle, flat.numel(), meta) for e in engines]), meta)
        stats["num_tensors"] += len(meta)
        stats["bytes"] += packed_nbytes(meta)
        stats["num_buckets"] += 1
    return stats


class GpuWeightSync:
    """GPU transports through vLLM's built-in weight-transfer engines (GPU only; tests/test_rollout_gpu.py).

    `backend="nccl"`: one NCCL group spans this process (rank 0, the trainer's sender) and every rollout GPU;
    engine k's TP rank r is 1 + (sum of earlier engines' TP) + r. For separate trainer and rollout GPUs.
    `backend="ipc"`: CUDA IPC handles of this process's tensors; for engines colocated on the same GPUs.
    Engines must be built with `engine_kwargs(..., weight_transfer_backend=backend)` (the pool does this).
    """

    def __init__(self, actors: list[Any], tps: list[int], backend: str = "nccl",
                 master_address: str = "", master_port: int = 0) -> None:
        if backend not in ("nccl", "ipc"):
            raise ValueError(f"GPU weight transport {backend!r}: expected nccl or ipc")
        self.actors, self.tps, self.backend = actors, tps, backend
        self.master_address, self.master_port = master_address, master_port
        self.group: Any = None
        self.connected = False

    def close(self) -> None:
        """Destroys this process's end of the NCCL group (before the engines are replaced)."""
        if self.group is not None and hasattr(self.group, "destroy"):
            self.group.destroy()
        self.group, self.connected = None, False

    def connect(self) -> None:
        import ray

        if self.backend == "ipc":
            ray.get([a.transfer_init.remote({"packed": False}) for a in self.actors])
        else:
            from vllm.distributed.weight_transfer.nccl_common import trainer_init

            world = 1 + sum(self.tps)
            offsets = [1 + sum(self.tps[:k]) for k in range(len(self.tps))]
            # Both sides block in the rendezvous, so the engines' half is started before the trainer's.
            futs = [a.transfer_init.remote({"master_address": self.master_address, "master_port": self.master_port,
                                            "rank_offset": off, "world_size": world, "packed": False})
                    for a, off in zip(self.actors, offsets)]
            self.group = trainer_init({"master_address": self.master_address, "master_port": self.master_port,
                                       "world_size": world}, rank=0)
            ray.get(futs)
        self.connected = True

    def sync(self, source: WeightSource, version: int, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> SyncReport:
        import ray

        if not self.connected:
            self.connect()
        t0 = time.monotonic()
        ray.get([a.transfer_start.remote() for a in self.actors])
        n_tensors = n_bytes = n_buckets = 0
        for bucket in iter_buckets(source, bucket_bytes, device="cuda"):
            info: dict[str, Any] = {"names": list(bucket), "shapes": [list(t.shape) for t in bucket.values()],
                                    "dtype_names": [str(t.dtype).split(".")[-1] for t in bucket.values()]}
            if self.backend == "ipc":
                info["ipc_handles"] = [ipc_handle(t) for t in bucket.values()]
                ray.get([a.transfer_update.remote(info) for a in self.actors])  # bucket stays alive until here
            else:
                futs = [a.transfer_update.remote(info) for a in self.actors]  # receivers enter the broadcasts
                stream = torch.cuda.current_stream()
                for t in bucket.values():
                    self.group.broadcast(t, src=0, stream=stream)
                stream.synchronize()
                ray.get(futs)
            n_tensors += len(bucket)
            n_bytes += bucket_nbytes(bucket)
            n_buckets += 1
        ray.get([a.transfer_finish.remote(version) for a in self.actors])
        return SyncReport(version=version, num_tensors=n_tensors, bytes=n_bytes, num_buckets=n_buckets,
                          num_engines=len(self.actors), seconds=time.monotonic() - t0, transport=self.backend)
