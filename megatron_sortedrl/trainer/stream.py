"""Stream training (RollPacker): gradients of finished prompt groups while the rest of the round still
generates, accumulated into one optimizer step at harvest. The update equals the batch one.

    update = StreamedUpdate(trainer_group)          # trainer.stream: true in a run config
    update.add(group_a, advantages_a)               # as soon as a prompt group has all its samples scored
    update.add(group_b, advantages_b)
    metrics = update.step()                         # at harvest: one Adam step, same as train_step(a + b)

Why it is exact: the loss is a sum over tokens with weights mask / N (token aggregation: N = tokens of the
whole batch) or mask / (len * S) (sequence aggregation: S = sequences of the batch), and nothing else couples
samples once each sample's advantage, loss mask and TIS choice are fixed: group-baseline advantages (GRPO,
RLOO) are per prompt group (a group is added whole, its statistics summed exactly, so order-free), overlong
shaping and filtering are per sample and applied before a group is streamed, old log-probs are the current
policy's (no update happens in between), and the KL reference and TIS weights are per token. So each part
runs its forward/backward with N = S = 1 into the gradient buffers, and `stream_step` divides the summed
gradients by the batch's N (or S) before the usual optimizer step (clipping, finiteness check, Adam), which
therefore sees the batch gradient up to float summation order (bit-identical when the parts' micro-batches
are the batch's, in its order, and N, S, DP are powers of two; `tests/test_stream_exact.py`).

Batch-whitened advantages (Reinforce++, Reinforce++-baseline) need the whole batch before any advantage is
known, so streaming refuses them (`trainer.stream` at config load). At harvest `DriverStream.train` checks
that every streamed sample's advantage, loss mask and TIS choice are the batch's; if one is not (a filter
changed the batch), the parts are discarded and the batch trained the ordinary way.

Gradient reduction: Megatron's DDP reduces its gradient buffers in place (all-reduce; reduce-scatter with
the distributed optimizer, where each rank keeps only its shard) and `finalize_model_grads` also sums the
tied-embedding and sequence-parallel norm gradients across stages / TP ranks in place. Run once per part,
each later reduction would add the earlier parts' already-reduced gradients again. So a part's backward
runs with gradient sync off (`_grad_sync_deferred`: DDP's `no_sync`, and the schedule kept from re-enabling
it for its last micro-batch) and `stream_step` reduces the sum of all parts once.

`StreamTrainingMixin` is mixed into `TrainerWorker`; `StreamedUpdate` drives it through the Ray group;
`DriverStream` is the driver's hook (`trainer.stream: true`): it streams a prompt group from the rollout
loop once the group is complete and certain to be trained (sync: all; twotier: carried prompts).

Left out: several optimizer steps per batch (mini-batches; the config refuses `trainer.stream` with them), dropping a part already added (a policy
that may not train a finished group must not stream it), and overlapping the one reduction with the last
part's backward.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Sequence

from megatron_sortedrl.errors import ConfigError
from megatron_sortedrl.sample import Sample

BATCH_WHITENED = ("reinforce_pp", "reinforce_pp_baseline")  # = algorithms.BATCH_WHITENED (no torch import here)


class StreamTrainingMixin:
    """Worker side. Needs the worker's `_forward_backward(items, kind, counts=..., sync=...)` and optimizer."""

    @contextlib.contextmanager
    def _grad_sync_deferred(self, defer: bool = True):
        """Inside: backward passes add to the gradient buffers and start no DP reduction."""
        if not defer:
            yield
            return
        cfg = self.module.config
        saved = cfg.no_sync_func, cfg.grad_sync_func
        # Megatron's schedules leave their last micro-batch out of `no_sync_func` (and the 1F1B one calls
        # `grad_sync_func` at its end) so that the reduction starts there; with both unset and DDP's `no_sync`
        # held around the whole schedule, no micro-batch of the part starts one.
        cfg.no_sync_func, cfg.grad_sync_func = None, None
        try:
            with self.model.no_sync():
                yield
        finally:
            cfg.no_sync_func, cfg.grad_sync_func = saved

    def _reduce_streamed_grads(self) -> None:
        """The one gradient reduction of a streamed update, over the sum of all its parts."""
        from megatron.core.distributed import finalize_model_grads

        if self.model.ddp_config.overlap_grad_reduce:
            self.model.start_grad_sync()  # no part issued it (sync deferred); finish_grad_sync waits for it
        finalize_model_grads([self.model])

    def stream_accumulate(self, items: list[dict], kind: str = "rl") -> dict[str, float]:
        """Forward/backward of one part with unnormalised weights, added to the gradient buffers (not reduced)."""
        self.model.train()
        parts = getattr(self, "_stream_parts", None)
        if parts is None:
            parts = self._stream_parts = []
        n_tok, n_seq = self._global_counts(items)
        metrics = self._forward_backward(items, kind, counts=(1.0, 1.0), sync=False)
        parts.append((n_tok, n_seq, metrics))
        return {"parts": float(len(parts))}

    def stream_finish(self, kind: str = "rl") -> tuple[list, float]:
        """Reduces the parts' summed gradients once and normalises them by the whole batch's count; returns the
        parts and the count. `stream_step` then makes the update (tests read the gradients in between)."""
        import torch

        parts = getattr(self, "_stream_parts", None) or []
        self._stream_parts = []
        if not parts:
            raise RuntimeError("stream_step without any stream_accumulate since the last step")
        self._reduce_streamed_grads()
        n_tok = sum(p[0] for p in parts)
        n_seq = sum(p[1] for p in parts)
        mode = "token" if kind == "sft" else self.cfg.algorithm.loss_aggregation
        norm = max(1.0, n_tok if mode == "token" else n_seq)
        with torch.no_grad():
            for p in self.module.parameters():
                g = getattr(p, "main_grad", None)
                if g is not None:
                    g.mul_(1.0 / norm)
        return parts, norm

    def stream_step(self, kind: str = "rl") -> dict[str, float]:
        """Reduces and normalises the accumulated gradients (`stream_finish`) and makes one update."""
        parts, norm = self.stream_finish(kind)
        metrics: dict[str, float] = {}
        last_stage = [m for _, _, m in parts if m]
        if last_stage:
            tokens = sum(m["n_tokens"] for m in last_stage)
            metrics = {"loss": sum(m["loss"] for m in last_stage) / norm, "n_tokens": tokens}
            for k in last_stage[0]:
                if k not in ("loss", "n_tokens"):
                    metrics[k] = sum(m[k] * m["n_tokens"] for m in last_stage) / max(tokens, 1.0)
        metrics = self._update(metrics, kind)  # the same update as TrainerWorker.train_step
        if metrics:
            metrics["stream_parts"] = float(len(parts))
        return metrics

    def stream_discard(self) -> dict[str, float]:
        """Drops the accumulated parts (gradients zeroed): the batch is then trained the ordinary way."""
        from megatron_sortedrl.trainer.optimizer import zero_grads

        zero_grads(self.opt, [self.model])
        self._stream_parts = []
        return {}


class StreamedUpdate:
    """Driver side: parts of one RL batch go to the trainer as they are ready; `step` makes the update."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.samples: list[Sample] = []
        self.parts = 0
        self.decisions: dict[str, Any] = {}  # sample id -> what it was trained with (group._rl_decisions)
        self._pending: list = []  # Ray futures of parts whose backward may still run

    def add(self, samples: list[Sample], advantages: Sequence | None = None) -> None:
        """Backward of whole prompt groups (advantages from rewards when None, per group as in the batch)."""
        if not samples:
            return
        if advantages is None:
            advantages = self.group.advantages(samples)
        items = self.group._rl_items(samples, advantages, None)
        self.decisions.update(zip((s.sample_id for s in samples), self.group._rl_decisions(samples, advantages)))
        # Not waited for: the driver goes on harvesting while the trainer runs the backward; each rank runs
        # its calls in order, and `step`/`discard` wait for (and raise the errors of) every pending part.
        self._pending += self.group._submit("stream_accumulate", items, "rl")
        self.samples += samples
        self.parts += 1

    def wait(self) -> None:
        """Blocks until every part added so far has run its backward."""
        import ray

        pending, self._pending = self._pending, []
        if pending:
            ray.get(pending)

    def _reset(self) -> None:
        self.samples, self.parts, self.decisions = [], 0, {}

    def discard(self) -> None:
        self.wait()
        self.group._all("stream_discard")
        self._reset()

    def step(self) -> dict[str, float]:
        self.wait()
        metrics = dict(self.group._report(self.group._all("stream_step", "rl")))
        rewards = [s.reward for s in self.samples if s.reward is not None]
        if rewards:
            metrics["reward_mean"] = float(sum(rewards) / len(rewards))
        self._reset()
        return metrics


class DriverStream:
    """The driver's `trainer.stream` hook: streams a prompt group as soon as it is complete *and* certain to be
    trained at the next harvest, then trains the rest of the batch and steps once.

    Certain: every prompt of a `sync` round; for `twotier`, the prompts carried into the round (the harvest
    waits for them and trains them). Other policies choose at harvest, so nothing is streamed for them and
    the update is the ordinary one. A group is shaped (`shape`: the driver's overlong shaping, per sample)
    before its advantages are computed, as the batch will be. If at harvest a streamed sample is missing from
    the batch or would be trained differently there (advantage, loss mask, TIS), the parts are discarded and
    the batch is trained the ordinary way: never wrong, only wasted work.
    """

    def __init__(self, group: Any, policy: Any,
                 shape: Callable[[list[Sample]], list[Sample]] | None = None) -> None:
        cfg = getattr(group, "cfg", None)
        if cfg is not None and cfg.algorithm.advantage in BATCH_WHITENED:
            raise ConfigError("trainer.stream", True, f"false with algorithm.advantage={cfg.algorithm.advantage} "
                              "(it whitens over the whole batch, unknown while groups are streamed)")
        self.update, self.policy = StreamedUpdate(group), policy
        self.group = group
        self.shape = shape or (lambda samples: samples)
        self.streamed: set[str] = set()  # prompt keys already added

    def _certain(self, st: Any) -> bool:
        if self.policy.name == "sync":
            return True
        return self.policy.name == "twotier" and st.key in getattr(self.policy, "carry", ())

    def on_finished(self, sample: Sample) -> None:
        """After the policy saw `sample` finish: stream its prompt group if complete and certain."""
        st = self.policy._state(sample)
        if st is None or st.key in self.streamed or not self.policy.complete(st) or not self._certain(st):
            return
        group = self.shape(st.finished_samples())
        self.update.add(group, self.group.advantages(group))
        self.streamed.add(st.key)

    def train(self, batch: list[Sample], advantages: Sequence) -> dict[str, float]:
        """One update on the shaped `batch` (equal to `train_step(batch, advantages)`); streamed parts are
        reused when each streamed sample would be trained the same way in the batch."""
        self.streamed = set()
        want = dict(zip((s.sample_id for s in batch), self.group._rl_decisions(batch, advantages)))
        done = self.update.decisions
        rest = [(s, a) for s, a in zip(batch, advantages) if s.sample_id not in done]
        # The rest is one more part: it too must be trained as in the batch (TIS is a batch-wide choice).
        rest_got = self.group._rl_decisions([s for s, _ in rest], [a for _, a in rest]) if done and rest else []
        if done and (any(k not in want or want[k] != v for k, v in done.items())
                     or any(want[s.sample_id] != d for (s, _), d in zip(rest, rest_got))):
            self.update.discard()
            metrics = self.group.train_step(batch, advantages=advantages)
            return {**metrics, "stream_share": 0.0, "stream_discarded": 1.0}
        if rest:
            self.update.add([s for s, _ in rest], [a for _, a in rest])
        metrics = self.update.step()
        metrics["stream_share"] = len(done) / max(1, len(batch))
        return metrics
