"""The CPU compatibility layer (megatron_sortedrl/trainer/cpu_compat.py).

    pytest tests/test_cpu_compat.py -q        # CPU; runs the checks in a fresh interpreter

The layer changes process-wide torch state, so the checks run in a subprocess and the pytest process is
left untouched. Megatron's rotary embedding (no CPU initialisation) and default causal mask create tensors
with a CUDA device; with the layer active they land on the CPU.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

SCRIPT = textwrap.dedent("""
    import torch
    from megatron_sortedrl.trainer import cpu_compat
    assert cpu_compat.activate() is True and cpu_compat.active()
    assert cpu_compat.activate() is True  # idempotent
    assert torch.cuda.current_device() == 0
    torch.cuda.synchronize()
    for dev in ("cuda", "cuda:0", 0, torch.device("cuda")):
        assert torch.zeros(2, device=dev).device.type == "cpu", dev
    x = torch.ones(3)
    assert x.cuda() is x and x.to("cuda").device.type == "cpu" and x.to(device="cuda").device.type == "cpu"
    assert x.to(torch.float64).dtype == torch.float64  # other .to() calls are untouched
    assert torch.empty_like(x, device="cuda").device.type == "cpu"
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    rope = RotaryEmbedding(kv_channels=8, rotary_percent=1.0, use_cpu_initialization=False)
    assert rope.inv_freq.device.type == "cpu" and rope(5).shape[0] == 5
    from megatron.core.transformer.utils import get_default_causal_mask
    m = get_default_causal_mask(4)
    assert m.device.type == "cpu" and m[0, 1] and not m[1, 0]
    # activation recompute: the checkpoint's RNG save/restore and its recomputing backward (which runs
    # outside the mode's own call) work on the CPU, and give exactly the plain gradients
    from megatron.core import tensor_parallel
    def block(x):
        return torch.tanh(x @ w) * torch.ones(x.shape[-1], device="cuda")  # a CUDA device inside, as Megatron has
    w = torch.randn(4, 4, requires_grad=True)
    x = torch.randn(3, 4, requires_grad=True)
    block(x).square().sum().backward()
    plain = (x.grad.clone(), w.grad.clone())
    x.grad = w.grad = None
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        y = tensor_parallel.checkpoint(block, False, x)
    assert saved == [x.numel()], saved  # only the input is kept; the rest is recomputed
    y.square().sum().backward()
    assert torch.equal(x.grad, plain[0]) and torch.equal(w.grad, plain[1])
    import threading
    seen = []
    t = threading.Thread(target=lambda: seen.append((cpu_compat.active(), cpu_compat.activate(),
                                                     torch.zeros(1, device="cuda").device.type)))
    t.start(); t.join()
    assert seen == [(False, True, "cpu")], seen
    print("OK")
""")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the layer is a no-op with CUDA; tested by the gpu test")
def test_layer_redirects_cuda_to_cpu_in_a_fresh_process():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("OK"), out.stderr[-3000:]


def test_layer_is_inactive_when_cuda_is_available(monkeypatch):
    from megatron_sortedrl.trainer import cpu_compat

    before = cpu_compat.active()  # an earlier in-process Megatron test may have activated it on this thread
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert cpu_compat.needed() is False
    assert cpu_compat.activate() is False and cpu_compat.active() == before  # with CUDA it changes nothing
