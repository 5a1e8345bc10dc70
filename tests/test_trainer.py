"""Megatron trainer on CPU through the Ray group: HF parity, TP=2 / PP=2 parity, optimizer, checkpoints.

    pytest tests/test_trainer.py -q          # about 2 minutes on 2 cores; gloo, 1-2 Ray actors

Hardware: CPU only (gloo). Three layouts of the tiny Qwen2 model run one after another in the same local
Ray instance: TP=2 (2 actors), TP=1 (1 actor) and PP=2 (2 actors). Numbers are compared against
Hugging Face `transformers` and against each other.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch
from helpers import random_rl_samples

from megatron_sortedrl.config import RunConfig
from megatron_sortedrl.errors import CheckpointError
from megatron_sortedrl.sample import Sample

pytest.importorskip("ray")


def _cfg(model_dir: Path, tp: int = 1, pp: int = 1) -> RunConfig:
    cfg = RunConfig()
    cfg.model.path = str(model_dir)
    cfg.cluster.device = "cpu"
    cfg.parallel.tensor_model_parallel_size = tp
    cfg.parallel.pipeline_model_parallel_size = pp
    cfg.trainer.micro_batch_tokens = 48  # several micro-batches per step
    cfg.trainer.lr = 1e-3
    cfg.trainer.warmup_sft_lr = 3e-3
    return cfg


def _samples(n: int = 8, seed: int = 0) -> list[Sample]:
    return random_rl_samples(n, seed)


ADV = [1.0, -1.0, 0.5, -0.5, 1.0, -1.0, 0.25, -0.25]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from megatron_sortedrl.config import TinyModelConfig
    from megatron_sortedrl.tiny_model import build_tiny_model

    d = tmp_path_factory.mktemp("trainer") / "tiny"
    build_tiny_model(d, TinyModelConfig(seed=3))
    return d


@pytest.fixture(scope="module")
def tp2(model_dir, local_ray, tmp_path_factory):
    """Everything measured at TP=2, then the group is shut down to free the CPUs."""
    from megatron_sortedrl.trainer.group import TrainerGroup

    ckpt_root = tmp_path_factory.mktemp("ckpt")
    group = TrainerGroup(_cfg(model_dir, tp=2))
    try:
        samples = _samples()
        res = {"logprobs": group.compute_logprobs(samples), "lg": group.loss_and_grads(samples, ADV)}
        res["step"] = group.train_step(samples, ADV)
        res["after_logprobs"] = group.compute_logprobs(samples)
        res["ckpt"] = group.save_checkpoint(ckpt_root / "iter_0000001", extra={"cursor": 17})
        res["root"] = ckpt_root
        res["info"] = group.info
    finally:
        group.shutdown()
    return res


@pytest.fixture(scope="module")
def tp1(model_dir, local_ray, tp2):
    from megatron_sortedrl.trainer.group import TrainerGroup

    cfg = _cfg(model_dir)
    cfg.trainer.cpu_threads = 2  # the whole machine while the engines wait (tp2's ranks keep Ray's one thread)
    group = TrainerGroup(cfg)
    yield group
    group.shutdown()


def _max_diff(a: list[list[float]], b: list[list[float]]) -> float:
    assert [len(x) for x in a] == [len(y) for y in b]
    return max(abs(x - y) for xs, ys in zip(a, b) for x, y in zip(xs, ys))


def _hf_logprobs(model_dir: Path, samples: list[Sample]) -> list[list[float]]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for s in samples:
            seq = torch.tensor([s.prompt_tokens + s.response_tokens])
            logp = torch.log_softmax(hf(seq).logits[0, :-1].float(), dim=-1)
            tgt = seq[0, 1:]
            lp = logp.gather(-1, tgt[:, None])[:, 0]
            out.append(lp[len(s.prompt_tokens) - 1:].tolist())
    return out


def test_logprobs_match_transformers(tp1, tp2, model_dir):
    samples = _samples()
    ref = _hf_logprobs(model_dir, samples)
    d1 = _max_diff(tp1.compute_logprobs(samples), ref)
    d2 = _max_diff(tp2["logprobs"], ref)
    print(f"\nmax |logprob - transformers|: TP=1 {d1:.2e}, TP=2 {d2:.2e}")
    assert d1 < 1e-4 and d2 < 1e-4


def test_cpu_threads_reach_each_rank(tp1, tp2):
    assert [i["cpu_threads"] for i in tp1.info] == [2]
    assert [i["cpu_threads"] for i in tp2["info"]] == [1, 1]  # Ray's default: one thread per reserved CPU


def test_tp2_matches_tp1_loss_and_grads(tp1, tp2):
    samples = _samples()
    assert _max_diff(tp1.compute_logprobs(samples), tp2["logprobs"]) < 1e-5
    lg1, lg2 = tp1.loss_and_grads(samples, ADV), tp2["lg"]
    assert lg1["metrics"]["loss"] == pytest.approx(lg2["metrics"]["loss"], abs=1e-6)
    assert lg1["metrics"]["loss"] != 0.0
    assert set(lg1["grads"]) == set(lg2["grads"])
    for name, g in lg1["grads"].items():
        assert torch.allclose(g, lg2["grads"][name], atol=1e-6, rtol=1e-4), name
    assert sum(float(g.abs().sum()) for g in lg1["grads"].values()) > 0
    # the clipping norm counts TP-replicated norms and the tied embedding once: it is the HF-layout norm
    hf_norm = math.sqrt(sum(float((g.double() ** 2).sum()) for g in lg2["grads"].values()))
    assert tp2["step"]["grad_norm"] == pytest.approx(hf_norm, rel=1e-5)


def test_checkpoint_from_tp2_loads_at_tp1(tp1, tp2):
    samples = _samples()
    before = tp1.compute_logprobs(samples)
    extra = tp1.load_checkpoint(tp2["ckpt"])
    assert extra == {"cursor": 17}
    after = tp1.compute_logprobs(samples)
    assert _max_diff(after, tp2["after_logprobs"]) < 1e-5
    assert _max_diff(after, before) > 1e-4  # the checkpoint really changed the weights
    # optimizer state came along: the next update at TP=1 equals what TP=2 would have done is covered by
    # the PP test; here the step counter resumes
    assert tp1.train_step(samples, ADV)["step"] == 2.0


def test_incomplete_checkpoint_detected_and_previous_used(tp2, tmp_path):
    from megatron_sortedrl.trainer.checkpoint import MARKER, find_latest_checkpoint, read_meta

    root = tmp_path / "ckpts"
    good = Path(shutil.copytree(tp2["ckpt"], root / "iter_0000001"))
    bad = Path(shutil.copytree(tp2["ckpt"], root / "iter_0000002"))
    # a save that died mid-write: no marker, one shard cut in half
    (bad / MARKER).unlink()
    shard = max((p for p in bad.iterdir() if p.suffix == ".distcp"), key=lambda p: p.stat().st_size)
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="incomplete"):
        read_meta(bad)
    assert find_latest_checkpoint(root) == good
    (root / ".iter_0000003.partial").mkdir()  # leftovers of an interrupted save are ignored too
    assert find_latest_checkpoint(root) == good


def test_truncated_shard_in_marked_checkpoint_is_a_checkpoint_error(tp1, tp2, tmp_path):
    bad = Path(shutil.copytree(tp2["ckpt"], tmp_path / "iter_0000009"))
    for shard in bad.glob("*.distcp"):
        shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(CheckpointError):
        tp1.load_checkpoint(bad)


def test_optimizer_steps_lower_sft_loss_and_move_policy(tp1):
    samples = _samples(seed=5)
    pairs = [(s.prompt_tokens, s.response_tokens) for s in samples]
    w0 = tp1.export_hf_weights()
    losses = [tp1.sft_step(pairs)["loss"] for _ in range(4)]
    assert losses[-1] < losses[0] - 0.05, losses
    w1 = tp1.export_hf_weights()
    assert any(not torch.equal(w0[k], w1[k]) for k in w0)
    # RL steps raise the log-probs of positive-advantage samples relative to negative ones
    adv = [1.0 if i % 2 == 0 else -1.0 for i in range(len(samples))]
    lp0 = tp1.compute_logprobs(samples)
    for _ in range(3):
        m = tp1.train_step(samples, adv)
        assert m["skipped"] == 0.0 and math.isfinite(m["grad_norm"])
    lp1 = tp1.compute_logprobs(samples)
    delta = [sum(b) - sum(a) for a, b in zip(lp0, lp1)]
    assert sum(d for d, a in zip(delta, adv) if a > 0) > sum(d for d, a in zip(delta, adv) if a < 0)


def test_non_finite_loss_is_skipped_without_touching_parameters(tp1):
    samples = _samples(seed=7)
    w0 = tp1.export_hf_weights()
    m = tp1.train_step(samples, [float("nan")] + [1.0] * (len(samples) - 1))
    assert m["skipped"] == 1.0 and m["skipped_total"] >= 1.0
    w1 = tp1.export_hf_weights()
    assert all(torch.equal(w0[k], w1[k]) for k in w0)
    m2 = tp1.train_step(samples, [1.0] * len(samples))  # the next finite step goes through
    assert m2["skipped"] == 0.0 and m2["skipped_total"] == m["skipped_total"]


def test_rewards_give_grpo_advantages(tp1):
    samples = _samples(seed=9)
    adv = tp1.advantages(samples)
    # pairs share a prompt id: GRPO advantages of a pair are +-1 (or 0 when rewards tie)
    for i in range(0, len(samples), 2):
        assert adv[i] == pytest.approx(-adv[i + 1], abs=1e-5)


def test_export_hf_dir_loads_in_transformers(tp1, tmp_path):
    from transformers import AutoModelForCausalLM

    path = tp1.export_hf_weights(tmp_path / "hf")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    w = tp1.export_hf_weights()
    sd = hf.state_dict()
    assert all(torch.equal(sd[k], w[k]) for k in w)


@pytest.fixture(scope="module")
def pp2(model_dir, local_ray, tp2, tp1):
    from megatron_sortedrl.trainer.group import TrainerGroup

    tp1.shutdown()  # free the CPU for the second stage
    group = TrainerGroup(_cfg(model_dir, pp=2))
    yield group
    group.shutdown()


def test_pp2_matches_tp2_and_loads_tp2_checkpoint(pp2, tp2):
    samples = _samples()
    assert _max_diff(pp2.compute_logprobs(samples), tp2["logprobs"]) < 1e-5
    lg = pp2.loss_and_grads(samples, ADV)
    assert lg["metrics"]["loss"] == pytest.approx(tp2["lg"]["metrics"]["loss"], abs=1e-6)
    for name, g in lg["grads"].items():
        assert torch.allclose(g, tp2["lg"]["grads"][name], atol=1e-6, rtol=1e-4), name
    step = pp2.train_step(samples, ADV)
    assert step["loss"] == pytest.approx(tp2["step"]["loss"], abs=1e-6)
    assert step["grad_norm"] == pytest.approx(tp2["step"]["grad_norm"], rel=1e-5)
    assert _max_diff(pp2.compute_logprobs(samples), tp2["after_logprobs"]) < 1e-5
    pp2.load_checkpoint(tp2["ckpt"])
    assert _max_diff(pp2.compute_logprobs(samples), tp2["after_logprobs"]) < 1e-6
