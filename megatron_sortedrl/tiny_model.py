"""The built-in tiny model: a Qwen2 (or Qwen3-MoE) causal LM with a character-level tokenizer.

    python -m megatron_sortedrl build-tiny-model --out runs/tiny_model      # or tools/build_tiny_model.py

Writes a standard Hugging Face directory (config.json, model.safetensors, generation_config.json,
tokenizer.json, tokenizer_config.json, special_tokens_map.json) that `transformers` and `vllm` load
offline. The tokenizer is a byte-level BPE with no merges (the same pipeline as Qwen2's tokenizer, which
`transformers` substitutes for any model_type=qwen2 directory), so every printable ASCII character and
newline is exactly one token and decoding is exact. Like Qwen2.5's tokenizer it has `<tool_call>`,
`</tool_call>`, `<tool_response>` and `</tool_response>` as single (non-special) added tokens, and a
Qwen2.5-style chat template with tool support (`CHAT_TEMPLATE`: a `tools=` list goes into the system turn,
tool messages become `<tool_response>` blocks in a user turn), so multi-turn tool rollouts run on it; the
procedural tasks keep using plain prompts unless `data.apply_chat_template` is set.

`model.tiny.architecture: qwen3_moe` builds a tiny Qwen3-MoE instead (`tiny_config`: every layer routed experts,
q/k norms, head_dim = hidden / heads; the built-in MoE run, configs/tiny_moe_cpu.yaml). `build_tiny_qwen3` writes
tiny Qwen3 and Qwen3-MoE models with perturbed norms and clear-cut routers (tests of those families).

Deliberately left out: any pretrained
weights (weights are randomly initialised with a seed; the RL driver warm-starts them on the task).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from megatron_sortedrl.config import TinyModelConfig

EOS = "<|endoftext|>"
SPECIAL_TOKENS = [EOS, "<|im_start|>", "<|im_end|>", "<unk>"]
CHARACTERS = ["\n"] + [chr(c) for c in range(32, 127)]
# Qwen2.5's tool tokens: single added tokens after the characters (ids 100-103), so a tool call's end is one
# token the engines can stop on (they run without a tokenizer, so they cannot match stop strings).
TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
VOCAB_SIZE = 128  # len(SPECIAL_TOKENS) + len(CHARACTERS) + len(TOOL_TOKENS) = 104, padded to a multiple of 64 (TP)

# Qwen2.5-Instruct's template, tool part kept verbatim in structure (shorter default system text): a `tools`
# list goes into the system turn as JSON lines, an assistant turn's `tool_calls` become <tool_call> blocks,
# consecutive tool messages share one user turn of <tool_response> blocks. Plain ASCII, which the character
# vocabulary covers (tests/test_trajectory.py checks it).
CHAT_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}"
    "{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}"
    "{{- '\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- else %}{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}{%- endif %}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) or "
    "(message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == 'assistant' %}{{- '<|im_start|>' + message.role }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}{%- if tool_call.function is defined %}"
    "{%- set tool_call = tool_call.function %}{%- endif %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' }}{{- tool_call.name }}{{- '\", \"arguments\": ' }}"
    "{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != 'tool') %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}"
    "{%- if loop.last or (messages[loop.index0 + 1].role != 'tool') %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def build_tokenizer():
    """Returns the character-level `tokenizers.Tokenizer` (ids: special tokens first, then characters)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    # Byte-level BPE stores each byte as a printable unicode stand-in (space is 'Ġ', newline 'Ċ').
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in CHARACTERS:
        vocab[_BYTE_TO_UNICODE[ord(ch)]] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(SPECIAL_TOKENS)
    tokenizer.add_tokens(TOOL_TOKENS)  # not special: decoded text keeps them (the reward sees the calls)
    return tokenizer


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table, used by every byte-level BPE."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


_BYTE_TO_UNICODE = _bytes_to_unicode()


def qwen2_config(tiny: TinyModelConfig) -> dict:
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "vocab_size": VOCAB_SIZE,
        "hidden_size": tiny.hidden_size,
        "intermediate_size": tiny.intermediate_size,
        "num_hidden_layers": tiny.num_layers,
        "num_attention_heads": tiny.num_attention_heads,
        "num_key_value_heads": tiny.num_key_value_heads,
        "head_dim": tiny.hidden_size // tiny.num_attention_heads,
        "hidden_act": "silu",
        "max_position_embeddings": tiny.max_position_embeddings,
        "rms_norm_eps": 1e-6,
        "rope_theta": tiny.rope_theta,
        "tie_word_embeddings": tiny.tie_word_embeddings,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "initializer_range": 0.02,
        "bos_token_id": SPECIAL_TOKENS.index(EOS),
        "eos_token_id": SPECIAL_TOKENS.index(EOS),
        "pad_token_id": SPECIAL_TOKENS.index(EOS),
        "torch_dtype": "float32",
    }


def tiny_config(tiny: TinyModelConfig) -> dict:
    """The config.json of the tiny model `tiny` describes (`model.tiny.architecture`)."""
    if tiny.architecture == "qwen2":
        return qwen2_config(tiny)
    base = qwen2_config(tiny)
    return qwen3_config(True, **{k: base[k] for k in (
        "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
        "head_dim", "max_position_embeddings", "rope_theta", "tie_word_embeddings")},
        num_experts=tiny.num_experts, num_experts_per_tok=tiny.num_experts_per_tok,
        moe_intermediate_size=tiny.moe_intermediate_size)


def build_tiny_model(out: str | Path, tiny: TinyModelConfig | None = None, overwrite: bool = False) -> Path:
    """Writes the tiny model directory at `out` and returns its path.

    The directory appears atomically (written to a temporary sibling, then renamed), so an interrupted
    build never leaves a half-written model that a later run would try to load.
    """
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    tiny = tiny or TinyModelConfig()
    out = Path(out)
    if out.exists() and not overwrite:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        torch.manual_seed(tiny.seed)
        if tiny.architecture == "qwen3_moe":
            model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**tiny_config(tiny))).to(torch.float32)
        else:
            model = Qwen2ForCausalLM(Qwen2Config(**qwen2_config(tiny))).to(torch.float32)
        model.save_pretrained(tmp, safe_serialization=True)
        _write_tokenizer_files(tmp, tiny.max_position_embeddings)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def _write_tokenizer_files(d: Path, max_positions: int) -> None:
    build_tokenizer().save(str(d / "tokenizer.json"))
    eos_id = SPECIAL_TOKENS.index(EOS)
    (d / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "Qwen2Tokenizer",
        "eos_token": EOS, "pad_token": EOS, "unk_token": "<unk>", "bos_token": None,
        "model_max_length": max_positions,
        "clean_up_tokenization_spaces": False,
        "add_bos_token": False, "add_eos_token": False,
        "chat_template": CHAT_TEMPLATE,
    }, indent=2))
    (d / "special_tokens_map.json").write_text(json.dumps({"eos_token": EOS, "pad_token": EOS, "unk_token": "<unk>"}))
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": eos_id, "pad_token_id": eos_id}))


def qwen3_config(moe: bool = False, **overrides) -> dict:
    """A tiny Qwen3 (dense) or Qwen3-MoE config: head_dim 32 (not hidden / heads = 16, and one vLLM's CPU
    attention supports), q/k norms, untied embeddings, 4 experts of which 2 per token for MoE."""
    cfg = {
        "architectures": ["Qwen3MoeForCausalLM" if moe else "Qwen3ForCausalLM"],
        "model_type": "qwen3_moe" if moe else "qwen3",
        "vocab_size": VOCAB_SIZE, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "hidden_act": "silu",
        "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False,
        "attention_bias": False, "attention_dropout": 0.0, "use_sliding_window": False, "initializer_range": 0.02,
        "bos_token_id": SPECIAL_TOKENS.index(EOS), "eos_token_id": SPECIAL_TOKENS.index(EOS),
        "pad_token_id": SPECIAL_TOKENS.index(EOS), "torch_dtype": "float32",
    }
    if moe:
        cfg.update({"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "norm_topk_prob": True,
                    "decoder_sparse_step": 1, "mlp_only_layers": [], "router_aux_loss_coef": 0.0})
    cfg.update(overrides)
    return cfg


def build_tiny_qwen3(out: str | Path, moe: bool = False, seed: int = 0, **overrides) -> Path:
    """Writes a tiny random Qwen3 or Qwen3-MoE model directory (float32, the character tokenizer) at `out`.

    Norm weights (q/k norms included) are drawn from [0.5, 1.5] rather than left at 1, so that a norm loaded
    into the wrong place changes the output; the router's weights are scaled up so that routing decisions
    are clear-cut (no near-ties between the k-th and (k+1)-th expert that rounding could flip)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = qwen3_config(moe, **overrides)
    torch.manual_seed(seed)
    model = (Qwen3MoeForCausalLM(Qwen3MoeConfig(**cfg)) if moe else Qwen3ForCausalLM(Qwen3Config(**cfg)))
    model = model.to(torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
            elif name.endswith("mlp.gate.weight"):
                param.normal_(0.0, 0.5)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    _write_tokenizer_files(out, cfg["max_position_embeddings"])
    return out
