"""A tiny Qwen3-MoE Hugging Face directory for the routing tests (the character tokenizer of the tiny model).

    from moe_support import build_tiny_moe, hf_routes
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

LAYERS, EXPERTS, TOPK = 2, 8, 2


def build_tiny_moe(out: Path, seed: int = 0) -> Path:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from megatron_sortedrl.tiny_model import EOS, SPECIAL_TOKENS, VOCAB_SIZE, build_tokenizer

    eos = SPECIAL_TOKENS.index(EOS)
    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                         num_hidden_layers=LAYERS, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                         num_experts=EXPERTS, num_experts_per_tok=TOPK, norm_topk_prob=True,
                         max_position_embeddings=1024, tie_word_embeddings=False, bos_token_id=eos,
                         eos_token_id=eos, pad_token_id=eos)
    Qwen3MoeForCausalLM(cfg).float().save_pretrained(out, safe_serialization=True)
    build_tokenizer().save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "Qwen2Tokenizer", "eos_token": EOS,
                                                           "pad_token": EOS, "unk_token": "<unk>", "bos_token": None}))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": eos, "pad_token_id": eos}))
    return out


@torch.no_grad()
def hf_routes(model, tokens: list[int]) -> torch.Tensor:
    """[positions, layers, top-k] experts transformers' routers pick for `tokens` (sorted per row)."""
    logits = model(torch.tensor([tokens], device=model.device), output_router_logits=True).router_logits
    return torch.stack([lg.topk(TOPK, -1).indices.cpu() for lg in logits], 1).sort(-1).values


def agreement(routes, want: torch.Tensor) -> float:
    """Share of (position, layer) whose expert set equals the reference's."""
    got = torch.from_numpy(routes.array().astype("int64")).sort(-1).values
    assert got.shape == want.shape, (got.shape, want.shape)
    return float((got == want).all(-1).float().mean())
