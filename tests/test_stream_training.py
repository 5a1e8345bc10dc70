"""Stream training: gradients of prompt groups added one part at a time, one optimizer step at the end, give
the same parameters as one batch update on the same samples.

    pytest tests/test_stream_training.py -q          # TP=1 Megatron trainers on CPU (gloo), in subprocesses

Hardware: CPU only. One trainer makes the batch update; a second, from the same weights and a fresh
optimizer, gets the same samples streamed in parts of whole prompt groups (within 1e-6 when the parts come in
another order than the batch's micro-batches; bit-identical updates for every estimator and shaping option,
and DP=2: tests/test_stream_exact.py). The driver hook is checked against the real sync and twotier policies
with a recording stand-in for the trainer.
"""

from __future__ import annotations

import pytest
import torch
from helpers import random_rl_samples
from stream_support import in_process_group, model_dir, run_child  # noqa: F401 - model_dir is a fixture

from megatron_sortedrl.config import RunConfig, load_config
from megatron_sortedrl.errors import ConfigError
from megatron_sortedrl.sample import Sample


def _samples(n: int = 8, seed: int = 11) -> list[Sample]:
    return random_rl_samples(n, seed)




def _parity(model_dir: str, out) -> None:
    """A TP=1 worker makes the batch update; a second one from the same weights streams the batch in three
    parts (interleaved with the batch's length order)."""
    from megatron_sortedrl.trainer.stream import StreamedUpdate

    InProcessGroup = in_process_group

    cfg = RunConfig()
    cfg.model.path = model_dir
    cfg.cluster.device = "cpu"
    cfg.trainer.micro_batch_tokens = 48  # several micro-batches per part
    # RL learning rates are small; at 1e-3 Adam's first step (about lr * sign(g)) turns float32 rounding of
    # gradient elements below its eps (different micro-batch packing per part) into up to 3.5e-5 of parameter
    # difference, so the gradients are compared directly as well.
    cfg.trainer.lr = 1e-5
    samples = _samples()

    def grads(worker, scale=1.0):
        return {n: p.main_grad.detach().clone() * scale for n, p in worker.module.named_parameters()}

    # Two trainers in turn from the same weights and a fresh optimizer: one batch update, one streamed.
    group = InProcessGroup(cfg)
    try:
        from megatron_sortedrl.trainer.optimizer import zero_grads

        adv = group.advantages(samples)  # GRPO per prompt group: the parts below hold whole groups
        w0 = group.export_hf_weights()
        group.worker._forward_backward(group._rl_items(samples, adv, None), "rl")
        g_batch = grads(group.worker)
        zero_grads(group.worker.opt, [group.worker.model])
        batch = group.train_step(samples, adv)
        w_batch = group.export_hf_weights()
    finally:
        group.worker.shutdown()
    group = InProcessGroup(cfg)
    try:
        restored = all(torch.equal(w0[k], v) for k, v in group.export_hf_weights().items())
        update = StreamedUpdate(group)
        for lo, hi in ((0, 2), (2, 6), (6, 8)):
            update.add(samples[lo:hi], adv[lo:hi])
        tokens = sum(len(x.response_tokens) for x in samples)  # token aggregation: the batch's count
        g_stream = grads(group.worker, 1.0 / tokens)
        streamed = update.step()
        w_stream = group.export_hf_weights()
    finally:
        group.worker.shutdown()
    gmax = max(float(g.abs().max()) for g in g_batch.values())
    gdiff = max(float((g_batch[k] - g_stream[k]).abs().max()) for k in g_batch)
    out.put({"adv": adv, "restored": restored, "batch": batch, "streamed": streamed,
             "moved": max(float((w_batch[k] - w0[k]).abs().max()) for k in w0),
             "diff": max(float((w_batch[k] - w_stream[k]).abs().max()) for k in w0),
             "grad_max": gmax, "grad_diff": gdiff})


def test_streamed_update_equals_batch_update(model_dir):
    res = run_child(_parity, str(model_dir))
    assert any(a != 0 for a in res["adv"]) and res["restored"]
    assert res["moved"] > 5e-6  # the update did something (about lr per element)
    assert res["diff"] <= 1e-6, res["diff"]
    assert res["grad_diff"] <= 1e-6 * max(1.0, res["grad_max"]), (res["grad_diff"], res["grad_max"])
    streamed, batch = res["streamed"], res["batch"]
    assert streamed["stream_parts"] == 3 and streamed["skipped"] == batch["skipped"] == 0.0
    assert streamed["loss"] == pytest.approx(batch["loss"], rel=1e-5, abs=1e-7)
    assert streamed["grad_norm"] == pytest.approx(batch["grad_norm"], rel=1e-5)


def test_stream_option_is_typed():
    cfg = load_config(None, ["model.path=/nonexistent/tiny", "trainer.stream=true"])
    assert cfg.trainer.stream is True
    with pytest.raises(ConfigError):
        load_config(None, ["model.path=/nonexistent/tiny", "trainer.stream=sometimes"])


class FakeGroup:
    """Records what the driver hook asks the trainer for (the real update is tested above)."""

    def __init__(self):
        self.calls = []

    def advantages(self, samples):
        return [1.0] * len(samples)

    def _rl_decisions(self, samples, advantages):
        return [(float(a), False, False) for a in advantages]

    def _rl_items(self, samples, advantages, old):
        return [s.sample_id for s in samples]

    def _all(self, method, *args):
        self.calls.append((method, sorted(args[0]) if method == "stream_accumulate" else None))
        return [{}]

    def _submit(self, method, *args):
        self._all(method, *args)
        return []

    def _report(self, outs):
        return outs[0]

    def train_step(self, batch, advantages):
        self.calls.append(("train_step", sorted(s.sample_id for s in batch)))
        return {}


def _finish(policy, sample, clock, stream):
    sample.append([5, 6, 7], [-1.0] * 3, policy.version)
    sample.reward = float(sample.index)
    policy.on_sample_finished(sample, clock)
    stream.on_finished(sample)


def test_driver_hook_streams_only_groups_that_will_be_trained():
    from dataclasses import replace

    from scheduler.layout import make_planner
    from scheduler.policies import make_policy
    from scheduler.protocol import ManualClock
    from megatron_sortedrl.trainer.stream import DriverStream

    base = load_config(None, ["model.path=/nonexistent/tiny"]).scheduler
    clock = ManualClock()
    for name in ("sync", "twotier"):
        cfg = replace(base, policy=name, rollout_batch_size=2, update_batch_size=4, group_size=2)
        policy = make_policy(cfg, ["a", "b"], n_samples=2, max_response_length=16,
                             planner=make_planner("fixed", gpus=1, gpus_per_node=1, tp_short=1, tp_long=1), num_epochs=1)
        group = FakeGroup()
        stream = DriverStream(group, policy)
        rnd = policy.compose_round(clock)
        samples = [r.sample for r in rnd.requests]
        first = [s for s in samples if s.prompt_id == samples[0].prompt_id]
        for s in first:
            _finish(policy, s, clock, stream)
        if name == "sync":  # every prompt of a sync round is trained: streamed as soon as complete
            assert group.calls == [("stream_accumulate", sorted(s.sample_id for s in first))]
        else:  # twotier decides at harvest for fresh prompts: nothing streamed
            assert group.calls == []
        for s in samples:
            if s not in first:
                _finish(policy, s, clock, stream)
        harvest = policy.harvest(clock)
        stream.train(harvest.batch, [1.0] * len(harvest.batch))
        assert group.calls[-1] == ("stream_step", None)
        assert sorted(x for m, ids in group.calls if m == "stream_accumulate" for x in ids) == \
            sorted(s.sample_id for s in harvest.batch)

    # A streamed group missing from the batch at training time: parts dropped, ordinary update.
    group.calls.clear()
    streamed = {s.sample_id: (1.0, False, False) for s in first}
    stream.update.decisions = dict(streamed)
    stream.train(harvest.batch[2:], [1.0] * 2)
    assert [m for m, _ in group.calls] == ["stream_discard", "train_step"]
    # ... or present but trained differently there (another advantage): the same.
    group.calls.clear()
    stream.update.decisions = dict(streamed)
    with_first = [s for s in harvest.batch if s.sample_id in streamed]
    stream.train(with_first, [0.5] * len(with_first))
    assert [m for m, _ in group.calls] == ["stream_discard", "train_step"]


def test_a_streamed_part_does_not_hold_up_the_driver_and_its_error_reaches_the_step(local_ray):
    import asyncio
    import threading

    import ray

    from megatron_sortedrl.trainer.stream import StreamedUpdate

    # (Classes defined here so Ray ships them by value; the test module is not importable in Ray's workers.)
    class Gate:
        """Holds back every backward until the test opens it, and logs what the rank ran (async: never blocked)."""

        def __init__(self):
            self.event, self.log = asyncio.Event(), []

        async def wait(self):
            await self.event.wait()

        async def open(self):
            self.event.set()

        async def record(self, method):
            self.log.append(method)

        async def calls(self):
            return list(self.log)

    class Rank:
        """One trainer rank (a sequential actor, like the real ones) whose backward waits at the gate."""

        def __init__(self, gate):
            self.gate = gate

        def call(self, method, *args):
            if method == "stream_accumulate":
                ray.get(self.gate.wait.remote())
                if "bad" in args[0]:
                    raise ValueError("non-finite loss in this part")
            ray.get(self.gate.record.remote(method))
            return {"loss": 0.0, "n_tokens": 1.0} if method == "stream_step" else {}

    class RayGroup:
        """The slice of `TrainerGroup` that `StreamedUpdate` uses, over one real Ray actor."""

        def __init__(self, rank):
            self.actors = [rank]

        def _rl_items(self, samples, advantages, old):
            return [s.sample_id for s in samples] + (["bad"] if advantages == ["bad"] else [])

        def _rl_decisions(self, samples, advantages):
            return [None] * len(samples)

        def _submit(self, method, *args):
            return [a.call.remote(method, *args) for a in self.actors]

        def _all(self, method, *args):
            return ray.get(self._submit(method, *args))

        def _report(self, outs):
            return outs[0]

    samples = _samples(4)
    gate = ray.remote(Gate).remote()
    update = StreamedUpdate(RayGroup(ray.remote(Rank).remote(gate)))
    # No backward can run before the gate opens, so add() returning at all shows it did not wait for one (a
    # blocking add would hang: it runs in a thread, and the gate opens whatever happens).
    adding = threading.Thread(target=lambda: (update.add(samples[:2], [1.0, 1.0]), update.add(samples[2:], [1.0, 1.0])))
    adding.start()
    adding.join(60)
    returned = not adding.is_alive()
    if not returned:
        ray.get(gate.open.remote())
    assert returned, "StreamedUpdate.add waited for the backward of its part"
    assert update.parts == 2 and ray.get(gate.calls.remote()) == []
    ray.get(gate.open.remote())
    metrics = update.step()  # waits for both parts, then steps: in the order they were sent
    assert ray.get(gate.calls.remote()) == ["stream_accumulate", "stream_accumulate", "stream_step"]
    assert metrics["loss"] == 0.0 and update.parts == 0

    # A part that fails is not dropped silently: its error is raised by the step, and no update is made.
    update.add(samples[:1], ["bad"])  # (the stand-in marks this part as one whose backward fails)
    with pytest.raises(ray.exceptions.RayTaskError, match="non-finite loss"):
        update.step()
    assert ray.get(gate.calls.remote()) == ["stream_accumulate", "stream_accumulate", "stream_step"]


def test_a_batch_wide_tis_choice_that_differs_from_a_part_discards_the_parts():
    """TIS is used only when every sample of what is trained has rollout log-probs; if the rest of the batch lacks
    them, the streamed parts (trained with TIS) are not the batch update: discarded, ordinary update."""

    class TisGroup(FakeGroup):
        def _rl_decisions(self, samples, advantages):
            tis = all(s.rollout_logprobs for s in samples)
            return [(float(a), False, tis) for a in advantages]

    from megatron_sortedrl.trainer.stream import DriverStream

    samples = _samples(4)
    samples[3].rollout_logprobs = []
    group = TisGroup()
    stream = DriverStream(group, policy=None)
    stream.update.add(samples[:2], [1.0, 1.0])
    assert group.calls == [("stream_accumulate", sorted(s.sample_id for s in samples[:2]))]
    metrics = stream.train(samples, [1.0] * 4)
    assert [m for m, _ in group.calls[1:]] == ["stream_discard", "train_step"] and metrics["stream_discarded"] == 1.0
    group.calls.clear()  # with rollout log-probs everywhere the parts are kept
    samples[3].rollout_logprobs = [-1.0]
    stream.update.add(samples[:2], [1.0, 1.0])
    stream.train(samples, [1.0] * 4)
    assert [m for m, _ in group.calls] == ["stream_accumulate", "stream_accumulate", "stream_step"]
