"""Checks that run before any conversion writes a byte: architecture, shards, shapes, TP/PP fit.

The architecture check itself (`check_architecture`, the `MODELLED` table) lives in `architectures.py`, below
both this file and the trainer's model, so that every command refuses an unmodelled architecture with the
same line without the converter and the trainer importing each other.

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

from megatron_sortedrl.convert.architectures import EXPERT_KEYS, IGNORED_SUFFIXES, check_architecture
from megatron_sortedrl.errors import CheckpointError, UserError


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
