"""Trainer coverage beyond the tiny Qwen2 default: a Llama-3 style model and data parallelism.

    pytest tests/test_trainer_archs.py -q -s      # CPU, gloo, 2 Ray actors per group, about a minute

* Llama-3 architecture (no qkv bias, untied embeddings, llama3 RoPE scaling) with a vocabulary that TP=2
  does not divide (127: padded to 128, the padding column masked): log-probs match `transformers`, and
  exporting gives back exactly the HF tensors (including `lm_head`).
* DP=2 on the tiny Qwen2 model: the same log-probs, loss and gradient norm as one replica.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from megatron_sortedrl.config import RunConfig
from megatron_sortedrl.sample import Sample

pytest.importorskip("ray")


def _cfg(path: Path, **parallel) -> RunConfig:
    cfg = RunConfig()
    cfg.model.path = str(path)
    cfg.cluster.device = "cpu"
    cfg.trainer.micro_batch_tokens = 48
    for k, v in parallel.items():
        setattr(cfg.parallel, k, v)
    return cfg


def _samples(vocab: int, n: int = 6) -> list[Sample]:
    g = torch.Generator().manual_seed(11)
    out = []
    for i in range(n):
        p = torch.randint(0, vocab, (int(torch.randint(2, 9, (1,), generator=g)),), generator=g).tolist()
        r = torch.randint(0, vocab, (int(torch.randint(1, 14, (1,), generator=g)),), generator=g).tolist()
        out.append(Sample(prompt_id=f"p{i // 2}", index=i % 2, prompt_tokens=p, response_tokens=r,
                          rollout_logprobs=[-4.8] * len(r), reward=float(i % 3 == 0)))
    return out


def _hf_logprobs(hf, samples):
    out = []
    with torch.no_grad():
        for s in samples:
            seq = torch.tensor([s.prompt_tokens + s.response_tokens])
            lp = torch.log_softmax(hf(seq).logits[0, :-1].float(), -1).gather(-1, seq[0, 1:, None])[:, 0]
            out.append(lp[len(s.prompt_tokens) - 1:].tolist())
    return out


def _max_diff(a, b):
    return max(abs(x - y) for xs, ys in zip(a, b) for x, y in zip(xs, ys))


def test_llama3_untied_odd_vocab_at_tp2(tmp_path, local_ray):
    from transformers import LlamaConfig, LlamaForCausalLM

    from megatron_sortedrl.trainer.group import TrainerGroup

    torch.manual_seed(0)
    hf_cfg = LlamaConfig(vocab_size=127, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         rope_theta=500000.0, tie_word_embeddings=False, rms_norm_eps=1e-5,
                         rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    hf = LlamaForCausalLM(hf_cfg).eval()
    with torch.no_grad():  # random, non-trivial norm weights so a mix-up between the two norms shows
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    hf.save_pretrained(tmp_path / "llama")
    samples = _samples(127)
    ref = _hf_logprobs(hf, samples)
    group = TrainerGroup(_cfg(tmp_path / "llama", tensor_model_parallel_size=2))
    try:
        diff = _max_diff(group.compute_logprobs(samples), ref)
        print(f"\nLlama-3 (untied, llama3 rope, vocab 127) at TP=2: max |logprob - transformers| = {diff:.2e}")
        assert diff < 1e-4
        exported = group.export_hf_weights()
    finally:
        group.shutdown()
    sd = hf.state_dict()
    assert "lm_head.weight" in exported and set(exported) == set(sd)
    assert all(torch.equal(exported[k], sd[k]) for k in sd)


def test_dp2_matches_single_replica(tmp_path, local_ray):
    from megatron_sortedrl.config import TinyModelConfig
    from megatron_sortedrl.tiny_model import build_tiny_model
    from megatron_sortedrl.trainer.group import TrainerGroup

    d = tmp_path / "tiny"
    build_tiny_model(d, TinyModelConfig(seed=3))
    samples = _samples(100, n=7)  # odd count: the replicas get different numbers of rows
    results = {}
    for dp in (1, 2):
        group = TrainerGroup(_cfg(d, data_parallel_size=dp))
        try:
            results[dp] = (group.compute_logprobs(samples), group.loss_and_grads(samples),
                           group.train_step(samples), group.compute_logprobs(samples))
        finally:
            group.shutdown()
    (lp1, lg1, st1, after1), (lp2, lg2, st2, after2) = results[1], results[2]
    assert _max_diff(lp1, lp2) < 1e-5
    assert lg2["metrics"]["loss"] == pytest.approx(lg1["metrics"]["loss"], abs=1e-6)
    assert lg2["metrics"]["n_tokens"] == lg1["metrics"]["n_tokens"] == sum(len(s.response_tokens) for s in samples)
    for k, g in lg1["grads"].items():
        assert torch.allclose(g, lg2["grads"][k], atol=1e-6, rtol=1e-4), k
    assert st2["grad_norm"] == pytest.approx(st1["grad_norm"], rel=1e-5) and math.isfinite(st1["grad_norm"])
    assert _max_diff(after1, after2) < 1e-5
