"""The tiny model directory loads offline with transformers, and its tokenizer is exact on every task text."""

from __future__ import annotations

import json

import torch
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer

from megatron_sortedrl.data import arithmetic, knights_knaves
from megatron_sortedrl.tiny_model import CHARACTERS, EOS, VOCAB_SIZE, build_tiny_model


def test_loads_with_auto_classes_and_runs(tiny_model_dir):
    config = json.loads((tiny_model_dir / "config.json").read_text())
    assert config["model_type"] == "qwen2" and config["head_dim"] in (32, 64)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    ids = tok("12+34=\n", return_tensors="pt")["input_ids"]
    assert ids.shape[1] == 7  # one token per character
    logits = model(ids).logits
    assert logits.shape == (1, 7, VOCAB_SIZE) and torch.isfinite(logits).all()
    assert tok.eos_token == EOS and tok.eos_token_id == 0


def test_tokenizer_round_trips_every_task_text(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    raw = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    prompts = arithmetic.generate(200, 0, 1, 8) + knights_knaves.generate(60, 0, 2, 7)
    for p in prompts:
        for text in (p.text, p.solution, p.ground_truth, p.text + p.solution + EOS):
            ids = tok(text)["input_ids"]
            assert tok.decode(ids) == text
            assert raw.encode(text).ids == ids  # transformers and vLLM-side tokenizers agree
            assert len(ids) == len(text.replace(EOS, "x"))  # exactly one token per character


def test_vocabulary_covers_printable_ascii():
    assert len(CHARACTERS) == 96 and "\n" in CHARACTERS and " " in CHARACTERS


def test_build_is_deterministic_and_does_not_overwrite(tmp_path, tiny_model_dir):
    again = build_tiny_model(tmp_path / "tiny")
    a = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    b = AutoModelForCausalLM.from_pretrained(again).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    marker = again / "config.json"
    before = marker.stat().st_mtime_ns
    build_tiny_model(again)  # existing directory is kept as is
    assert marker.stat().st_mtime_ns == before
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary directory left behind
