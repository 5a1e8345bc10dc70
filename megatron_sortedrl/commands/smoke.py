"""`python -m megatron_sortedrl smoke [config.yaml] [key=value ...] [--prompts N]`: the smallest real job.

Builds the configured model directory if missing (the tiny model by default), loads the prompts of the
config, generates greedy responses with `transformers` on CPU and scores them with the configured reward
function. It checks an installation end to end without Ray, Megatron or vLLM; `train` is the real run.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from megatron_sortedrl.cli import add_config_arguments, config_from_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    parser.add_argument("--prompts", type=int, default=4, help="prompts to generate and score")


def run(args: argparse.Namespace) -> int:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_sortedrl.data import load_prompts
    from megatron_sortedrl.errors import UserError
    from megatron_sortedrl.rewards import load_reward_fn, reward_path
    from megatron_sortedrl.sample import Sample
    from megatron_sortedrl.tiny_model import build_tiny_model

    cfg = config_from_args(args)
    model_dir = Path(cfg.model.path)
    if not model_dir.exists():
        if not cfg.model.build_tiny_if_missing:
            raise UserError(f"model directory {model_dir} not found; set model.path or model.build_tiny_if_missing=true")
        build_tiny_model(model_dir, cfg.model.tiny)
        print(f"built tiny model at {model_dir}")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    reward_fn = load_reward_fn(reward_path(cfg.data))
    prompts = load_prompts(cfg.data, "eval")[: args.prompts]
    start, total = time.monotonic(), 0.0
    for prompt in prompts:
        ids = tokenizer(prompt.text, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=min(64, cfg.rollout.max_response_length), do_sample=False,
                                 pad_token_id=tokenizer.eos_token_id)
        sample = Sample(prompt_id=prompt.prompt_id, index=0, prompt_tokens=ids[0].tolist(),
                        response_tokens=out[0, ids.shape[1]:].tolist())
        sample.response_text = tokenizer.decode(sample.response_tokens, skip_special_tokens=True)
        sample.reward = reward_fn(sample, prompt.ground_truth)
        total += sample.reward
        print(f"{prompt.prompt_id}: {sample.response_length} tokens, reward {sample.reward:.1f}, truth {prompt.ground_truth!r}")
    print(f"smoke: mean reward {total / max(1, len(prompts)):.3f} over {len(prompts)} prompts "
          f"in {time.monotonic() - start:.1f}s (an untrained model scores about 0)")
    return 0
