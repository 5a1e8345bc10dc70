"""GPU-only trainer paths: Transformer Engine layer spec, NCCL, bf16, distributed optimizer.

    pytest tests/test_trainer_gpu.py -m gpu -q -s     # needs an NVIDIA GPU and transformer_engine

Skipped (with the reason) on machines without CUDA or Transformer Engine. One GPU is enough: TP=PP=1,
so the distributed optimizer shards over a DP group of one, which still runs its code path.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from megatron_sortedrl.config import RunConfig, TinyModelConfig
from megatron_sortedrl.sample import Sample

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]


def _has_te() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.fixture(scope="module")
def gpu_group(tmp_path_factory):
    if not _has_te():
        pytest.skip("transformer_engine is not installed")
    import ray

    from megatron_sortedrl.tiny_model import build_tiny_model
    from megatron_sortedrl.trainer.group import TrainerGroup

    d = tmp_path_factory.mktemp("gpu") / "tiny"
    build_tiny_model(d, TinyModelConfig(seed=3))
    cfg = RunConfig()
    cfg.model.path = str(d)
    cfg.model.dtype = "bfloat16"
    cfg.cluster.device = "gpu"
    cfg.parallel.use_distributed_optimizer = True
    cfg.trainer.micro_batch_tokens = 64
    ray.init(address="local", num_cpus=4, num_gpus=1, include_dashboard=False, log_to_driver=False)
    group = TrainerGroup(cfg)
    yield group, d
    group.shutdown()
    ray.shutdown()


def _samples(n=8):
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        r = torch.randint(4, 100, (int(torch.randint(2, 16, (1,), generator=g)),), generator=g).tolist()
        s = Sample(prompt_id=f"p{i // 2}", index=i % 2, prompt_tokens=torch.randint(4, 100, (5,), generator=g).tolist(),
                   response_tokens=r, reward=float(i % 2))
        s.rollout_logprobs = [-4.8] * len(r)
        out.append(s)
    return out


def test_te_spec_logprobs_match_transformers(gpu_group):
    from transformers import AutoModelForCausalLM

    group, d = gpu_group
    assert group.info[0]["use_te"] and group.info[0]["device"] == "cuda"
    samples = _samples()
    got = group.compute_logprobs(samples)
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16).cuda().eval()
    diff = 0.0
    with torch.no_grad():
        for s, lp in zip(samples, got):
            seq = torch.tensor([s.prompt_tokens + s.response_tokens], device="cuda")
            ref = torch.log_softmax(hf(seq).logits[0, :-1].float(), -1).gather(-1, seq[0, 1:, None])[:, 0]
            diff = max(diff, (ref[len(s.prompt_tokens) - 1:].cpu() - torch.tensor(lp)).abs().max().item())
    print(f"\nGPU bf16 TE spec: max |logprob - transformers bf16| = {diff:.3e}")
    assert diff < 0.1  # bf16 kernels differ; float32 parity is pinned by the CPU tests


def test_distributed_optimizer_steps_and_checkpoint(gpu_group, tmp_path):
    group, _ = gpu_group
    samples = _samples()
    pairs = [(s.prompt_tokens, s.response_tokens) for s in samples]
    losses = [group.sft_step(pairs)["loss"] for _ in range(5)]
    print(f"\nGPU SFT losses: {[round(x, 4) for x in losses]}")
    assert losses[-1] < losses[0]
    m = group.train_step(samples)
    assert m["skipped"] == 0.0 and math.isfinite(m["grad_norm"])
    bad = group.train_step(samples, [float("nan")] * len(samples))
    assert bad["skipped"] == 1.0
    before = group.compute_logprobs(samples)
    path = group.save_checkpoint(tmp_path / "iter_0000001")
    group.sft_step(pairs)
    group.load_checkpoint(path)
    after = group.compute_logprobs(samples)
    assert max(abs(a - b) for x, y in zip(before, after) for a, b in zip(x, y)) < 1e-6
    assert Path(path, "COMPLETE.json").is_file()
