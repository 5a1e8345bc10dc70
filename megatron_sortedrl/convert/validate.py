"""Checks that run before any conversion writes a byte: architecture, shards, shapes, TP/PP fit.

`check_architecture` is also what `plan` (plan/arch.py) and `train` (preflight.py, trainer/model.py) call,
so every command refuses an architecture the project does not model with the same line: Qwen2/2.5,
Llama-3, Qwen3 and Qwen3-MoE are modelled (`MODELLED`); a config field the table does not model (sliding
windows, latent attention, a sigmoid or grouped router, shared experts; `MODELLED_VALUES`) is refused by key.

    from megatron_sortedrl.convert.validate import check_hf_dir, check_layout, check_mcore_dir
    arch = check_hf_dir("models/qwen2.5-7b")           # raises UserError / CheckpointError with one line
    check_layout(arch, tp=4, pp=2)

Safetensors files are checked from their headers only (8-byte length, JSON header, data offsets), so a
truncated or missing shard and every missing or mis-shaped tensor is found without reading the weights.
The expected tensor names and shapes come from the shared weight table (`trainer/weights.py`). A Megatron
checkpoint read with a Hugging Face config is compared with it from its `.metadata` (`check_config_matches`:
layers, hidden size, heads, experts, vocabulary, FFN sizes), so a config of another model is named by key.

Deliberately left out: checksums of tensor data (a file of the right length with corrupt bytes passes).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from megatron_sortedrl.errors import CheckpointError, UserError

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


def safetensors_header(path: Path) -> dict:
    """The JSON header of one safetensors file; raises CheckpointError if the file is cut short."""
    if not path.is_file():
        raise CheckpointError(f"{path}: safetensors shard is missing")
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes, no header)")
        (n,) = struct.unpack("<Q", raw)
        if 8 + n > size:
            raise CheckpointError(f"{path}: truncated safetensors file (header needs {8 + n} bytes, file has {size})")
        try:
            header = json.loads(f.read(n))
        except ValueError:
            raise CheckpointError(f"{path}: damaged safetensors header") from None
    header.pop("__metadata__", None)
    end = max((v["data_offsets"][1] for v in header.values()), default=0)
    if 8 + n + end > size:
        raise CheckpointError(f"{path}: truncated safetensors file (tensor data needs {8 + n + end} bytes, "
                              f"file has {size}); copy the shard again")
    return header


def read_hf_tensor_shapes(model_dir: str | Path) -> dict[str, tuple[int, ...]]:
    """{tensor name: shape} of a HF checkpoint from headers; checks the index against its shards."""
    d = Path(model_dir)
    index = d / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
    elif (d / "model.safetensors").is_file():
        weight_map, files = None, ["model.safetensors"]
    else:
        raise CheckpointError(f"{d}: no model.safetensors or model.safetensors.index.json")
    shapes: dict[str, tuple[int, ...]] = {}
    for f in files:
        for name, info in safetensors_header(d / f).items():
            if weight_map is not None and weight_map.get(name) != f:
                continue  # a tensor the index does not point at is invisible to loaders
            shapes[name] = tuple(info["shape"])
    if weight_map is not None:
        for name, f in weight_map.items():
            if name not in shapes:
                raise CheckpointError(f"{d}: index maps {name} to {f}, which does not contain it")
    return shapes


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


def check_hf_dir(model_dir: str | Path):
    """Validates a HF model directory for conversion; returns its HFArch."""
    from megatron_sortedrl.trainer.model import read_hf_config
    from megatron_sortedrl.trainer.weights import hf_shapes

    d = Path(model_dir)
    if not d.is_dir():
        raise UserError(f"{d}: Hugging Face model directory does not exist")
    cfg_path = d / "config.json"
    if cfg_path.is_file():
        check_architecture(json.loads(cfg_path.read_text()), str(cfg_path))
    arch = read_hf_config(d)  # unsupported rope type -> UserError
    have = read_hf_tensor_shapes(d)
    want = hf_shapes(arch)
    for name, shape in want.items():
        if name not in have:
            raise CheckpointError(f"{d}: tensor {name} is missing (no index entry or shard holds it)")
        if have[name] != tuple(shape):
            raise CheckpointError(f"{d}: tensor {name} has shape {list(have[name])}, config.json implies {list(shape)}")
    extra = [n for n in have if n not in want and not n.endswith(IGNORED_SUFFIXES)
             and not (n == "lm_head.weight" and arch.tie_word_embeddings)]
    if extra:
        raise UserError(f"{d}: tensor {extra[0]} (and {len(extra) - 1} more) is not in the weight table; "
                        f"this architecture variant is not supported")
    return arch


def check_layout(arch, tp: int, pp: int, ep: int = 1, etp: int | None = None) -> None:
    """TP must divide attention heads and query groups (each rank holds whole query groups); PP the layers;
    EP the experts (and only an MoE model has experts to split); ETP the expert FFN size."""
    if tp < 1 or pp < 1 or ep < 1:
        raise UserError(f"--tp {tp} --pp {pp} --ep {ep}: all must be >= 1")
    if ep > 1 and not arch.num_experts:
        raise UserError(f"--ep {ep}: expert parallelism needs an MoE model; {arch.model_type} is dense (use --ep 1)")
    if arch.num_experts and arch.num_experts % ep:
        raise UserError(f"--ep {ep} does not divide the number of experts ({arch.num_experts})")
    etp = tp if etp is None else etp
    if arch.num_experts and arch.moe_ffn_size % etp:
        raise UserError(f"expert TP {etp} does not divide the expert FFN size ({arch.moe_ffn_size})")
    if arch.num_heads % tp or arch.num_kv_heads % tp:
        raise UserError(f"--tp {tp} does not divide the attention heads ({arch.num_heads}) and query groups "
                        f"({arch.num_kv_heads}); each TP rank must hold whole query groups")
    if arch.num_layers % pp:
        raise UserError(f"--pp {pp} does not divide the number of layers ({arch.num_layers})")


def checkpoint_shapes(ckpt: Path) -> dict[str, tuple[int, ...]]:
    """{sharded tensor key: global shape} of a torch_dist checkpoint, from its `.metadata` (no tensor is read)."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        md = FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    except Exception as exc:  # noqa: BLE001 - a damaged or foreign .metadata: one line
        raise CheckpointError(f"{ckpt}: its .metadata could not be read ({type(exc).__name__}: {exc}); the checkpoint "
                              "is damaged or not a torch_dist checkpoint") from None
    return {k: tuple(v.size) for k, v in md.items() if hasattr(v, "size")}


def check_config_matches(ckpt: Path, arch, meta: dict, source: str) -> None:
    """The Hugging Face config `source` describes the model the checkpoint holds: layers, hidden size, attention
    heads, query groups, experts (and which layers have them), vocabulary and FFN sizes are compared with the
    checkpoint's own tensor shapes; the first difference is one line naming the config.json key and both values,
    before any rank starts (a rank would only say that the checkpoint could not be read)."""
    import re

    from megatron_sortedrl.trainer.model import padded_vocab_size

    shapes = checkpoint_shapes(ckpt)
    indices = sorted({int(m.group(1)) for k in shapes if (m := re.match(r"decoder\.layers\.(\d+)\.", k))})
    stacked = shapes.get("decoder.layers.self_attention.linear_qkv.weight")  # alike layers: one tensor, layer axis 0

    def get(i: int, name: str) -> tuple[int, ...] | None:
        """Layer i's tensor `name`, without the layer axis of stacked layers."""
        if indices:
            return shapes.get(f"decoder.layers.{i}.{name}")
        found = shapes.get(f"decoder.layers.{name}")
        return found[1:] if found else None

    layers = list(indices) or list(range(stacked[0] if stacked else 0))
    emb = shapes.get("embedding.word_embeddings.weight")
    routed = [i for i in layers if get(i, "mlp.router.weight")]
    proj, qkv = (get(layers[0], f"self_attention.linear_{n}.weight") if layers else None for n in ("proj", "qkv"))
    dense = next((get(i, "mlp.linear_fc2.weight") for i in layers if get(i, "mlp.linear_fc2.weight")), None)
    expert_key = next((k for k in EXPERT_KEYS if arch.raw.get(k)), "num_experts")
    tp = int(meta.get("tp", 1))
    rows = [  # (config.json key, what the config implies, what the checkpoint holds; None: not in this layout)
        ("num_hidden_layers", arch.num_layers, len(layers) if layers else None),
        ("hidden_size", arch.hidden_size, emb[1] if emb else None),
        ("num_attention_heads x head_dim", arch.num_heads * arch.head_dim, proj[1] if proj else None),
        ("num_key_value_heads x head_dim", arch.num_kv_heads * arch.head_dim,
         (qkv[0] - proj[1]) // 2 if qkv and proj else None),
        (f"vocab_size (padded to TP {tp})", padded_vocab_size(arch, tp), emb[0] if emb else None),
        (expert_key, arch.num_experts, get(routed[0], "mlp.router.weight")[0] if routed else 0),  # type: ignore[index]
        ("decoder_sparse_step / mlp_only_layers (MoE layers)",
         [i for i in range(arch.num_layers) if arch.is_moe_layer(i)], routed if layers else None),
        ("intermediate_size", arch.intermediate_size, dense[1] if dense else None),
    ]
    for key, want, got in rows:
        if got is not None and want != got and not (key == expert_key and not want and not got):
            raise CheckpointError(f"{source} does not describe the model in {ckpt}: config.json gives {key} = {want}, "
                                  f"the checkpoint holds {got}; pass --hf-config <the Hugging Face directory it was "
                                  "converted or trained from>")


def check_mcore_dir(ckpt: str | Path) -> dict:
    """Validates a Megatron checkpoint directory (complete, has torch_dist metadata); returns its meta."""
    from megatron_sortedrl.trainer.checkpoint import read_meta

    d = Path(ckpt)
    meta = read_meta(d)  # missing / incomplete -> CheckpointError
    if not (d / "metadata.json").is_file() or not (d / ".metadata").is_file():
        raise CheckpointError(f"{d}: not a torch_dist checkpoint (metadata.json or .metadata missing)")
    if not any(d.glob("*.distcp")):
        raise CheckpointError(f"{d}: no *.distcp shard files; the checkpoint is missing its data")
    return meta
