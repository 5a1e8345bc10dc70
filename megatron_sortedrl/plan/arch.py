"""Model shapes for the launch planner: the numbers of a Hugging Face config.json that memory depends on.

    from megatron_sortedrl.plan.arch import Arch
    arch = Arch.from_path("configs/model_shapes/qwen2.5-32b")      # a directory or a config.json file
    arch.num_params, arch.kv_bytes_per_token(dtype_bytes=2)

No weights are read: parameter counts come from the shapes (Qwen2 / Llama layout: fused-able q, k, v with
optional bias, SwiGLU MLP, RMSNorm, untied or tied output layer). Left out: MoE layers, sliding windows,
multi-latent attention, Qwen3's q/k norms (none of the shipped recipes uses them): such a config.json is
refused by `convert.validate.check_architecture`, the check every command shares.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from megatron_sortedrl.errors import UserError


@dataclass(frozen=True)
class Arch:
    name: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool  # Qwen2 has q/k/v biases, Llama has none

    @classmethod
    def from_dict(cls, cfg: dict, name: str = "model", source: str | None = None) -> Arch:
        """The shape of a config.json's contents; an architecture the project does not model (Qwen3, MoE, ...)
        is refused with the line `convert` prints, not planned as if it were Qwen2."""
        from megatron_sortedrl.convert.validate import check_architecture

        check_architecture(cfg, source or f"model config {name}")
        try:
            heads = int(cfg["num_attention_heads"])
            hidden = int(cfg["hidden_size"])
            model_type = str(cfg.get("model_type", ""))
            return cls(
                name=name, hidden_size=hidden, num_layers=int(cfg["num_hidden_layers"]), num_heads=heads,
                num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(cfg.get("head_dim") or hidden // heads),
                intermediate_size=int(cfg["intermediate_size"]), vocab_size=int(cfg["vocab_size"]),
                max_position_embeddings=int(cfg.get("max_position_embeddings", 0)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                qkv_bias=bool(cfg.get("attention_bias", model_type.startswith("qwen2"))),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise UserError(f"model config {name}: missing or bad field {exc}; a Hugging Face config.json needs "
                            "hidden_size, num_hidden_layers, num_attention_heads, intermediate_size, vocab_size") from None

    @classmethod
    def from_path(cls, path: str | Path) -> Arch:
        p = Path(path)
        file = p / "config.json" if p.is_dir() else p
        if not file.is_file():
            raise UserError(f"model config: {file} does not exist; pass --model-config DIR_OR_FILE "
                            "(e.g. configs/model_shapes/qwen2.5-32b) or set model.path to a model directory")
        try:
            data = json.loads(file.read_text())
        except json.JSONDecodeError as exc:
            raise UserError(f"model config: {file} is not valid JSON ({exc.msg} at line {exc.lineno})") from None
        return cls.from_dict(data, name=file.parent.name or str(file), source=str(file))

    # ---------------------------------------------------------------------------------- parameter counts

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def layer_params(self) -> int:
        """One transformer layer: q, k, v, o projections (+ q/k/v bias), gate/up/down, two RMSNorm weights."""
        h, q, kv, f = self.hidden_size, self.q_dim, self.kv_dim, self.intermediate_size
        attn = h * (q + 2 * kv) + q * h + ((q + 2 * kv) if self.qkv_bias else 0)
        return attn + 3 * h * f + 2 * h

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def output_params(self) -> int:
        """The output layer (0 when tied to the embedding; the final norm is counted separately)."""
        return 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size

    @property
    def num_params(self) -> int:
        return self.embedding_params + self.num_layers * self.layer_params + self.hidden_size + self.output_params

    def stage_params(self, stage: int, pp: int) -> int:
        """Parameters held by pipeline stage `stage` of `pp` (first: embedding; last: final norm and output
        layer; a tied output layer on a last stage other than the first holds its own copy, as Megatron does)."""
        n = self.num_layers // pp * self.layer_params
        if stage == 0:
            n += self.embedding_params
        if stage == pp - 1:
            n += self.hidden_size + (self.vocab_size * self.hidden_size if (self.tie_word_embeddings and pp > 1)
                                     else self.output_params)
        return n

    def kv_bytes_per_token(self, dtype_bytes: int, tp: int = 1) -> int:
        """KV-cache bytes per token on one of `tp` ranks: 2 (k, v) x layers x kv heads per rank x head_dim x dtype.
        With tp > kv heads vLLM replicates heads, so a rank holds at least one."""
        heads_per_rank = max(1, -(-self.num_kv_heads // tp))
        return 2 * self.num_layers * heads_per_rank * self.head_dim * dtype_bytes
