"""Checks that run before any conversion writes a byte: architecture, shards, shapes, TP/PP fit.

`check_architecture` is also what `plan` (plan/arch.py) and `train` (preflight.py, trainer/model.py) call,
so every command refuses an architecture the project does not model with the same line.

    from megatron_sortedrl.convert.validate import check_hf_dir, check_layout, check_mcore_dir
    arch = check_hf_dir("models/qwen2.5-7b")           # raises UserError / CheckpointError with one line
    check_layout(arch, tp=4, pp=2)

Safetensors files are checked from their headers only (8-byte length, JSON header, data offsets), so a
truncated or missing shard and every missing or mis-shaped tensor is found without reading the weights.
The expected tensor names and shapes come from the shared weight table (`trainer/weights.py`).

Deliberately left out: checksums of tensor data (a file of the right length with corrupt bytes passes).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from megatron_sortedrl.errors import CheckpointError, UserError

# What the weight table (trainer/weights.py) models: config.json `model_type` -> its `architectures` entry
# (Qwen2 / Qwen2.5 / Llama-3 / Qwen3 / Qwen3-MoE). `plan`, `train` and `convert` all refuse anything else through
# `check_architecture`, with the same line.
MODELLED = {"qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM",
            "qwen3_moe": "Qwen3MoeForCausalLM"}
SUPPORTED_ARCHITECTURES = tuple(MODELLED.values())
# config.json keys of features the table does not model (experts, latent attention, sliding windows): a
# config that turns one on is refused even under a supported model_type.
UNMODELLED_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "kv_lora_rank", "use_sliding_window")
# ... unless the model_type models them (Qwen3-MoE's experts).
MODELLED_KEYS = {"qwen3_moe": ("num_experts", "num_local_experts")}
# Tensors some HF checkpoints carry that are recomputed, never loaded.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


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
    """Refuses, in one line, a config.json whose architecture the project does not model (a Qwen3 or MoE
    config has the field names of a Qwen2 one; planning or training it as Qwen2 would be silently wrong)."""
    archs = cfg.get("architectures") or []
    model_type = cfg.get("model_type", "")
    bad = next((a for a in archs if a not in SUPPORTED_ARCHITECTURES), None)
    if bad is None and model_type not in MODELLED:
        bad = f"{archs[0] if archs else '(none)'} with model_type {model_type!r}"
    if bad is not None:
        raise UserError(f"{source}: architecture {bad} is not supported; expected one of "
                        f"{', '.join(f'{a} (model_type {t})' for t, a in MODELLED.items())}")
    if archs and MODELLED.get(model_type) not in archs:  # Qwen2's class with a Qwen3 model_type, or the reverse
        raise UserError(f"{source}: architecture {archs[0]} with model_type {model_type!r} is not supported; "
                        f"model_type {model_type!r} expects {MODELLED[model_type]}")
    on = next((k for k in UNMODELLED_KEYS if cfg.get(k) and k not in MODELLED_KEYS.get(model_type, ())), None)
    if on is not None:
        raise UserError(f"{source}: architecture {archs[0] if archs else model_type} with {on}={cfg[on]!r} is not "
                        "supported; the model table covers dense models without sliding windows")


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


def check_layout(arch, tp: int, pp: int) -> None:
    """TP must divide attention heads and query groups (each rank holds whole groups); PP the layers."""
    if tp < 1 or pp < 1:
        raise UserError(f"--tp {tp} --pp {pp}: both must be >= 1")
    if arch.num_heads % tp or arch.num_kv_heads % tp:
        raise UserError(f"--tp {tp} does not divide the attention heads ({arch.num_heads}) and query groups "
                        f"({arch.num_kv_heads}); each TP rank must hold whole query groups")
    if arch.num_layers % pp:
        raise UserError(f"--pp {pp} does not divide the number of layers ({arch.num_layers})")


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
