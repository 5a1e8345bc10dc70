"""A tiny policy whose responses repeat across epochs, for HistoSpec's tests and benchmark (CPU).

    from megatron_sortedrl.tiny_policy import train_tiny_policy, arithmetic_corpus
    prompts, responses = arithmetic_corpus(num_prompts=32, variants=2, seed=0)
    model_dir = train_tiny_policy(out_dir, prompts, responses, steps=300)

Builds the project's tiny Qwen2 model (`megatron_sortedrl.tiny_model`) and fine-tunes it with plain
torch on prompt + response + EOS (loss on response tokens only) until it has mostly memorised them:
the situation of an RL policy revisiting its training prompts, whose responses change little between
adjacent epochs. Giving a prompt several response variants leaves real entropy at the branch points,
which the lossless tests need at temperature 1.

Left out: anything RL (this is a supervised stand-in) and GPU training (seconds on CPU at this size).
"""

from __future__ import annotations

import random
from pathlib import Path

from megatron_sortedrl.config import TinyModelConfig
from megatron_sortedrl.tiny_model import build_tiny_model

EOS_ID = 0


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text).ids


def arithmetic_corpus(num_prompts: int, variants: int, seed: int, max_difficulty: int = 4,
                      min_difficulty: int = 1) -> tuple[list[str], list[list[str]]]:
    """Prompts of the built-in arithmetic task and `variants` responses each: the worked solution first,
    then copies with two digits of the first line changed (same length, different early tokens)."""
    from megatron_sortedrl.data.arithmetic import generate

    rng = random.Random(seed)
    prompts, responses = [], []
    for p in generate(num_prompts, seed, min_difficulty, max_difficulty):
        base = p.solution
        out = [base]
        for _ in range(variants - 1):
            chars = list(base)
            digits = [i for i, c in enumerate(chars[:8]) if c.isdigit()]
            for i in rng.sample(digits, min(2, len(digits))):
                chars[i] = str(rng.randint(0, 9))
            out.append("".join(chars))
        prompts.append(p.text)
        responses.append(out)
    return prompts, responses


def train_tiny_policy(out_dir: str | Path, prompts: list[str], responses: list[list[str]], steps: int = 300,
                      lr: float = 3e-3, batch_size: int = 32, seed: int = 0,
                      tiny: TinyModelConfig | None = None) -> Path:
    """Writes a fine-tuned tiny model to `out_dir` (an HF directory vLLM loads) and returns its path."""
    import torch
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    out = Path(out_dir)
    build_tiny_model(out, tiny or TinyModelConfig(seed=seed), overwrite=True)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    seqs: list[tuple[list[int], int]] = []
    for prompt, rs in zip(prompts, responses):
        p = encode(tok, prompt)
        for r in rs:
            seqs.append((p + encode(tok, r) + [EOS_ID], len(p)))
    torch.manual_seed(seed)
    # Eager attention on one thread: for a model this small, thread hand-offs and SDPA's mask building
    # cost more than the maths, and on a shared 2-core machine extra threads only contend.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager")
        loss = _fit(model, seqs, steps, lr, batch_size, seed)
    finally:
        torch.set_num_threads(threads)
    model.save_pretrained(out, safe_serialization=True)
    (out / "train_loss.txt").write_text(f"{loss:.4f}\n")
    return out


def _fit(model, seqs: list[tuple[list[int], int]], steps: int, lr: float, batch_size: int, seed: int) -> float:
    import torch

    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    rng = random.Random(seed)
    width = max(len(s) for s, _ in seqs)
    for step in range(steps):
        batch = [seqs[rng.randrange(len(seqs))] for _ in range(batch_size)]
        ids = torch.full((len(batch), width), EOS_ID, dtype=torch.long)
        labels = torch.full((len(batch), width), -100, dtype=torch.long)
        for b, (s, plen) in enumerate(batch):
            ids[b, :len(s)] = torch.tensor(s)
            labels[b, plen:len(s)] = torch.tensor(s[plen:])
        loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        for g in opt.param_groups:  # linear decay: ends near a minimum instead of bouncing around it
            g["lr"] = lr * (1 - step / steps)
        opt.step()
    model.eval()
    return float(loss.item())
