"""Prompts as the engines see them: the model's chat template when asked for, and prompts over
data.max_prompt_length set aside with their ids, never silently dropped. CPU only, a few seconds.

    python -m pytest tests/test_prompting.py -q
"""

from __future__ import annotations

import json

import pytest

from megatron_sortedrl.config import load_config
from megatron_sortedrl.data.prompting import PromptEncoder, keep_within_limit
from megatron_sortedrl.errors import ConfigError, UserError
from megatron_sortedrl.sample import Prompt

# Qwen's ChatML layout; the tiny tokenizer has <|im_start|> and <|im_end|> as special tokens.
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture
def tok(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def _data(*overrides):
    return load_config(None, list(overrides)).data


def test_chat_template_wraps_strings_and_messages_with_the_generation_prompt(tok):
    tok.chat_template = CHATML
    enc = PromptEncoder(tok, _data("data.apply_chat_template=true"))
    plain = Prompt(prompt_id="a", text="12+7=", ground_truth="19")
    chat = Prompt(prompt_id="b", text="ignored", ground_truth="2",
                  meta={"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+1="}]})
    expect_plain = tok("<|im_start|>user\n12+7=<|im_end|>\n<|im_start|>assistant\n")["input_ids"]
    expect_chat = tok("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n1+1=<|im_end|>\n"
                      "<|im_start|>assistant\n")["input_ids"]
    assert enc.encode(plain) == expect_plain
    assert enc.encode(chat) == expect_chat
    # Without the flag the text goes in as it is (messages joined by the loader).
    assert PromptEncoder(tok, _data()).encode(plain) == tok("12+7=")["input_ids"]


def test_a_tokenizer_without_template_is_refused_in_one_line(tok):
    tok.chat_template = None
    with pytest.raises(ConfigError, match="data.apply_chat_template=True is not allowed; expected false for this model"):
        PromptEncoder(tok, _data("data.apply_chat_template=true"))


def test_long_prompts_are_set_aside_named_and_counted(tok, tmp_path):
    enc = PromptEncoder(tok, _data("data.max_prompt_length=6"))
    prompts = [Prompt(prompt_id=f"p{i}", text="9" * n, ground_truth="0") for i, n in enumerate([3, 6, 7, 12, 1])]
    ids, said = {}, []
    kept = keep_within_limit(enc, prompts, ids, tmp_path / "skipped.jsonl", said.append)
    assert [p.prompt_id for p in kept] == ["p0", "p1", "p4"] and set(ids) == {"p0", "p1", "p4"}
    rows = [json.loads(line) for line in (tmp_path / "skipped.jsonl").read_text().splitlines()]
    assert [(r["prompt_id"], r["tokens"]) for r in rows] == [("p2", 7), ("p3", 12)]
    assert said == [f"skipped 2 of 5 prompts longer than data.max_prompt_length=6 tokens (ids in {tmp_path / 'skipped.jsonl'})"]
    assert len(kept) + len(rows) == len(prompts)  # none lost
    with pytest.raises(UserError, match="every prompt is longer than data.max_prompt_length=6"):
        keep_within_limit(enc, prompts[2:4], {}, tmp_path / "skipped.jsonl", said.append)
