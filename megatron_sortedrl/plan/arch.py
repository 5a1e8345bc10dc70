"""Model shapes for the launch planner: the numbers of a Hugging Face config.json that memory depends on.

    from megatron_sortedrl.plan.arch import Arch
    arch = Arch.from_path("configs/model_shapes/qwen3-30b-a3b")      # a directory or a config.json file
    arch.num_params, arch.active_params, arch.kv_bytes_per_token(dtype_bytes=2)

No weights are read: parameter counts come from the shapes. Dense layers (Qwen2 / Llama / Qwen3): q, k, v
with optional bias, Qwen3's per-head q/k RMSNorm weights and explicit `head_dim` (not always hidden / heads),
SwiGLU MLP, RMSNorm, untied or tied output layer. Mixture-of-Experts layers (Qwen3-MoE): a router
(hidden x experts, no bias), `num_experts` SwiGLU experts of `moe_intermediate_size`, top
`num_experts_per_tok` per token, shared experts where the config names them (`shared_expert_intermediate_size`
or `n_shared_experts` x `moe_intermediate_size`); which layers are sparse follows transformers
(`decoder_sparse_step`, `mlp_only_layers`; the others use the dense `intermediate_size`). `num_params` is the
whole model (what engines hold and weight sync sends), `active_params` what one token reads (shared part plus
top-k experts: what decode cost follows). Left out: sliding windows, multi-latent attention, grouped (node-
limited) routing; such a config.json is refused by `convert.architectures.check_architecture`, the check every
command shares.
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
    qkv_bias: bool  # Qwen2 has q/k/v biases, Llama and Qwen3 have none
    qk_norm: bool = False  # Qwen3: an RMSNorm of head_dim on every q and k head
    # Mixture of Experts (0 / empty for dense models)
    num_experts: int = 0
    experts_per_token: int = 0  # top-k
    moe_intermediate_size: int = 0  # one expert's SwiGLU width
    shared_expert_intermediate_size: int = 0  # shared experts together (0: none, as in Qwen3-MoE)
    norm_topk_prob: bool = False  # the top-k weights renormalised to sum to 1 (no effect on memory)
    moe_layers: tuple[int, ...] = ()  # indices of the sparse layers

    @classmethod
    def from_dict(cls, cfg: dict, name: str = "model", source: str | None = None) -> Arch:
        """The shape of a config.json's contents; an architecture the project does not model (DeepSeek MLA,
        sliding windows, ...) is refused with the line `convert` prints, not planned as if it were Qwen2."""
        from megatron_sortedrl.convert.architectures import check_architecture

        check_architecture(cfg, source or f"model config {name}")
        try:
            heads = int(cfg["num_attention_heads"])
            hidden = int(cfg["hidden_size"])
            model_type = str(cfg.get("model_type", ""))
            layers = int(cfg["num_hidden_layers"])
            # Qwen3-MoE writes num_experts (num_local_experts from transformers 5)
            experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
            moe = {}
            if experts:
                step = int(cfg.get("decoder_sparse_step") or 1)
                dense_only = {int(i) for i in cfg.get("mlp_only_layers") or []}
                f_moe = int(cfg["moe_intermediate_size"])
                moe = {"num_experts": experts, "experts_per_token": int(cfg["num_experts_per_tok"]),
                       "moe_intermediate_size": f_moe, "norm_topk_prob": bool(cfg.get("norm_topk_prob", False)),
                       "shared_expert_intermediate_size": int(cfg.get("shared_expert_intermediate_size") or 0)
                       or int(cfg.get("n_shared_experts") or 0) * f_moe,
                       # transformers' Qwen3-MoE: layer i is sparse unless listed, every decoder_sparse_step-th
                       "moe_layers": tuple(i for i in range(layers) if i not in dense_only and (i + 1) % step == 0)}
                if not 0 < moe["experts_per_token"] <= experts:
                    raise ValueError(f"num_experts_per_tok={moe['experts_per_token']} (1..num_experts={experts})")
            return cls(
                name=name, hidden_size=hidden, num_layers=layers, num_heads=heads,
                num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(cfg.get("head_dim") or hidden // heads),
                intermediate_size=int(cfg["intermediate_size"]), vocab_size=int(cfg["vocab_size"]),
                max_position_embeddings=int(cfg.get("max_position_embeddings", 0)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                qkv_bias=bool(cfg.get("attention_bias", model_type.startswith("qwen2"))),
                qk_norm=model_type.startswith("qwen3"), **moe,
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise UserError(f"model config {name}: missing or bad field {exc}; a Hugging Face config.json needs "
                            "hidden_size, num_hidden_layers, num_attention_heads, intermediate_size, vocab_size (and for MoE "
                            "moe_intermediate_size, num_experts_per_tok)") from None

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
    def is_moe(self) -> bool:
        return bool(self.num_experts and self.moe_layers)

    @property
    def attention_params(self) -> int:
        """One layer's attention: q, k, v, o projections (+ q/k/v bias, + q/k norms) and the two RMSNorm weights."""
        h, q, kv = self.hidden_size, self.q_dim, self.kv_dim
        attn = h * (q + 2 * kv) + q * h + ((q + 2 * kv) if self.qkv_bias else 0)
        return attn + (2 * self.head_dim if self.qk_norm else 0) + 2 * h

    @property
    def expert_params(self) -> int:
        """One routed expert (gate, up, down)."""
        return 3 * self.hidden_size * self.moe_intermediate_size

    @property
    def router_params(self) -> int:
        return self.hidden_size * self.num_experts

    @property
    def shared_expert_params(self) -> int:
        return 3 * self.hidden_size * self.shared_expert_intermediate_size

    def is_moe_layer(self, i: int) -> bool:
        return i in self.moe_layers

    def layer_params_at(self, i: int, active: bool = False) -> int:
        """Layer `i`: attention and norms plus its dense MLP or its MoE block (router, every expert or, with
        `active`, the top-k a token reads, shared experts)."""
        if not self.is_moe_layer(i):
            return self.attention_params + 3 * self.hidden_size * self.intermediate_size
        experts = self.experts_per_token if active else self.num_experts
        return self.attention_params + self.router_params + experts * self.expert_params + self.shared_expert_params

    @property
    def layer_params(self) -> int:
        """One dense transformer layer (the first layer's count for an MoE model)."""
        return self.layer_params_at(0)

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def output_params(self) -> int:
        """The output layer (0 when tied to the embedding; the final norm is counted separately)."""
        return 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size

    @property
    def num_params(self) -> int:
        """Every parameter (all experts): what an engine holds and a weight sync sends."""
        return (self.embedding_params + sum(self.layer_params_at(i) for i in range(self.num_layers))
                + self.hidden_size + self.output_params)

    @property
    def active_params(self) -> int:
        """Parameters one token uses: the shared part plus top-k experts per sparse layer (= num_params when dense)."""
        return (self.embedding_params + sum(self.layer_params_at(i, active=True) for i in range(self.num_layers))
                + self.hidden_size + self.output_params)

    @property
    def routed_expert_params(self) -> int:
        """All routed experts of the model (the part of the weights an engine reads only when routed to)."""
        return len(self.moe_layers) * self.num_experts * self.expert_params

    def stage_params(self, stage: int, pp: int) -> int:
        """Parameters held by pipeline stage `stage` of `pp` (first: embedding; last: final norm and output
        layer; a tied output layer on a last stage other than the first holds its own copy, as Megatron does)."""
        per = self.num_layers // pp
        n = sum(self.layer_params_at(i) for i in range(stage * per, (stage + 1) * per))
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
