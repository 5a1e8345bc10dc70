"""The trainer's state leaves the device while colocated engines generate, and comes back for the update.

    w.offload_state()   # -> {"bytes": ..., "seconds": ..., "tensors": ...}; params, grads, optimizer state to host
    w.reload_state()    # the same bytes back, in the same storages

What moves: every storage behind the policy's parameters (Megatron's DDP param buffer with the distributed
optimizer, else each parameter), its gradient buffers (`main_grad`, views into the DDP grad buffer), the
optimizer's state (Adam moments, fp32 master copies under bf16) and the frozen reference model of the KL term.
Each distinct storage is copied once into a host buffer (pinned memory and non-blocking copies on a GPU) and
then resized to zero bytes and, on a GPU, the caching allocator's blocks are returned (`empty_cache`), so the
device memory really goes for other processes; `reload_state` resizes it back and copies the bytes in. Views (a parameter inside the DDP buffer, `main_grad` inside the grad buffer, the optimizer's
references to parameters) keep pointing at the same storage objects, so nothing has to be rebuilt and
Megatron's hooks stay valid. The host buffers are kept between steps (allocated once: pinning is slow); the
storages are collected again at each offload (a checkpoint load replaces the optimizer's state tensors).

On CPU the same copy runs for real (host to host) and the storages are resized to zero just the same: a
trainer call made while its state is away fails at once on an empty storage instead of training on stale
data, which is what lets CPU tests check the colocated ordering. The bytes and seconds are measured.

Left out: overlapping the copies with other work (each call synchronises before returning), and moving
activations or CUDA graphs (nothing of the trainer's activations outlives a step).
"""

from __future__ import annotations

import time

import torch


def _storages(tensors) -> list[torch.UntypedStorage]:
    """Distinct non-empty storages behind `tensors`, in first-seen order."""
    seen: dict[int, torch.UntypedStorage] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.numel() > 0:
            st = t.untyped_storage()
            if st.nbytes() > 0 and st.data_ptr() not in seen:
                seen[st.data_ptr()] = st
    return list(seen.values())


def _optimizer_tensors(opt) -> list[torch.Tensor]:
    """Every tensor of a Megatron optimizer (chained, mixed precision or plain): state and master params."""
    out: list[torch.Tensor] = []
    for inner in getattr(opt, "chained_optimizers", None) or [opt]:
        torch_opt = getattr(inner, "optimizer", inner)
        for state in getattr(torch_opt, "state", {}).values():
            out.extend(v for v in state.values() if isinstance(v, torch.Tensor))
        for group in getattr(inner, "shard_fp32_from_float16_groups", None) or \
                getattr(inner, "fp32_from_float16_groups", None) or []:
            out.extend(group)
    return out


class HostOffload:
    """Moves a fixed set of storages to host buffers and back (see the module docstring)."""

    def __init__(self, tensors, pin: bool) -> None:
        self.storages = _storages(tensors)
        self.pin = pin
        self.host: list[torch.Tensor] = []
        self.sizes = [st.nbytes() for st in self.storages]
        self.offloaded = False

    @staticmethod
    def _bytes_view(st: torch.UntypedStorage, nbytes: int) -> torch.Tensor:
        return torch.empty(0, dtype=torch.uint8, device=st.device).set_(st, 0, (nbytes,))

    def offload(self) -> dict[str, float]:
        if self.offloaded:
            return {"bytes": 0, "seconds": 0.0, "tensors": 0}
        t0 = time.monotonic()
        if not self.host:
            self.host = [torch.empty(n, dtype=torch.uint8, pin_memory=self.pin) for n in self.sizes]
        for st, host, n in zip(self.storages, self.host, self.sizes):
            host.copy_(self._bytes_view(st, n), non_blocking=self.pin)
        if self.pin:
            torch.cuda.synchronize()  # the copies must land before the device memory is given back
        for st in self.storages:
            st.resize_(0)
        if self.pin:
            # resize_(0) hands the blocks to PyTorch's caching allocator, not to the device: other processes (the
            # colocated engines waking their weights and KV cache, vLLM's start-up check of free memory) see them
            # only once the cache is emptied, as megatron-core's own offload helpers do.
            torch.cuda.empty_cache()
        self.offloaded = True
        return {"bytes": sum(self.sizes), "seconds": time.monotonic() - t0, "tensors": len(self.storages)}

    def reload(self) -> dict[str, float]:
        if not self.offloaded:
            return {"bytes": 0, "seconds": 0.0, "tensors": 0}
        t0 = time.monotonic()
        for st, host, n in zip(self.storages, self.host, self.sizes):
            st.resize_(n)
            self._bytes_view(st, n).copy_(host, non_blocking=self.pin)
        if self.pin:
            torch.cuda.synchronize()
        self.offloaded = False
        return {"bytes": sum(self.sizes), "seconds": time.monotonic() - t0, "tensors": len(self.storages)}


class OffloadMixin:
    """`TrainerWorker`'s offload and reload (collectives in name only: each rank moves its own shard)."""

    _offload: HostOffload | None = None

    def _offload_tensors(self) -> list[torch.Tensor]:
        tensors: list[torch.Tensor] = []
        for p in self.model.parameters():
            tensors.append(p.data)
            if getattr(p, "main_grad", None) is not None:
                tensors.append(p.main_grad)
            if p.grad is not None:
                tensors.append(p.grad)
        for buffer in getattr(self.model, "buffers", None) or []:  # Megatron DDP's param/grad buffers
            tensors.extend(t for t in (getattr(buffer, "param_data", None), getattr(buffer, "grad_data", None))
                           if t is not None)
        tensors.extend(_optimizer_tensors(self.opt))
        if self.ref_model is not None:
            tensors.extend(p.data for p in self.ref_model.parameters())
        return tensors

    def offload_state(self) -> dict[str, float]:
        # The storages are collected anew at every offload: the optimizer's first step creates its state, and
        # loading a checkpoint replaces state tensors; the host buffers are reused while the sizes stay the same.
        if self._offload is not None and self._offload.offloaded:
            return {"bytes": 0, "seconds": 0.0, "tensors": 0}
        fresh = HostOffload(self._offload_tensors(), pin=self.gpu)
        if self._offload is not None and self._offload.sizes == fresh.sizes:
            fresh.host = self._offload.host
        self._offload = fresh
        return _with_device_memory(self._offload.offload(), self.gpu)

    def reload_state(self) -> dict[str, float]:
        out = self._offload.reload() if self._offload is not None else {"bytes": 0, "seconds": 0.0, "tensors": 0}
        return _with_device_memory(out, self.gpu)


def _with_device_memory(out: dict, gpu: bool) -> dict:
    """`out` with this rank's allocated bytes and the device's free bytes (what another process can take: the
    allocator's cached blocks count as used there) on a GPU."""
    if gpu:
        out["device_allocated"] = torch.cuda.memory_allocated()
        out["device_free"] = torch.cuda.mem_get_info()[0]
    return out
