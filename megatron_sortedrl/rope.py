"""Which RoPE the run uses, and how many positions it gives: one answer for config checks, trainer and engines.

    from megatron_sortedrl.rope import resolve_rope
    rope = resolve_rope(json.load(open("model/config.json")), {"rope_type": "yarn", "factor": 4.0})
    rope.params, rope.max_positions, rope.hf_overrides()     # trainer, context check, vLLM `hf_overrides`

A model's rope settings come from its config.json (`rope_scaling`, or `rope_parameters` in files written by
transformers >= 5) unless `model.rope_scaling` replaces them; that is how YaRN is applied to a checkpoint
without editing its files (Qwen2.5's documented route to 128k tokens). The same resolved dictionary goes to
the trainer (`trainer.model.rope_inv_freq`) and to vLLM, so both compute the same frequencies.

Positions the model supports (`max_positions`), following vLLM's own rule so an accepted config also starts:
default and llama3 keep `max_position_embeddings` (Llama-3.1 files already state the extended length);
linear multiplies it by `factor`; YaRN gives `factor x original_max_position_embeddings` (the original
defaults to `max_position_embeddings`). When YaRN extends past `max_position_embeddings`, the engines are
also told the extended length (vLLM refuses a `max_model_len` beyond it otherwise).

Deliberately left out: dynamic NTK scaling (its frequencies change with the current sequence length, so a
trainer scoring whole sequences and an engine growing them token by token would see different models),
longrope and the other types no target family ships; all are rejected with the types that are supported.
No torch import: the config loader uses this module.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from megatron_sortedrl.errors import ConfigError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
REQUIRED_KEYS = {"default": (), "linear": ("factor",),
                 "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
                 "yarn": ("factor",)}


def check_rope_scaling(rs: dict[str, Any], key: str) -> dict[str, Any]:
    """A normalised copy (`rope_type` set, legacy `type` dropped) of a rope dictionary, or a ConfigError."""
    rs = dict(rs)
    empty = [k for k, v in rs.items() if v is None]
    if empty:  # `{rope_type:yarn}` (no space after the colon) is YAML for the key "rope_type:yarn" with no value
        raise ConfigError(f"{key}.{empty[0]}", None, "a value; write `key: value` with a space after the colon")
    kind = rs.pop("type", None)
    kind = rs.setdefault("rope_type", kind or "default")
    if kind == "dynamic":
        raise ConfigError(f"{key}.rope_type", kind,
                          "a static scaling: dynamic NTK changes with the sequence length, so trainer and engines "
                          "would score different models; use yarn to extend the context")
    if kind not in SUPPORTED_ROPE_TYPES:
        raise ConfigError(f"{key}.rope_type", kind, f"one of {', '.join(SUPPORTED_ROPE_TYPES)}")
    for req in REQUIRED_KEYS[kind]:
        if rs.get(req) is None:
            raise ConfigError(f"{key}.{req}", None, f"a number (required by rope_type {kind})")
    factor = rs.get("factor")
    if factor is not None and (not isinstance(factor, (int, float)) or factor < 1):
        raise ConfigError(f"{key}.factor", factor, "a number >= 1")
    return rs


@dataclass(frozen=True)
class RopeSpec:
    params: dict[str, Any]  # rope_type plus its keys (no rope_theta), as HF's rope init functions read them
    rope_theta: float
    max_position_embeddings: int  # as config.json states it
    max_positions: int  # positions the model supports under this scaling
    overridden: bool = False  # params came from model.rope_scaling, not config.json
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def rope_type(self) -> str:
        return self.params["rope_type"]

    def describe(self) -> str:
        if self.rope_type == "default":
            return f"max_position_embeddings {self.max_position_embeddings}, no rope scaling"
        return f"max_position_embeddings {self.max_position_embeddings}, {self.rope_type} rope scaling " \
               f"factor {self.params.get('factor')}"

    def suggest(self, needed: int) -> str:
        """What to set to hold `needed` positions."""
        base = int(self.params.get("original_max_position_embeddings") or self.max_position_embeddings)
        factor = max(2, math.ceil(needed / base))
        return (f"set model.rope_scaling={{rope_type: yarn, factor: {factor}.0, "
                f"original_max_position_embeddings: {base}}}")

    def hf_overrides(self) -> dict[str, Any]:
        """vLLM `hf_overrides` that make the engine use this rope (empty when config.json already says it)."""
        out: dict[str, Any] = {}
        if self.overridden:
            out["rope_parameters"] = {**self.params, "rope_theta": self.rope_theta}
        if self.rope_type == "yarn" and self.max_positions > self.max_position_embeddings:
            out["rope_parameters"] = {**self.params, "rope_theta": self.rope_theta}
            out["max_position_embeddings"] = self.max_positions
        return out


def resolve_rope(hf_config: dict[str, Any], override: dict[str, Any] | None = None,
                 source: str = "config.json") -> RopeSpec:
    """The rope a model runs with: `override` (model.rope_scaling) if non-empty, else config.json's."""
    file_rope = dict(hf_config.get("rope_parameters") or hf_config.get("rope_scaling") or {})
    theta = float(file_rope.pop("rope_theta", hf_config.get("rope_theta", 10000.0)))
    mpe = int(hf_config.get("max_position_embeddings", 4096))
    if override:
        params = check_rope_scaling(override, "model.rope_scaling")
        params.pop("rope_theta", None)
    else:
        try:
            params = check_rope_scaling(file_rope, f"{source}: rope_scaling")
        except ConfigError as err:
            raise ConfigError(err.key, err.value, err.allowed + " (or override it with model.rope_scaling)") from None
    kind = params["rope_type"]
    if kind == "yarn":
        params.setdefault("original_max_position_embeddings", mpe)
        positions = max(mpe, int(float(params["factor"]) * int(params["original_max_position_embeddings"])))
    elif kind == "linear":
        positions = int(mpe * float(params["factor"]))
    else:
        positions = mpe
    return RopeSpec(params, theta, mpe, positions, overridden=bool(override))
