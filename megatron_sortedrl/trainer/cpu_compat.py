"""Makes megatron-core 0.16 build, run, train and checkpoint on a machine without CUDA.

    from megatron_sortedrl.trainer import cpu_compat
    cpu_compat.activate()          # no-op when CUDA is available; idempotent
    pytest tests/test_cpu_compat.py

Megatron-core assumes a GPU in a handful of places that have nothing to do with the math:
`torch.cuda.current_device()` / `torch.cuda.synchronize()` are called unconditionally, and some tensors
are created with a hard-coded `device="cuda"` (rotary embedding, default causal mask, the pipeline
schedule's token counter, p2p receive buffers, the dist-checkpoint saver's all-reduce). With this layer
active:

* `torch.cuda.current_device()` returns 0 and `torch.cuda.synchronize()` does nothing;
* a `TorchFunctionMode` rewrites every CUDA device argument (`"cuda"`, `"cuda:0"`, `0`,
  `torch.device("cuda")`) of tensor factories, `Tensor.to` and `Tensor.cuda` to the CPU;
* activation recompute works: Megatron's checkpoint saves and restores a stand-in (empty) CUDA RNG
  state instead of asking torch for a CUDA generator, and the backward of every Python autograd
  Function (the recomputed forward, sequence parallelism's gathers and scatters) runs with the device
  redirection active, on whatever thread the autograd engine uses;
* CUDA streams and events are stand-ins that order nothing (CPU work is already in order): the MoE
  all-to-all token dispatcher creates a side stream for its device-to-host copies and waits on its event;
  the split sizes it then passes to `all_to_all_single` stay CPU tensors (the copy to numpy only happens
  for CUDA tensors), which gloo's binding refuses, so they are handed over as lists;
* `seed_model_parallel(seed)` seeds Megatron's RNG tracker with `inference_rng_tracker=True` on CPU
  (that tracker never forks the CUDA generator) and with the normal tracker on GPU.

Everything is process-wide and guarded by `torch.cuda.is_available()`: on a GPU machine `activate()`
returns False and changes nothing. The mode is pushed on the calling thread; `activate()` must be
called again (it is cheap) on any other thread that runs Megatron forward code.

Deliberately left out: anything the distributed optimizer needs (it refuses CPU tensors; the CPU path
uses a plain optimizer, see `optimizer.py`) and fused kernels (the local layer spec needs none).
"""

from __future__ import annotations

import threading

import torch
from torch.overrides import TorchFunctionMode

_lock = threading.Lock()
_patched = False
_local = threading.local()
_CPU = torch.device("cpu")


def needed() -> bool:
    """True when the layer is required (no usable CUDA device)."""
    return not torch.cuda.is_available()


def _is_cuda(device) -> bool:
    if device is None:
        return False
    if isinstance(device, int) and not isinstance(device, bool):
        return True  # a bare ordinal always means a CUDA device in torch
    if isinstance(device, str):
        return device.startswith("cuda")
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return False


class CpuDeviceMode(TorchFunctionMode):
    """Redirects CUDA device arguments to the CPU for every torch call made while it is active."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if "device" in kwargs and _is_cuda(kwargs["device"]):
            kwargs["device"] = _CPU
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], _CPU, *args[2:])
        return func(*args, **kwargs)


def seed_model_parallel(seed: int) -> None:
    """Seeds torch and Megatron's model-parallel RNG tracker (call after the process groups exist)."""
    from megatron.core import tensor_parallel

    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed, inference_rng_tracker=needed(), force_reset_rng=True)


_NO_CUDA_RNG_STATE = torch.empty(0, dtype=torch.uint8)


def _patch_checkpoint_rng() -> None:
    """Activation recompute saves and restores the CUDA generator around each checkpointed forward.

    Megatron's `_get_cuda_rng_state` asks torch for the CUDA generator (fails without CUDA) and
    `_set_cuda_rng_state` queues the restore with `torch.cuda._lazy_call`, which without CUDA would
    append to torch's never-drained queue on every recompute. Without CUDA there is no CUDA generator
    to keep in step: an empty state stands for it and restoring it does nothing. The CPU generator,
    which CPU dropout uses, is still saved and restored by Megatron itself (`torch.get_rng_state`)."""
    from megatron.core.tensor_parallel import random as mrandom

    mrandom._get_cuda_rng_state = lambda *a, **k: _NO_CUDA_RNG_STATE
    mrandom._set_cuda_rng_state = lambda *a, **k: None


def _patch_backward_functions() -> None:
    """Runs the backward of every Python autograd Function with the device redirection active.

    A `TorchFunctionMode` takes itself off the mode stack while it handles a call, and torch routes
    `torch.autograd.backward` through the mode; so the whole backward pass, including Megatron's Python
    autograd Functions (the checkpoint's recomputed forward, sequence parallelism's scatter / gather
    buffers), runs without it and hits the hard-coded CUDA devices. The engine calls these Functions
    through `BackwardCFunction.apply` (and `apply_boxed`), looked up on the class; wrapping them puts a
    fresh mode on the stack of whatever thread the engine uses. Built-in ops' backward are C++ and
    create no CUDA tensors, so they need nothing."""
    from torch.autograd.function import BackwardCFunction

    for name in ("apply", "apply_boxed"):
        original = getattr(BackwardCFunction, name, None)
        if original is None:
            continue

        def redirected(self, *args, _original=original):
            with CpuDeviceMode():
                return _original(self, *args)

        setattr(BackwardCFunction, name, redirected)


class _CpuEvent:
    def synchronize(self) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass


class _CpuStream:
    """A CUDA stream stand-in: on the CPU every operation already runs in program order."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, stream) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None) -> _CpuEvent:
        return event or _CpuEvent()

    def synchronize(self) -> None:
        pass


_DEFAULT_STREAM = _CpuStream()


def _patch_all_to_all() -> None:
    import torch.distributed as dist

    original = dist.all_to_all_single

    def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, *args, **kwargs):
        as_list = (lambda s: s.tolist() if isinstance(s, torch.Tensor) else s)
        return original(output, input, as_list(output_split_sizes), as_list(input_split_sizes), *args, **kwargs)

    dist.all_to_all_single = all_to_all_single


def _patch_streams() -> None:
    import contextlib

    torch.cuda.Stream = _CpuStream  # type: ignore[assignment,misc]
    torch.cuda.Event = lambda *a, **k: _CpuEvent()  # type: ignore[assignment]
    torch.cuda.current_stream = lambda *a, **k: _DEFAULT_STREAM  # type: ignore[assignment]
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()  # type: ignore[assignment]


def activate() -> bool:
    """Activates the layer in this process and thread when CUDA is absent; returns whether it is active."""
    global _patched
    if not needed():
        return False
    with _lock:
        if not _patched:
            torch.cuda.current_device = lambda: 0  # type: ignore[assignment]
            torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]
            _patch_checkpoint_rng()
            _patch_backward_functions()
            _patch_streams()
            _patch_all_to_all()
            _patched = True
    if not getattr(_local, "mode", None):
        _local.mode = CpuDeviceMode()
        _local.mode.__enter__()
    return True


def active() -> bool:
    """True when the layer is active on the calling thread."""
    return bool(getattr(_local, "mode", None))
