"""GPU weight transports (vLLM's NCCL broadcast and CUDA IPC engines) into a CUDA vLLM rollout engine.

    .venv/bin/python -m pytest tests/test_rollout_gpu.py -q -m gpu      # on a machine with CUDA vLLM

Skipped without a GPU. NCCL needs the trainer and the engine on different GPUs (two or more); IPC runs
with the engine colocated on the trainer's GPU.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs an NVIDIA GPU and CUDA vLLM", allow_module_level=True)

ray = pytest.importorskip("ray")

from megatron_sortedrl.config import TinyModelConfig  # noqa: E402
from megatron_sortedrl.rollout import GenRequest, PoolOptions, RolloutPool  # noqa: E402
from megatron_sortedrl.tiny_model import build_tiny_model  # noqa: E402

PROMPT = [40, 41, 42, 43, 44, 45]


@pytest.mark.parametrize("transport", ["ipc", "nccl"])
def test_gpu_weight_sync_matches_transformers(tmp_path, transport):
    if transport == "nccl" and torch.cuda.device_count() < 2:
        pytest.skip("NCCL transport needs the trainer and the engine on different GPUs")
    from transformers import Qwen2ForCausalLM

    model_dir = build_tiny_model(tmp_path / "tiny", TinyModelConfig())
    ray.init(address="local", include_dashboard=False, ignore_reinit_error=True)
    pool = RolloutPool(PoolOptions(model_path=str(model_dir), device="gpu", max_model_len=512,
                                   gpu_memory_utilization=0.2, weight_transport=transport,
                                   colocate=transport == "ipc", engine_extra={"max_num_batched_tokens": 4096}))
    try:
        model = Qwen2ForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).cuda().eval()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        report = pool.sync_weights(iter(list(model.named_parameters())), version=2)
        assert report.transport == transport and report.bytes > 0
        pool.submit(GenRequest("r", PROMPT, {"max_tokens": 32, "seed": 0, "ignore_eos": True}), worker=0)
        (c,) = list(pool.completions(timeout_s=120))
        with torch.no_grad():
            ids = torch.tensor([PROMPT + c.tokens], device="cuda")
            logp = torch.log_softmax(model(ids).logits[0].double(), -1)
            ref = logp[torch.arange(len(PROMPT) - 1, ids.shape[1] - 1), torch.tensor(c.tokens)].cpu()
        assert c.version_spans == [(0, 2)]
        assert (torch.tensor(c.logprobs, dtype=torch.float64) - ref).abs().max() < 1e-3
    finally:
        pool.shutdown()
        ray.shutdown()
