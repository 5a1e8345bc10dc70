"""Routed experts from a CUDA vLLM engine: a tiny Qwen3-MoE generates, and the routes it returns for every input
position equal the top-k of transformers' router logits on the same tokens.

    .venv/bin/python -m pytest tests/test_routed_experts_gpu.py -q -m gpu      # on a machine with CUDA vLLM

Skipped without a GPU (CPU engines capture in the worker extension instead: tests/test_route_capture.py).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs an NVIDIA GPU and CUDA vLLM", allow_module_level=True)

ray = pytest.importorskip("ray")

from moe_support import LAYERS, TOPK, agreement, build_tiny_moe, hf_routes  # noqa: E402

from megatron_sortedrl.rollout import GenRequest, PoolOptions, RolloutPool  # noqa: E402

PROMPT = [40, 41, 42, 43, 44, 45]


def test_engine_routes_match_the_hf_router(tmp_path):
    from transformers import Qwen3MoeForCausalLM

    model_dir = build_tiny_moe(tmp_path / "tiny_moe")
    ray.init(address="local", include_dashboard=False, ignore_reinit_error=True)
    pool = RolloutPool(PoolOptions(model_path=str(model_dir), device="gpu", max_model_len=512,
                                   gpu_memory_utilization=0.2,
                                   engine_extra={"enable_return_routed_experts": True, "enable_prefix_caching": True}))
    try:
        pool.submit(GenRequest("r", PROMPT, {"max_tokens": 24, "seed": 0, "ignore_eos": True}), worker=0)
        (c,) = list(pool.completions(timeout_s=180))
        assert c.routed_experts is not None
        assert c.routed_experts.array().shape == (len(PROMPT) + len(c.tokens) - 1, LAYERS, TOPK)
        model = Qwen3MoeForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).cuda().eval()
        same = agreement(c.routed_experts, hf_routes(model, PROMPT + c.tokens[:-1]))
        assert same > 0.99, f"only {same:.3f} of the (position, layer) routes agree"
    finally:
        pool.shutdown()
        ray.shutdown()
