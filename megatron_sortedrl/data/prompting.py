"""Prompt text to token ids, as the engines and the trainer see it: the chat template when asked for, and
prompts longer than `data.max_prompt_length` tokens set aside (counted and named, never silently lost).

    enc = PromptEncoder(tokenizer, cfg.data)
    ids = enc.encode(prompt)                               # list[int]
    ids_by_id, skipped = enc.encode_all(prompts)           # skipped: [(prompt_id, tokens)] over the limit

With `data.apply_chat_template=true` the tokenizer's own template (from the model directory) wraps the
prompt with the generation prompt appended, as an instruct model was tuned to see it: a dataset row whose
prompt is a list of chat messages (verl / DAPO layout) is rendered as those messages, a plain string as
one user message. With tools (`tools.tools`), their schemas go in through the template's `tools=` argument
(a row's own `tools` list narrows them). Without it, chat messages are joined with newlines (the tiny built-in model has no
template). `check_template` is called before anything starts, so a tokenizer without a template is one
line, not a failure at the first prompt.

Left out: system prompts added by us (put them in the dataset's messages) and multimodal content.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

from megatron_sortedrl.errors import ConfigError, UserError
from megatron_sortedrl.sample import Prompt


class PromptEncoder:
    def __init__(self, tokenizer: Any, data_cfg, tools: Callable[[list[str] | None], list[dict]] | None = None) -> None:
        self.tok = tokenizer
        # tool schemas by the row's tool names (None: all): rendered by the template's `tools=`; left out with
        # data.tool_schemas_in_prompt=false (a model that learns its tools in the warm start, not from their text)
        self.tools = tools if data_cfg.tool_schemas_in_prompt else None
        self.chat = bool(data_cfg.apply_chat_template)
        self.max_len = int(data_cfg.max_prompt_length)
        if self.chat:
            check_template(tokenizer)

    def encode(self, prompt: Prompt) -> list[int]:
        if not self.chat:
            return list(self.tok(prompt.text)["input_ids"])
        messages = prompt.meta.get("messages") or [{"role": "user", "content": prompt.text}]
        tools = self.tools(prompt.meta.get("tools")) if self.tools else None
        ids = self.tok.apply_chat_template(messages, tools=tools or None, add_generation_prompt=True, tokenize=True,
                                          return_dict=False)
        if hasattr(ids, "keys"):  # some transformers versions return a BatchEncoding whatever was asked
            ids = ids["input_ids"]
        return list(ids)

    def encode_all(self, prompts: list[Prompt]) -> tuple[dict[str, list[int]], list[tuple[str, int]]]:
        """({prompt id: ids} of the prompts within `data.max_prompt_length` tokens, [(prompt id, tokens) of
        those over it]), in the order given."""
        kept, skipped = {}, []
        for p in prompts:
            ids = self.encode(p)
            if len(ids) <= self.max_len:
                kept[p.prompt_id] = ids
            else:
                skipped.append((p.prompt_id, len(ids)))
        return kept, skipped


def keep_within_limit(encoder: PromptEncoder, prompts: list[Prompt], ids_out: dict[str, list[int]],
                      skipped_log: Path, say: Callable[[str], None] = print) -> list[Prompt]:
    """The prompts within `data.max_prompt_length` tokens, their ids added to `ids_out`; the others are named
    in `skipped_log` (JSON lines, appended) and counted in one console line. All of them over: a UserError."""
    ids, skipped = encoder.encode_all(prompts)
    ids_out.update(ids)
    if skipped:
        with open(skipped_log, "a", encoding="utf-8") as f:
            f.writelines(json.dumps({"prompt_id": pid, "tokens": n, "reason": "over data.max_prompt_length"}) + "\n"
                         for pid, n in skipped)
        say(f"skipped {len(skipped)} of {len(prompts)} prompts longer than data.max_prompt_length={encoder.max_len} "
            f"tokens (ids in {skipped_log})")
    kept = [p for p in prompts if p.prompt_id in ids]
    if prompts and not kept:
        raise UserError(f"every prompt is longer than data.max_prompt_length={encoder.max_len} tokens; raise it")
    return kept


def check_template(tokenizer: Any) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError("data.apply_chat_template", True,
                          "false for this model: its tokenizer has no chat_template (a base model, or the "
                          "tokenizer_config.json of the instruct model was not copied into model.path)")
