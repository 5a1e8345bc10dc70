"""Measures the bytes a real Megatron forward pass saves for backward, to check the planner's `local` model.

    from megatron_sortedrl.plan.measure_activations import measure
    measure(arch, seq_len=256, dtype="bfloat16", tp=2, recompute="full")   # -> {"bytes": ..., "by_module": {...}}
    measure_cells(arch, [dict(seq_len=64), dict(seq_len=64, recompute="selective")], tp=1)
    python benchmarks/plan_vs_measured.py                                   # the full grid, JSON + Markdown

The model is built exactly as the CPU trainer builds it (`trainer/model.py build_model`, local spec, the
CPU compatibility layer active, gloo process groups; TP > 1 runs one spawned process per rank). One forward
of the model chunk (embedding, layers, final norm, output layer; no loss) runs in training mode under
`torch.autograd.graph.saved_tensors_hooks`; every tensor autograd keeps is counted by its storage, once
(views of one storage, such as q/k/v split from the fused qkv output, share it), parameters excluded.
Recompute's checkpoints save their inputs through the same hooks, and the forward inside a checkpoint
runs without grad, so the count is what recompute really keeps.

The same run also reports `peak`: the most heap memory in use at any op boundary of the forward and
backward (glibc's `mallinfo2`, read after every op by a TorchDispatchMode; parameter gradients allocated
beforehand, caches warmed by one untimed step), minus the model output. That is the activations, the
recompute transient and the backward working set together, the part of a stage's peak the planner
estimates rather than counts exactly (the output and its gradient are left out: the planner counts them
as `logits`). `peak` is None where glibc's mallinfo2 is missing.

Deliberately left out: the loss / log-prob path, temporaries that live only inside one op, and on GPU
anything the caching allocator adds; `make gpu-check` measures the real peak.
"""

from __future__ import annotations

import ctypes
import inspect
import os
import socket
from collections import defaultdict
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                               "fsmblks", "uordblks", "fordblks", "keepcost")]


def _heap_reader():
    """A function returning the bytes glibc's malloc has handed out (main arena + mmapped), or None."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
    except (OSError, AttributeError):
        return None

    def used() -> int:
        info = libc.mallinfo2()
        return info.uordblks + info.hblkhd
    return used


class _PeakHeap(TorchDispatchMode):
    """Reads the heap after every op (on this thread; the CPU autograd engine runs backward here too)."""

    def __init__(self, used):
        super().__init__()
        self.used, self.peak = used, used()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.peak = max(self.peak, self.used())
        return out


@dataclass
class Recompute:
    """Stand-in for config.RecomputeConfig (same attributes) so a measurement needs no run config."""

    granularity: str = "none"
    method: str = "uniform"
    num_layers: int = 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _build(arch, dtype: torch.dtype, sequence_parallel: bool, recompute: Recompute):
    from megatron_sortedrl.trainer import model as model_mod

    if "recompute" in inspect.signature(model_mod.build_model).parameters:
        return model_mod.build_model(arch, dtype, use_te=False, sequence_parallel=sequence_parallel,
                                     recompute=recompute)
    if recompute.granularity != "none":  # a trainer without recompute support: nothing to measure
        raise RuntimeError("this trainer's build_model takes no recompute settings")
    return model_mod.build_model(arch, dtype, use_te=False, sequence_parallel=sequence_parallel)


def _measure_here(arch, seq_len: int, rows: int, dtype: str, sequence_parallel: bool, recompute: Recompute) -> dict:
    """Runs in a process whose default process group is up; returns this rank's saved bytes."""
    from megatron.core import parallel_state as ps

    model = _build(arch, getattr(torch, dtype), sequence_parallel, recompute)
    model.train()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}
    by_module: dict[str, int] = defaultdict(int)
    stack = ["(model)"]

    def pre(name):
        def hook(_mod, _inp):
            stack.append(name)
        return hook

    def post(_mod, _inp, _out):
        stack.pop()

    handles = []
    for name, mod in model.named_modules():
        # group by the layer's direct children (norms, attention, mlp) and the model's edges
        depth = name.split(".")
        if name and (len(depth) <= 1 or (depth[0] == "decoder" and len(depth) == 2) or
                     (depth[0] == "decoder" and depth[1] == "layers" and len(depth) == 4)):
            handles.append(mod.register_forward_pre_hook(pre(name)))
            handles.append(mod.register_forward_hook(post))

    def pack(t: torch.Tensor):
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in params and ptr not in seen:
            seen[ptr] = storage.nbytes()
            parts = stack[-1].split(".")
            # decoder.layers.3.mlp -> layer.mlp, so every layer's rows add up under one key
            key = "layer." + parts[3] if parts[:2] == ["decoder", "layers"] and len(parts) > 3 else stack[-1]
            by_module[key] += storage.nbytes()
        return t

    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, arch.vocab_size, (rows, seq_len), generator=g)
    position_ids = torch.arange(seq_len).unsqueeze(0).expand(rows, -1).contiguous()
    # one untimed step: lazily built buffers and caches are not activations
    model(tokens, position_ids, None).float().sum().backward()
    for p in model.parameters():  # gradients exist before the measured step, as Megatron's grad buffers do
        p.grad.zero_()
    import gc

    gc.collect()
    used = _heap_reader()
    base = used() if used else 0
    peak_mode = _PeakHeap(used) if used else None
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        if peak_mode:
            with peak_mode:
                out = model(tokens, position_ids, None)
        else:
            out = model(tokens, position_ids, None)
    for h in handles:
        h.remove()
    # backward after the count (the output's graph holds the saved tensors until then); it also exercises
    # recompute's backward path, so a failure there is a failed measurement
    if peak_mode:
        with peak_mode:
            out.float().sum().backward()
    else:
        out.float().sum().backward()
    # the output and its gradient belong to the loss path, which the planner counts as `logits`
    peak = peak_mode.peak - base - 2 * out.untyped_storage().nbytes() if peak_mode else None
    return {"bytes": sum(seen.values()), "by_module": dict(by_module), "tp_rank": ps.get_tensor_model_parallel_rank(),
            "params": sum(p.numel() for p in model.parameters()), "peak": peak}


def _worker(rank: int, world: int, port: int, arch, cells: list[dict], queue) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_sortedrl.trainer import cpu_compat

    torch.set_num_threads(1)
    cpu_compat.activate()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        ps.initialize_model_parallel(world, 1)
        results = []
        for cell in cells:
            cpu_compat.seed_model_parallel(0)
            rc = Recompute(cell.get("recompute", "none"), cell.get("recompute_method", "uniform"),
                           cell.get("recompute_num_layers", 1))
            res = _measure_here(arch, cell["seq_len"], cell.get("rows", 1), cell.get("dtype", "float32"),
                                cell.get("sequence_parallel", False), rc)
            results.append({**cell, **res, "tp": world})
        if rank == 0:
            queue.put(results)
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()


def measure_cells(arch, cells: list[dict], *, tp: int = 1) -> list[dict]:
    """Measures several cells in one set of `tp` fresh processes (start-up dominates on a small CPU).

    A cell is a dict with seq_len and optionally rows, dtype, sequence_parallel, recompute,
    recompute_method, recompute_num_layers; each result is the cell plus "bytes" and "by_module" of TP
    rank 0 (all TP ranks of the local spec save the same amount), "params", its parameter count, and
    "peak", the heap peak of forward + backward less the output and its gradient (module docstring)."""
    import torch.multiprocessing as mp

    queue = mp.get_context("spawn").SimpleQueue()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.start_processes(_worker, args=(tp, _free_port(), arch, list(cells), queue), nprocs=tp, join=True,
                       start_method="spawn")
    return queue.get()


def measure(arch, *, seq_len: int, tp: int = 1, **cell) -> dict:
    """One cell (see `measure_cells`)."""
    return measure_cells(arch, [dict(seq_len=seq_len, **cell)], tp=tp)[0]
