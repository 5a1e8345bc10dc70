"""Checkpoint conversion: HF -> Megatron (TP=2, PP=2) -> HF round trips on tiny Qwen2 and Llama-3 models
(bit-identical tensors, identical transformers logits), --verify, and one clear line for each bad input."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from megatron_sortedrl.cli import main
from megatron_sortedrl.convert.core import hf_to_mcore, mcore_to_hf, verify
from megatron_sortedrl.tiny_model import TinyModelConfig, build_tiny_model


@pytest.fixture(scope="session")
def qwen_dir(tmp_path_factory) -> Path:
    return Path(build_tiny_model(tmp_path_factory.mktemp("conv") / "qwen", TinyModelConfig()))


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory, qwen_dir) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                      max_position_embeddings=256, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=0,
                      rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                       "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                       "original_max_position_embeddings": 64})
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(torch.float32)
    out = tmp_path_factory.mktemp("conv") / "llama"
    model.save_pretrained(out)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(qwen_dir / f, out / f)
    return out


@pytest.fixture(scope="module")
def llama_ckpt(tmp_path_factory, llama_dir) -> Path:
    return hf_to_mcore(llama_dir, tmp_path_factory.mktemp("conv") / "llama_mc", tp=2, pp=2)


def _tensors(d: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _logits(d: Path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.mark.parametrize("family", ["qwen", pytest.param("llama", marks=pytest.mark.slow)])  # llama: 45 s
def test_round_trip_tp2_pp2_bit_identical(family, qwen_dir, llama_dir, tmp_path, request):
    src = qwen_dir if family == "qwen" else llama_dir
    ckpt = hf_to_mcore(src, tmp_path / "mc", tp=2, pp=2) if family == "qwen" else request.getfixturevalue("llama_ckpt")
    meta = json.loads((ckpt / "COMPLETE.json").read_text())
    assert (meta["tp"], meta["pp"], meta["model_only"]) == (2, 2, True)
    # Read back at TP=1, PP=1: torch_dist reshards, so this also checks the TP=2/PP=2 layout is global.
    out = mcore_to_hf(ckpt, tmp_path / "hf", tp=1, pp=1)
    a, b = _tensors(src), _tensors(out)
    if family == "qwen":
        a.pop("lm_head.weight", None)  # tied: the export writes the embedding once
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name
    assert torch.equal(_logits(src), _logits(out))
    assert json.loads((out / "config.json").read_text()) == json.loads((src / "config.json").read_text())
    assert (out / "tokenizer.json").is_file()


def test_verify_compares_logits_and_catches_a_wrong_model(llama_dir, llama_ckpt, tmp_path):
    ckpt = llama_ckpt  # written at TP=2, PP=2; verify reads it at TP=2, PP=1
    assert verify(ckpt, llama_dir) < 1e-4
    # A different model on the HF side (same shapes, other weights) must fail the check.
    other = tmp_path / "other"
    shutil.copytree(llama_dir, other)
    t = _tensors(other)
    t["model.norm.weight"] = t["model.norm.weight"] * 2
    from safetensors.torch import save_file

    save_file(t, str(other / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(Exception, match="verify failed"):
        verify(ckpt, other)


# ------------------------------------------------------------------------------------------- bad inputs


def _run_cli(argv, capsys) -> tuple[int, str]:
    rc = main(["convert", *argv])
    err = capsys.readouterr().err.strip().splitlines()
    return rc, err[-1] if err else ""


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_bad_architecture(qwen_dir, tmp_path, capsys):
    d = _copy(qwen_dir, tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(architectures=["MixtralForCausalLM"], model_type="mixtral")
    (d / "config.json").write_text(json.dumps(cfg))
    rc, line = _run_cli(["hf-to-mcore", "--hf", str(d), "--out", str(tmp_path / "o")], capsys)
    assert rc != 0 and "architecture MixtralForCausalLM with model_type 'mixtral' is not supported" in line
    assert not (tmp_path / "o").exists()


def test_truncated_safetensors(qwen_dir, tmp_path, capsys):
    d = _copy(qwen_dir, tmp_path / "m")
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    rc, line = _run_cli(["hf-to-mcore", "--hf", str(d), "--out", str(tmp_path / "o")], capsys)
    assert rc != 0 and "truncated safetensors file" in line and "model.safetensors" in line
    assert not (tmp_path / "o").exists()


def test_missing_index_entry(llama_dir, tmp_path, capsys):
    d = _copy(llama_dir, tmp_path / "m")
    t = _tensors(d)
    (d / "model.safetensors").unlink()
    from safetensors.torch import save_file

    names = sorted(t)
    half = len(names) // 2
    save_file({n: t[n] for n in names[:half]}, str(d / "model-00001-of-00002.safetensors"))
    save_file({n: t[n] for n in names[half:]}, str(d / "model-00002-of-00002.safetensors"))
    wmap = {n: "model-00001-of-00002.safetensors" if i < half else "model-00002-of-00002.safetensors"
            for i, n in enumerate(names)}
    dropped = "model.layers.1.mlp.down_proj.weight"
    del wmap[dropped]
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wmap}))
    rc, line = _run_cli(["hf-to-mcore", "--hf", str(d), "--out", str(tmp_path / "o")], capsys)
    assert rc != 0 and f"tensor {dropped} is missing" in line


def test_impossible_tp_and_pp(qwen_dir, tmp_path, capsys):
    rc, line = _run_cli(["hf-to-mcore", "--hf", str(qwen_dir), "--out", str(tmp_path / "o"), "--tp", "3"], capsys)
    assert rc != 0 and "--tp 3 does not divide the attention heads (4) and query groups (2)" in line
    rc, line = _run_cli(["hf-to-mcore", "--hf", str(qwen_dir), "--out", str(tmp_path / "o"), "--pp", "3"], capsys)
    assert rc != 0 and "--pp 3 does not divide the number of layers (2)" in line
    assert not (tmp_path / "o").exists()


def test_mismatched_shape_and_incomplete_checkpoint(qwen_dir, tmp_path, capsys):
    d = _copy(qwen_dir, tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["intermediate_size"] += 8
    (d / "config.json").write_text(json.dumps(cfg))
    rc, line = _run_cli(["hf-to-mcore", "--hf", str(d), "--out", str(tmp_path / "o")], capsys)
    assert rc != 0 and "config.json implies" in line
    half = tmp_path / "ck"
    half.mkdir()
    rc, line = _run_cli(["mcore-to-hf", "--ckpt", str(half), "--out", str(tmp_path / "o2")], capsys)
    assert rc != 0 and "incomplete" in line
    assert not (tmp_path / "o2").exists()


def test_existing_output_is_kept_without_overwrite(qwen_dir, tmp_path, capsys):
    out = tmp_path / "o"
    out.mkdir()
    (out / "keep").write_text("x")
    rc, line = _run_cli(["hf-to-mcore", "--hf", str(qwen_dir), "--out", str(out)], capsys)
    assert rc != 0 and "already exists" in line and (out / "keep").read_text() == "x"
