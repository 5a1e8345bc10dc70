"""Hugging Face checkpoint files: reading single tensors from safetensors shards, and writing a loadable
HF directory from streamed tensors (the weight table and the TP/PP/EP layout math are in `weights.py`).

    reader = HFReader("models/qwen3-8b"); t = reader.get("model.norm.weight")
    write_hf_dir("out/hf", iter_of_name_tensor_pairs, source_dir="models/qwen3-8b")

Deliberately left out: checksums of tensor data (see `convert/validate.py`).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch

from megatron_sortedrl.errors import CheckpointError


class HFReader:
    """Reads single tensors from a HF safetensors checkpoint (sharded or not) without loading it all."""

    def __init__(self, model_dir: str | Path):
        from safetensors import safe_open

        d = Path(model_dir)
        index = d / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
        elif (d / "model.safetensors").is_file():
            weight_map = None
        else:
            raise CheckpointError(f"{d}: no model.safetensors or model.safetensors.index.json")
        files = sorted(set(weight_map.values())) if weight_map else ["model.safetensors"]
        self._handles = {f: safe_open(str(d / f), framework="pt") for f in files}
        self._where = weight_map or {k: "model.safetensors" for k in self._handles["model.safetensors"].keys()}

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str) -> torch.Tensor:
        if name not in self._where:
            raise CheckpointError(f"HF checkpoint has no tensor {name}")
        return self._handles[self._where[name]].get_tensor(name)


HF_SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "special_tokens_map.json", "vocab.json", "merges.txt")


def write_hf_dir(out_dir: str | Path, tensors: Iterator[tuple[str, torch.Tensor]], source_dir: str | Path,
                 shard_bytes: int = 2 << 30) -> str:
    """Writes streamed HF tensors as a loadable HF directory (safetensors shards + config/tokenizer copies).

    Written into `<out_dir>.partial` and renamed at the end, so readers (rollout weight sync) never see a
    half-written directory."""
    import os
    import shutil

    from safetensors.torch import save_file

    out = Path(out_dir)
    tmp = out.parent / f".{out.name}.partial"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    shard: dict[str, torch.Tensor] = {}
    size, files, weight_map = 0, [], {}

    def flush():
        nonlocal shard, size
        if shard:
            name = f"model-{len(files) + 1:05d}.safetensors"
            save_file(shard, str(tmp / name), metadata={"format": "pt"})
            files.append(name)
            weight_map.update({k: name for k in shard})
            shard, size = {}, 0

    for name, t in tensors:
        shard[name] = t.detach().cpu().contiguous().clone()
        size += t.numel() * t.element_size()
        if size >= shard_bytes:
            flush()
    flush()
    if len(files) == 1:
        os.rename(tmp / files[0], tmp / "model.safetensors")
    else:
        total = sum((tmp / f).stat().st_size for f in files)
        (tmp / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    for f in HF_SIDE_FILES:
        if (Path(source_dir) / f).is_file():
            shutil.copy(Path(source_dir) / f, tmp / f)
    if out.exists():
        shutil.rmtree(out)
    os.rename(tmp, out)
    return str(out)
