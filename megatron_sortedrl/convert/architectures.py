"""The architectures the project models, as data, and the one check every command runs on a config.json.

`check_architecture` is what `plan` (plan/arch.py), `train` (preflight.py, trainer/model.py) and `convert`
(convert/validate.py) call, so every command refuses an architecture the project does not model with the same
line: Qwen2/2.5, Llama-3, Qwen3 and Qwen3-MoE are modelled (`MODELLED`); a config field the table does not model
(sliding windows, latent attention, a sigmoid or grouped router, shared experts; `MODELLED_VALUES`) is refused
by key.

    from megatron_sortedrl.convert.architectures import check_architecture
    check_architecture(json.loads(Path("models/qwen3-8b/config.json").read_text()), "config.json")

A leaf: it imports only the errors, so the trainer's model and the converter's checks both stand on it.
Deliberately left out: reading the files (validate.py reads shards, trainer/model.py reads the config).
"""

from __future__ import annotations

from megatron_sortedrl.errors import UserError

# The architectures the weight table (trainer/weights.py) models, as data: config.json `model_type` -> its
# `architectures` entry and the traits the trainer derives from the family (`trainer/model.read_hf_config`):
# q/k/v biases (Qwen2), RMSNorm on q and k per head (Qwen3), routed experts (Qwen3-MoE). `plan`, `train` and
# `convert` all refuse anything else through `check_architecture`, with the same line.
MODELLED: dict[str, tuple[str, dict]] = {
    "qwen2": ("Qwen2ForCausalLM", {"qkv_bias": True, "qk_norm": False, "moe": False}),
    "llama": ("LlamaForCausalLM", {"qkv_bias": False, "qk_norm": False, "moe": False}),
    "qwen3": ("Qwen3ForCausalLM", {"qkv_bias": False, "qk_norm": True, "moe": False}),
    "qwen3_moe": ("Qwen3MoeForCausalLM", {"qkv_bias": False, "qk_norm": True, "moe": True}),
}
SUPPORTED_ARCHITECTURES = tuple(a for a, _ in MODELLED.values())
# config.json keys that name the number of routed experts (Qwen3-MoE writes num_experts, or num_local_experts
# from transformers 5; Mixtral num_local_experts; DeepSeek n_routed_experts). A dense family with one of them
# on is refused.
EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
# config.json keys of features the table does not model, with the values it does model (an absent key is
# fine): sliding windows, multi-head latent attention, another activation, MLP biases, a router other than
# softmax top-k (DeepSeek-V3's sigmoid scores, grouped or bias-corrected top-k), shared experts. Any other
# value is refused, naming the key.
MODELLED_VALUES: dict[str, tuple] = {
    "use_sliding_window": (False, None),
    "kv_lora_rank": (None, 0),
    "q_lora_rank": (None, 0),
    "hidden_act": ("silu",),
    "mlp_bias": (False, None),
    "scoring_func": ("softmax", None),
    "topk_method": ("greedy", None),
    "n_group": (None, 0, 1),
    "topk_group": (None, 0, 1),
    "shared_expert_intermediate_size": (None, 0),
    "n_shared_experts": (None, 0),
}
# Tensors some HF checkpoints carry that are recomputed, never loaded.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def moe_layer_indices(cfg: dict) -> tuple[int, ...]:
    """0-based indices of a config.json's MoE layers; () for a dense model. transformers' Qwen3-MoE rule: layer i
    is sparse unless listed in `mlp_only_layers`, and only every `decoder_sparse_step`-th layer is."""
    if not any(int(cfg.get(k) or 0) for k in EXPERT_KEYS):
        return ()
    step, dense_only = int(cfg.get("decoder_sparse_step") or 1), {int(i) for i in cfg.get("mlp_only_layers") or []}
    return tuple(i for i in range(int(cfg["num_hidden_layers"])) if i not in dense_only and (i + 1) % step == 0)


def check_architecture(cfg: dict, source: str) -> None:
    """Refuses, in one line naming the key, a config.json whose architecture the project does not model (a
    Qwen3 or MoE config has the field names of a Qwen2 one; planning or training it as Qwen2 would be silently
    wrong)."""
    archs = cfg.get("architectures") or []
    model_type = cfg.get("model_type", "")
    expected = MODELLED.get(model_type, (None, {}))[0]
    bad = next((a for a in archs if a != expected), None) if expected else None
    if expected is None:
        bad = f"{archs[0] if archs else '(none)'} with model_type {model_type!r}"
    elif bad is not None:
        bad = f"{bad} with model_type {model_type!r}"
    if bad is not None:
        raise UserError(f"{source}: architecture {bad} is not supported; expected one of "
                        f"{', '.join(f'{a} (model_type {t})' for t, (a, _) in MODELLED.items())}")
    name = archs[0] if archs else model_type
    moe = MODELLED[model_type][1]["moe"]

    def refuse(key: str, what: str) -> None:
        raise UserError(f"{source}: architecture {name} with {key}={cfg.get(key)!r} is not supported; {what}")

    for key in EXPERT_KEYS:
        if cfg.get(key) and not moe:
            refuse(key, f"model_type {model_type} is a dense family (MoE: model_type qwen3_moe)")
    for key, allowed in MODELLED_VALUES.items():
        if key in cfg and cfg[key] not in allowed:
            refuse(key, "the model table covers full attention, SiLU gated MLPs without bias and softmax top-k "
                        "routed experts without shared experts")
    kinds = set(cfg.get("layer_types") or []) - {"full_attention"}
    if kinds:
        refuse("layer_types", f"only full_attention layers are modelled, not {sorted(kinds)[0]}")
    if moe:
        experts = next((cfg[k] for k in EXPERT_KEYS if cfg.get(k)), 0)
        topk = cfg.get("num_experts_per_tok") or 0
        if not experts or not 0 < topk <= experts:
            key = "num_experts_per_tok" if experts else "num_experts"
            refuse(key, "an MoE model needs num_experts >= 1 and 1 <= num_experts_per_tok <= num_experts")
        if int(cfg.get("decoder_sparse_step") or 1) < 1:
            refuse("decoder_sparse_step", "it must be >= 1 (every n-th layer is an MoE layer)")
