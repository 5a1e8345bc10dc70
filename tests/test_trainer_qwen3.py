"""Qwen3 and Qwen3-MoE in the Megatron trainer, on CPU with gloo: log-probs equal to `transformers` within 1e-4
(float32) and loss and gradients equal to the single-rank run, at TP2, EP2, PP2 and their combinations.

    pytest tests/test_trainer_qwen3.py -q -s                 # default: the essential layouts, a few minutes
    pytest tests/test_trainer_qwen3.py -q -s -m slow         # the 4-rank combinations (PP2 x EP2, TP2 x PP2 x EP2)

Each layout is one world of spawned processes running `TrainerWorker` directly (no Ray); the tiny models come
from `tiny_model.build_tiny_qwen3` (head_dim 32 != hidden / heads, random q/k norm weights, 4 experts, top-2,
norm_topk_prob). Gradients come back in Hugging Face layout (`loss_and_grads`), so a wrong expert placement,
EP gather or gradient scaling shows as a named tensor.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from megatron_sortedrl.tiny_model import build_tiny_qwen3
from helpers import random_train_items, rank0_port


def _rank(rank: int, world: int, model_dir: str, layout: dict, ports, out_dir: str) -> None:
    from megatron_sortedrl.config import RunConfig
    from megatron_sortedrl.trainer.worker import TrainerWorker

    torch.set_num_threads(1)
    cfg = RunConfig()
    cfg.model.path = model_dir
    cfg.cluster.device = "cpu"
    cfg.trainer.micro_batch_tokens = 48  # several micro-batches
    for key, value in layout.items():
        setattr(cfg.parallel, key, value)
    w = TrainerWorker(cfg, rank, world, "127.0.0.1", rank0_port(rank, world, ports))
    w.setup()
    items = random_train_items()
    res = {"rank": rank, "reporter": w.reporter, "logprobs": w.logprobs(items)}
    lg = w.loss_and_grads(items, "rl")
    res.update(metrics=lg.get("metrics"), grads=lg.get("grads"))
    w.shutdown()
    torch.save(res, Path(out_dir) / f"{rank}.pt")


def run_layout(tmp: Path, model_dir: Path, **layout) -> dict:
    """Log-probs (all DP replicas merged), metrics and HF-layout gradients of one trainer layout."""
    p = layout
    world = (p.get("tensor_model_parallel_size", 1) * p.get("pipeline_model_parallel_size", 1)
             * p.get("data_parallel_size", 1))
    out = tmp / "_".join(f"{k.split('_')[0]}{v}" for k, v in layout.items()) if layout else tmp / "single"
    out.mkdir(parents=True)
    ports = mp.get_context("spawn").Queue()
    mp.start_processes(_rank, args=(world, str(model_dir), layout, ports, str(out)), nprocs=world, join=True,
                       start_method="spawn")
    parts = [torch.load(f, weights_only=False) for f in sorted(out.glob("*.pt"))]
    logprobs = {}
    for r in parts:
        if r["reporter"]:
            logprobs.update(r["logprobs"])
    first = next(r for r in parts if r["rank"] == 0)
    metrics = next(r["metrics"] for r in parts if r["reporter"] and r["metrics"])
    return {"logprobs": [logprobs[i] for i in range(len(logprobs))], "metrics": metrics, "grads": first["grads"]}


def hf_logprobs(model_dir: Path) -> list[list[float]]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for it in random_train_items():
            seq = torch.tensor([it["prompt"] + it["response"]])
            lp = torch.log_softmax(hf(seq).logits[0, :-1].float(), -1).gather(-1, seq[0, 1:, None])[:, 0]
            out.append(lp[len(it["prompt"]) - 1:].tolist())
    return out


def max_diff(a, b) -> float:
    assert [len(x) for x in a] == [len(y) for y in b]
    return max(abs(x - y) for xs, ys in zip(a, b) for x, y in zip(xs, ys))


def assert_same_training(run: dict, ref: dict) -> None:
    assert run["metrics"]["loss"] == pytest.approx(ref["metrics"]["loss"], abs=1e-6)
    assert run["metrics"]["n_tokens"] == ref["metrics"]["n_tokens"]
    assert set(run["grads"]) == set(ref["grads"])
    for name, g in ref["grads"].items():
        assert torch.allclose(run["grads"][name], g, atol=1e-6, rtol=1e-4), name


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory) -> Path:
    return build_tiny_qwen3(tmp_path_factory.mktemp("q3") / "qwen3", moe=False, seed=1)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> Path:
    return build_tiny_qwen3(tmp_path_factory.mktemp("q3") / "qwen3_moe", moe=True, seed=2)


@pytest.fixture(scope="module")
def moe_single(moe_dir, tmp_path_factory) -> dict:
    return run_layout(tmp_path_factory.mktemp("runs"), moe_dir)


def test_qwen3_dense_tp2_matches_transformers_and_one_rank(dense_dir, tmp_path):
    ref = hf_logprobs(dense_dir)
    single = run_layout(tmp_path, dense_dir)
    tp2 = run_layout(tmp_path, dense_dir, tensor_model_parallel_size=2)
    for name, run in (("TP1", single), ("TP2", tp2)):
        diff = max_diff(run["logprobs"], ref)
        print(f"\nQwen3 dense {name}: max |logprob - transformers| = {diff:.2e}")
        assert diff < 1e-4
    assert any(n.endswith("self_attn.q_norm.weight") for n in single["grads"])
    assert float(single["grads"]["model.layers.0.self_attn.k_norm.weight"].abs().sum()) > 0
    assert_same_training(tp2, single)


def test_qwen3_moe_ep2_matches_transformers_and_one_rank(moe_dir, moe_single, tmp_path):
    ref = hf_logprobs(moe_dir)
    ep2 = run_layout(tmp_path, moe_dir, data_parallel_size=2, expert_model_parallel_size=2)
    for name, run in (("single rank", moe_single), ("EP2 (DP2)", ep2)):
        diff = max_diff(run["logprobs"], ref)
        print(f"\nQwen3-MoE {name}: max |logprob - transformers| = {diff:.2e}")
        assert diff < 1e-4
    experts = [n for n in moe_single["grads"] if ".mlp.experts." in n]
    assert len(experts) == 2 * 4 * 3 and all(float(moe_single["grads"][n].abs().sum()) > 0 for n in experts)
    assert float(moe_single["grads"]["model.layers.1.mlp.gate.weight"].abs().sum()) > 0  # the router learns
    assert_same_training(ep2, moe_single)


def test_qwen3_moe_tp2_ep2_matches_transformers_and_one_rank(moe_dir, moe_single, tmp_path):
    run = run_layout(tmp_path, moe_dir, tensor_model_parallel_size=2, expert_model_parallel_size=2,
                     expert_tensor_parallel_size=1)
    diff = max_diff(run["logprobs"], hf_logprobs(moe_dir))
    print(f"\nQwen3-MoE TP2 x EP2: max |logprob - transformers| = {diff:.2e}")
    assert diff < 1e-4
    assert_same_training(run, moe_single)


@pytest.mark.slow
@pytest.mark.parametrize("layout", [
    {"pipeline_model_parallel_size": 2},
    {"tensor_model_parallel_size": 2},
    {"pipeline_model_parallel_size": 2, "data_parallel_size": 2, "expert_model_parallel_size": 2},
    {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2, "expert_model_parallel_size": 2,
     "expert_tensor_parallel_size": 1},
    {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2},  # experts split by expert TP = TP
], ids=["pp2", "tp2_etp2", "pp2_ep2", "tp2_pp2_ep2", "tp2_pp2_etp2"])
def test_qwen3_moe_combinations(moe_dir, moe_single, tmp_path, layout):
    run = run_layout(tmp_path, moe_dir, **layout)
    diff = max_diff(run["logprobs"], hf_logprobs(moe_dir))
    print(f"\nQwen3-MoE {layout}: max |logprob - transformers| = {diff:.2e}")
    assert diff < 1e-4
    assert_same_training(run, moe_single)
