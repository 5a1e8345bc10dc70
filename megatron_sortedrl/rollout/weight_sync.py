"""Weight sync: full Hugging Face-named tensors from the trainer into every rollout engine, in buckets.

    report = pool.sync_weights(export_hf_weights(model, arch), version=step)        # the usual call
    report = pool.sync_weights("runs/ckpt/hf", version=step)                        # a safetensors directory

The source is what the trainer's exporter yields (`megatron_sortedrl.trainer.weights.export_hf_weights`):
an iterator of (hf_name, full un-sharded tensor) in which TP shards were already gathered and names mapped
through the shared weight table; or a directory of `*.safetensors` files with the same names.

CPU transport (`sync_cpu`, default on machines without CUDA): tensors are grouped into buckets of about
`bucket_bytes`; each bucket is put once into Ray's object store (which moves it between nodes) and every
engine actor loads it into all of its TP ranks through a shared-memory safetensors file and vLLM's
layerwise reload (see `worker_extension`). At most `max_buckets_in_flight` buckets are held at once, so
peak extra memory is bounded; the buckets are returned so the pool can replay them into engines started
later (layout switch, restart) without asking the trainer again.

GPU transports (`GpuWeightSync`, used when the pool's device is gpu and the caller holds a CUDA device):
"nccl" - one NCCL group spans trainer rank 0 and every rollout GPU; each bucket's metadata goes to the
engines through Ray while rank 0 broadcasts the tensors; "ipc" - colocated engines open CUDA IPC handles
of the trainer's tensors. vLLM's built-in weight-transfer engines receive and load them layerwise.
Written against vLLM's `weight_transfer` API and marked for GPU testing (`tests/test_rollout_gpu.py`);
nothing here runs them on CPU, and the object-store path remains the fallback on GPUs.

Deliberately left out: delta/sparse updates, quantised and packed transfer.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from megatron_sortedrl.rollout.types import SyncReport

DEFAULT_BUCKET_BYTES = 256 * 2**20
WeightSource = Iterable[tuple[str, torch.Tensor]] | str | Path


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


def sync_cpu(actors: list[Any], source: WeightSource, version: int, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
             max_buckets_in_flight: int = 2, keep_buckets: bool = True) -> tuple[SyncReport, list[Any]]:
    """Streams `source` into every engine actor; returns the report and the bucket refs (empty unless kept)."""
    import ray

    t0 = time.monotonic()
    ray.get([a.begin_weight_update.remote() for a in actors])
    kept, in_flight = [], []
    n_tensors = n_bytes = n_buckets = 0
    for bucket in iter_buckets(source, bucket_bytes):
        n_tensors += len(bucket)
        n_bytes += bucket_nbytes(bucket)
        n_buckets += 1
        ref = ray.put(bucket)
        del bucket
        in_flight.append([a.load_weight_bucket.remote(ref) for a in actors])
        if keep_buckets:
            kept.append(ref)
        if len(in_flight) >= max_buckets_in_flight:
            _check_counts(ray.get(in_flight.pop(0)))
    for futs in in_flight:
        _check_counts(ray.get(futs))
    ray.get([a.finish_weight_update.remote(version) for a in actors])
    report = SyncReport(version=version, num_tensors=n_tensors, bytes=n_bytes, num_buckets=n_buckets,
                        num_engines=len(actors), seconds=time.monotonic() - t0, transport="object_store+shm")
    return report, kept


def _check_counts(counts: list[int]) -> None:
    if len(set(counts)) > 1:
        raise RuntimeError(f"engines loaded different numbers of tensors from one bucket: {counts}")


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
                from torch.multiprocessing.reductions import reduce_tensor

                uuid = str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)
                info["ipc_handles"] = [{uuid: reduce_tensor(t)[1]} for t in bucket.values()]
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
