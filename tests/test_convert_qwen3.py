"""Checkpoint conversion of Qwen3 and Qwen3-MoE: HF -> Megatron at TP2 x PP2 (x EP2 for MoE) -> HF is bit-exact,
`--verify` agrees with transformers, and an expert layout that cannot be built is refused in one line.

    pytest tests/test_convert_qwen3.py -q            # 4-rank conversions on CPU, a few minutes

The MoE checkpoint is written with experts split over 2 EP ranks (expert TP 1, TP2 x PP2: 4 processes) and
read back at TP1 x PP1 x EP1, so torch_dist's resharding of the experts is part of the round trip.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from megatron_sortedrl.cli import main
from megatron_sortedrl.convert.core import hf_to_mcore, mcore_to_hf, verify
from megatron_sortedrl.tiny_model import build_tiny_qwen3


def _tensors(d: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("q3conv")
    # decoder_sparse_step 2: layer 0 dense (Qwen3-MoE's mlp_only layers), layers 1 and 3 MoE
    return {"qwen3": build_tiny_qwen3(root / "qwen3", moe=False, seed=3),
            "qwen3_moe": build_tiny_qwen3(root / "qwen3_moe", moe=True, seed=4, num_hidden_layers=4,
                                          decoder_sparse_step=2, mlp_only_layers=[]),
            }


@pytest.mark.parametrize("family, layout", [("qwen3", {"tp": 2, "pp": 2}),
                                            ("qwen3_moe", {"tp": 2, "pp": 2, "ep": 2, "etp": 1})])
def test_round_trip_is_bit_exact(models, tmp_path, family, layout):
    src = models[family]
    ckpt = hf_to_mcore(src, tmp_path / "mc", **layout)
    meta = json.loads((ckpt / "COMPLETE.json").read_text())
    assert (meta["tp"], meta["pp"], meta.get("ep", 1)) == (layout["tp"], layout["pp"], layout.get("ep", 1))
    out = mcore_to_hf(ckpt, tmp_path / "hf", tp=1, pp=1, ep=1)
    a, b = _tensors(src), _tensors(out)
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name
    if family == "qwen3_moe":
        assert "model.layers.0.mlp.gate_proj.weight" in b and "model.layers.1.mlp.experts.3.down_proj.weight" in b
    assert verify(ckpt, src) < 1e-4


def test_moe_verify_catches_swapped_experts(models, tmp_path):
    """Two experts' weights exchanged on the HF side: same shapes, other routing results -> verify fails."""
    src = models["qwen3_moe"]
    ckpt = hf_to_mcore(src, tmp_path / "mc", tp=1, pp=1, ep=2)
    other = tmp_path / "other"
    other.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            (other / f.name).write_bytes(f.read_bytes())
    t = _tensors(src)
    p = "model.layers.1.mlp.experts.{}.down_proj.weight"
    t[p.format(0)], t[p.format(1)] = t[p.format(1)].clone(), t[p.format(0)].clone()
    from safetensors.torch import save_file

    save_file(t, str(other / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(Exception, match="verify failed"):
        verify(ckpt, other)


@pytest.mark.parametrize("family, args, text", [
    ("qwen3", ["--ep", "2"], "--ep 2: expert parallelism needs an MoE model; qwen3 is dense (use --ep 1)"),
    ("qwen3_moe", ["--ep", "3"], "--ep 3 does not divide the number of experts (4)"),
    ("qwen3_moe", ["--ep", "2", "--etp", "3"], "expert TP 3 does not divide the expert FFN size (32)"),
])
def test_impossible_expert_layout_is_one_line(models, tmp_path, capsys, family, args, text):
    rc = main(["convert", "hf-to-mcore", "--hf", str(models[family]), "--out", str(tmp_path / "o"), *args])
    lines = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and text in lines[-1]
    assert not (tmp_path / "o").exists()


def test_a_config_that_disagrees_with_the_checkpoint_is_one_line(models, tmp_path, capsys):
    """mcore-to-hf with a config.json whose expert count is not the checkpoint's: refused before any rank starts,
    naming the key and both values (the ranks said only that the checkpoint could not be read)."""
    ckpt = hf_to_mcore(models["qwen3_moe"], tmp_path / "mc", tp=1, pp=1)
    other = tmp_path / "other"
    shutil.copytree(ckpt / "hf_config", other)
    cfg = json.loads((other / "config.json").read_text())
    key = next(k for k in ("num_experts", "num_local_experts") if cfg.get(k))
    (other / "config.json").write_text(json.dumps({**cfg, key: 8}))
    capsys.readouterr()
    rc = main(["convert", "mcore-to-hf", "--ckpt", str(ckpt), "--out", str(tmp_path / "hf"), "--hf-config", str(other)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and f"config.json gives {key} = 8, the checkpoint holds 4" in err[0], err
    assert not (tmp_path / "hf").exists()
