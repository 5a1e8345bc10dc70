"""Chunked vocab-parallel log-probs and entropy equal the unchunked reference, values and gradients.

    pytest tests/test_logprobs_chunked.py -q        # CPU, gloo; TP=2 runs in two spawned processes (~15 s)

The reference is plain autograd over the whole vocabulary: logits / temperature, vLLM's own top-k/top-p
mask (`apply_top_k_top_p_pytorch`, the function the CPU engine runs), log-softmax. The chunked function is
run with a chunk size that divides nothing, a vocabulary TP=2 does not divide (its padding column holds
junk that must be masked), and at TP=2 each rank sees only its vocabulary slice.
"""

from __future__ import annotations

import os
import socket

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron_sortedrl.trainer.logprobs import (
    Sampling,
    token_logprobs,
    token_logprobs_and_entropy,
)

VOCAB, PADDED, B, S, CHUNK = 37, 38, 3, 7, 5
CASES = [Sampling(), Sampling(0.7, 0.9), Sampling(0.7, 0.9, 5), Sampling(1.3, 1.0, 4)]


def _inputs(sampling: Sampling, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, S, PADDED, generator=g) * 2.5
    logits[..., VOCAB:] = 9.0  # junk in the TP padding column: must never count
    probs = _reference(logits, None, sampling)[2].exp()
    labels = torch.multinomial(probs.view(-1, VOCAB), 1, generator=g).view(B, S)  # sampled: inside the nucleus
    w_lp, w_ent = torch.randn(B, S, generator=g), torch.randn(B, S, generator=g)
    return logits, labels, w_lp, w_ent


def _reference(logits, labels, sampling: Sampling):
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    z = logits[..., :VOCAB].double() / sampling.scale
    flat = z.reshape(-1, VOCAB)
    if sampling.truncates:
        n = flat.shape[0]
        k = torch.full((n,), sampling.top_k) if sampling.top_k > 0 else None
        p = torch.full((n,), sampling.top_p, dtype=flat.dtype) if sampling.top_p < 1 else None
        cut = apply_top_k_top_p_pytorch(flat.detach().clone(), k, p).isneginf()  # the mask; no gradient
        flat = flat.masked_fill(cut, float("-inf"))
    logp = torch.log_softmax(flat, dim=-1).view(B, S, VOCAB)
    ent = -(logp.exp() * torch.nan_to_num(logp, neginf=0.0)).sum(-1)
    lp = logp.gather(-1, labels[..., None])[..., 0] if labels is not None else None
    return lp, ent, logp


def _reference_grads(sampling: Sampling, seed: int = 0):
    logits, labels, w_lp, w_ent = _inputs(sampling, seed)
    x = logits.double().requires_grad_()
    lp, ent, _ = _reference(x, labels, sampling)
    ((lp * w_lp).sum() + (ent * w_ent).sum()).backward()
    return lp.detach(), ent.detach(), x.grad


@pytest.mark.parametrize("sampling", CASES, ids=str)
def test_chunked_equals_reference_at_tp1(sampling, monkeypatch):
    monkeypatch.setattr("megatron_sortedrl.trainer.logprobs.SORT_ELEMENTS", 2 * PADDED)  # nucleus 2 rows at a time
    logits, labels, w_lp, w_ent = _inputs(sampling)
    ref_lp, ref_ent, ref_grad = _reference_grads(sampling)
    x = logits.clone().requires_grad_()
    lp, ent = token_logprobs_and_entropy(x, labels, VOCAB, sampling, chunk_tokens=CHUNK)
    ((lp * w_lp).sum() + (ent * w_ent).sum()).backward()
    torch.testing.assert_close(lp.double(), ref_lp, atol=2e-5, rtol=0)
    torch.testing.assert_close(ent.double(), ref_ent, atol=2e-5, rtol=0)
    torch.testing.assert_close(x.grad.double(), ref_grad, atol=2e-5, rtol=0)
    assert x.grad[..., VOCAB:].abs().max() == 0
    # chunk size does not change anything, and log-probs alone give the log-prob part of the gradient
    y = logits.clone().requires_grad_()
    (token_logprobs(y, labels, VOCAB, sampling, chunk_tokens=1000) * w_lp).sum().backward()
    z = logits.double().requires_grad_()
    (_reference(z, labels, sampling)[0] * w_lp).sum().backward()
    torch.testing.assert_close(y.grad.double(), z.grad, atol=2e-5, rtol=0)


def test_entropy_without_gradient_skips_its_backward():
    sampling = Sampling(0.7, 0.9)
    logits, labels, w_lp, _ = _inputs(sampling)
    x = logits.clone().requires_grad_()
    lp, ent = token_logprobs_and_entropy(x, labels, VOCAB, sampling, chunk_tokens=CHUNK)
    (lp * w_lp + ent.detach() * 0).sum().backward()
    z = logits.double().requires_grad_()
    (_reference(z, labels, sampling)[0] * w_lp).sum().backward()
    torch.testing.assert_close(x.grad.double(), z.grad, atol=2e-5, rtol=0)


def test_label_outside_the_nucleus_stays_finite():
    sampling = Sampling(1.0, 0.5)
    logits, _, _, _ = _inputs(sampling)
    labels = logits[..., :VOCAB].argmin(-1)  # never inside a 0.5 nucleus
    lp = token_logprobs(logits, labels, VOCAB, sampling, chunk_tokens=CHUNK)
    assert torch.isfinite(lp).all()
    # ... and equals the label's log-prob under the nucleus with the label added
    _, _, logp = _reference(logits, labels, Sampling(1.0, 1.0))
    assert (lp < logp.gather(-1, labels[..., None])[..., 0] + 1e-5).logical_not().all()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tp2_worker(rank: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_sortedrl.trainer import cpu_compat

    cpu_compat.activate()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    ps.initialize_model_parallel(2, 1)
    results = {}
    for sampling in CASES:
        logits, labels, w_lp, w_ent = _inputs(sampling)
        half = PADDED // 2
        x = logits[..., rank * half:(rank + 1) * half].clone().requires_grad_()
        lp, ent = token_logprobs_and_entropy(x, labels, VOCAB, sampling, chunk_tokens=CHUNK)
        ((lp * w_lp).sum() + (ent * w_ent).sum()).backward()
        results[str(sampling)] = (lp.detach(), ent.detach(), x.grad)
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    ps.destroy_model_parallel()
    dist.destroy_process_group()


def test_chunked_equals_reference_at_tp2(tmp_path):
    torch.multiprocessing.spawn(_tp2_worker, args=(_free_port(), str(tmp_path)), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for sampling in CASES:
        ref_lp, ref_ent, ref_grad = _reference_grads(sampling)
        grad = torch.cat([ranks[r][str(sampling)][2] for r in range(2)], dim=-1)
        for r in range(2):  # every rank holds the full per-token values
            torch.testing.assert_close(ranks[r][str(sampling)][0].double(), ref_lp, atol=2e-5, rtol=0)
            torch.testing.assert_close(ranks[r][str(sampling)][1].double(), ref_ent, atol=2e-5, rtol=0)
        torch.testing.assert_close(grad.double(), ref_grad, atol=2e-5, rtol=0)
        assert grad[..., VOCAB:].abs().max() == 0
