"""GPU-only paths of Qwen3 and Qwen3-MoE: the Transformer Engine spec with q/k norms, and experts as one
grouped GEMM (`TEGroupedMLP`, named `mlp.experts.linear_fc1.weight{e}` in the weight table).

    pytest tests/test_trainer_qwen3_gpu.py -m gpu -q -s        # needs an NVIDIA GPU (and TE for the grouped GEMM)

A single-rank `TrainerWorker` (world size 1, NCCL, no Ray) loads the tiny models in float32 through the weight
table and must give `transformers`' log-probs within 1e-4, and the same loss and gradients as the CPU run of
tests/test_trainer_qwen3.py would (checked here against a sequential-experts run on the same GPU: grouped
GEMM switched off by `model.moe_grouped_gemm=false`). The CPU fallback of all of it is tested there.
"""

from __future__ import annotations

import socket

import pytest
import torch

from megatron_sortedrl.tiny_model import build_tiny_qwen3

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _items() -> list[dict]:
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(4):
        p = torch.randint(4, 100, (int(torch.randint(3, 10, (1,), generator=g)),), generator=g).tolist()
        r = torch.randint(4, 100, (int(torch.randint(2, 16, (1,), generator=g)),), generator=g).tolist()
        out.append({"prompt": p, "response": r, "mask": None,
                    "extras": {"advantages": [1.0 - 0.5 * i] * len(r), "rollout_logprobs": [-4.8] * len(r)}})
    return out


def _run(model_dir, grouped: bool):
    pytest.importorskip("megatron.core")
    from megatron_sortedrl.config import RunConfig
    from megatron_sortedrl.trainer.worker import TrainerWorker

    cfg = RunConfig()
    cfg.model.path, cfg.cluster.device, cfg.model.moe_grouped_gemm = str(model_dir), "gpu", grouped
    w = TrainerWorker(cfg, 0, 1, "127.0.0.1", _free_port())
    try:
        w.setup()
        config = w.module.config
        lp = w.logprobs(_items())
        lg = w.loss_and_grads(_items(), "rl")
        return {"use_te": w.use_te, "grouped": bool(config.moe_grouped_gemm), "logprobs": lp, **lg}
    finally:
        w.shutdown()


def _hf(model_dir) -> list[list[float]]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).cuda().eval()
    out = []
    with torch.no_grad():
        for it in _items():
            seq = torch.tensor([it["prompt"] + it["response"]], device="cuda")
            lp = torch.log_softmax(hf(seq).logits[0, :-1].float(), -1).gather(-1, seq[0, 1:, None])[:, 0]
            out.append(lp[len(it["prompt"]) - 1:].tolist())
    return out


@pytest.mark.parametrize("moe", [False, True], ids=["qwen3", "qwen3_moe"])
def test_gpu_qwen3_matches_transformers_and_grouped_gemm_matches_sequential(tmp_path, moe):
    d = build_tiny_qwen3(tmp_path / "m", moe=moe, seed=7)
    ref = _hf(d)
    grouped = _run(d, grouped=True)
    assert grouped["grouped"] == (moe and grouped["use_te"])  # grouped GEMM exactly where TE runs the experts
    diff = max(abs(a - b) for i, xs in enumerate(ref) for a, b in zip(xs, grouped["logprobs"][i]))
    print(f"\nGPU {'Qwen3-MoE' if moe else 'Qwen3'} (TE: {grouped['use_te']}): max |logprob - transformers| = {diff:.2e}")
    assert diff < 1e-4
    if moe and grouped["grouped"]:
        seq = _run(d, grouped=False)
        assert not seq["grouped"]
        assert grouped["metrics"]["loss"] == pytest.approx(seq["metrics"]["loss"], abs=1e-5)
        for name, g in seq["grads"].items():
            assert torch.allclose(grouped["grads"][name], g, atol=1e-5, rtol=1e-3), name
