"""The trainer's half of weight sync: each pipeline stage's sender pushes its weights to the rollout engines.

    w.push_weights(engines, bucket_bytes=256 << 20)            # a `TrainerWorker` method, on every rank
    w.weight_bucket_plan(bucket_bytes)                          # the NCCL broadcast plan of this stage sender

A mixin of `TrainerWorker` (trainer/worker.py), split out to keep each file readable; it uses the worker's
`module`, `arch`, `use_te`, `pp`, `dtype` and `rank`. The transports themselves are in rollout/weight_sync.py
(CPU, shared memory and Ray) and rollout/weight_sync_gpu.py (NCCL, CUDA IPC); rollout/weight_sync.py's
docstring describes the topology.

Left out: the engines' receiving half (rollout/worker_extension.py).
"""

from __future__ import annotations

import torch


class WeightPushMixin:
    """`push_weights` and the per-stage bucket plans of a trainer rank (see the module docstring)."""

    def push_weights(self, engines: list, bucket_bytes: int, max_buckets_in_flight: int = 2,
                     transport: str = "object_store", nccl: dict | None = None, mode: str = "pipelined") -> dict | None:
        """Sends this pipeline stage's weights to the rollout engine actors `engines`, bucket by bucket.

        The stage sender (TP rank 0 of DP replica 0) packs the stage's gathered tensors into buckets and
        sends each one to every engine; the stage's other TP ranks, and with experts the ranks of its EP
        group (possibly in other DP replicas), only send it their pieces; other ranks return at once. Returns the sender's counts (None elsewhere).
        `transport`: "object_store" (Ray, any device) or "nccl" (GPU; `nccl` carries the rendezvous and the
        broadcast plan, see `rollout.weight_sync_gpu.nccl_send_buckets`). `mode`: "pipelined" (layer-by-layer export,
        `weight_sync.stage_push` / `nccl_send_stage`) or "serial" (the path before, kept for comparison)."""
        from megatron.core import parallel_state as ps

        from megatron_sortedrl.rollout import weight_sync as ws
        from megatron_sortedrl.rollout import weight_sync_gpu as wsg
        from megatron_sortedrl.trainer.stage_export import iter_stage_hf_weights

        tensors = iter_stage_hf_weights(self.module, self.arch, use_te=self.use_te,
                                        order="table" if mode == "serial" else "layer")
        if ps.get_data_parallel_rank() != 0 or ps.get_tensor_model_parallel_rank() != 0:
            for _ in tensors:  # the stage's TP peers (and, with experts, its EP peers) send to the sender
                pass
            return None
        stage = ps.get_pipeline_model_parallel_rank()
        try:
            # One packing buffer for all buckets: ray.put copies it and the NCCL broadcast is waited for.
            if transport == "nccl" and mode == "serial":
                buckets = ws.iter_packed(tensors, bucket_bytes, device="cuda", reuse_buffer=True)
                stats = wsg.nccl_send_buckets(self._nccl_comm(nccl, stage), stage, nccl["plan"], buckets, engines)
            elif transport == "nccl":  # this stage's own group: rank 0 is this sender, then every engine GPU
                ep = nccl["endpoints"][stage]
                comm = self._nccl_comm({"master_address": ep[0], "master_port": ep[1],
                                        "world_size": nccl["stage_world_size"]}, 0)
                stats = wsg.nccl_send_stage(comm, tensors, bucket_bytes)
            elif transport == "ipc":  # colocated on one node: CUDA IPC handles of a GPU bucket
                stats = wsg.ipc_send_stage(engines, tensors, bucket_bytes)
            else:
                stats = ws.stage_push(engines, tensors, bucket_bytes=bucket_bytes,
                                      max_buckets_in_flight=max_buckets_in_flight, mode=mode)
        except BaseException:
            for _ in tensors:  # release the TP peers from their gathers, so the group can still shut down
                pass
            raise
        return {**stats, "stage": stage, "rank": self.rank}

    def weight_bucket_metas(self, bucket_bytes: int) -> list[tuple[int, list]] | None:
        """(bytes, metadata) of every bucket this stage sender will send in the pipelined mode, computed
        without the data (the engines receive a whole NCCL sync in one call; None elsewhere)."""
        from megatron.core import parallel_state as ps

        from megatron_sortedrl.rollout.weight_sync import plan_packed
        from megatron_sortedrl.trainer.stage_export import stage_export_plan
        from megatron_sortedrl.trainer.weights import hf_shapes

        if ps.get_data_parallel_rank() != 0 or ps.get_tensor_model_parallel_rank() != 0:
            return None
        shapes = hf_shapes(self.arch)
        plan = stage_export_plan(self.arch, self.pp, ps.get_pipeline_model_parallel_rank(), use_te=self.use_te)
        return plan_packed([(n, self.dtype, shapes[n]) for _, _, names in plan for n in names], bucket_bytes)

    def nccl_close(self) -> int:
        """Destroys this rank's trainer->engines NCCL communicator, if any (before a new set of engines)."""
        comm, self._nccl, self._nccl_key = getattr(self, "_nccl", None), None, None
        if comm is not None:
            comm.destroy()
        return int(comm is not None)

    def address(self) -> tuple[str, int]:
        """This rank's node address and a free port (a stage sender hosts its own group's rendezvous)."""
        import socket

        import ray

        with socket.socket() as sock:
            sock.bind(("", 0))
            return ray.util.get_node_ip_address(), sock.getsockname()[1]

    def weight_bucket_plan(self, bucket_bytes: int) -> list[int] | None:
        """Byte sizes of the buckets this stage sender will send (the NCCL broadcast plan; None elsewhere)."""
        from megatron.core import parallel_state as ps

        from megatron_sortedrl.rollout.weight_sync import bucket_sizes
        from megatron_sortedrl.trainer.stage_export import stage_export_plan
        from megatron_sortedrl.trainer.weights import hf_shapes

        if ps.get_data_parallel_rank() != 0 or ps.get_tensor_model_parallel_rank() != 0:
            return None
        shapes = hf_shapes(self.arch)
        plan = stage_export_plan(self.arch, self.pp, ps.get_pipeline_model_parallel_rank(), use_te=self.use_te)
        return bucket_sizes((torch.Size(shapes[n]).numel() * self.dtype.itemsize for _, _, names in plan
                             for n in names), bucket_bytes)

    def _nccl_comm(self, nccl: dict, rank: int):
        """This sender's endpoint of the trainer->engines NCCL group, created once per rendezvous; the one
        of an earlier rendezvous (engines since replaced by a relayout) is destroyed first, so a run holds
        one set of communicators however often its layout changes."""
        from vllm.distributed.weight_transfer.nccl_common import stateless_init_process_group

        key = (nccl["master_address"], nccl["master_port"])
        if getattr(self, "_nccl_key", None) != key:
            self.nccl_close()
            self._nccl = stateless_init_process_group(nccl["master_address"], nccl["master_port"], rank,
                                                      nccl["world_size"], device=torch.cuda.current_device())
            self._nccl_key = key
        return self._nccl
