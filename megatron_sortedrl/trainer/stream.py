"""Stream training (RollPacker): gradients of finished prompt groups while the rest of the round still
generates, accumulated into one optimizer step at harvest. The update equals the batch one.

    update = StreamedUpdate(trainer_group)          # trainer.stream: true in a run config
    update.add(group_a, advantages_a)               # as soon as a prompt group has all its samples scored
    update.add(group_b, advantages_b)
    metrics = update.step()                         # at harvest: one Adam step, same as train_step(a + b)

Why it is exact: the loss is a sum over tokens with weights mask / N (token aggregation: N = tokens of the
whole batch) or mask / (len * S) (sequence aggregation: S = sequences of the batch), and nothing else couples
samples: advantages are per prompt group (a group is added whole), old log-probs are the current policy's
(no update happens in between), and the KL reference and TIS weights are per token. So each part runs its
forward/backward with N = S = 1 into the gradient buffers, and `stream_step` divides the summed gradients
by the batch's N (or S) before the usual optimizer step (clipping, finiteness check, Adam), which therefore
sees the batch gradient up to float summation order.

`StreamTrainingMixin` is mixed into `TrainerWorker`; `StreamedUpdate` drives it through the Ray group;
`DriverStream` is the driver's hook (`trainer.stream: true`): it streams a prompt group from the rollout
loop once the group is complete and certain to be trained (sync: all; twotier: carried prompts).

Left out: several optimizer steps per batch (mini-batches), and dropping a part already added (a policy
that may not train a finished group must not stream it).
"""

from __future__ import annotations

from typing import Any, Sequence

from megatron_sortedrl.sample import Sample


class StreamTrainingMixin:
    """Worker side. Needs the worker's `_forward_backward(items, kind, counts=...)` and optimizer."""

    def stream_accumulate(self, items: list[dict], kind: str = "rl") -> dict[str, float]:
        """Forward/backward of one part with unnormalised weights, added to the gradient buffers."""
        self.model.train()
        parts = getattr(self, "_stream_parts", None)
        if parts is None:
            parts = self._stream_parts = []
        n_tok, n_seq = self._global_counts(items)
        metrics = self._forward_backward(items, kind, counts=(1.0, 1.0))
        parts.append((n_tok, n_seq, metrics))
        return {"parts": float(len(parts))}

    def stream_step(self, kind: str = "rl") -> dict[str, float]:
        """Normalises the accumulated gradients by the whole batch's counts and makes one update."""
        import torch

        parts = getattr(self, "_stream_parts", None) or []
        self._stream_parts = []
        if not parts:
            raise RuntimeError("stream_step without any stream_accumulate since the last step")
        n_tok = sum(p[0] for p in parts)
        n_seq = sum(p[1] for p in parts)
        mode = "token" if kind == "sft" else self.cfg.algorithm.loss_aggregation
        norm = max(1.0, n_tok if mode == "token" else n_seq)
        with torch.no_grad():
            for p in self.module.parameters():
                g = getattr(p, "main_grad", None)
                if g is not None:
                    g.mul_(1.0 / norm)
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
        self._pending: list = []  # Ray futures of parts whose backward may still run

    def add(self, samples: list[Sample], advantages: Sequence | None = None) -> None:
        """Backward of whole prompt groups (advantages from rewards when None, per group as in the batch)."""
        if not samples:
            return
        items = self.group._rl_items(samples, advantages, None)
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

    def discard(self) -> None:
        self.wait()
        self.group._all("stream_discard")
        self.samples, self.parts = [], 0

    def step(self) -> dict[str, float]:
        self.wait()
        metrics = dict(self.group._report(self.group._all("stream_step", "rl")))
        rewards = [s.reward for s in self.samples if s.reward is not None]
        if rewards:
            metrics["reward_mean"] = float(sum(rewards) / len(rewards))
        self.samples, self.parts = [], 0
        return metrics


class DriverStream:
    """The driver's `trainer.stream` hook: streams a prompt group as soon as it is complete *and* certain to be
    trained at the next harvest, then trains the rest of the batch and steps once.

    Certain: every prompt of a `sync` round; for `twotier`, the prompts carried into the round (the harvest
    waits for them and trains them). Other policies choose at harvest, so nothing is streamed for them and
    the update is the ordinary one. If the batch at harvest lacks a streamed group anyway (a filter between
    harvest and training), the parts are discarded and the batch is trained the ordinary way: never wrong,
    only wasted work.
    """

    def __init__(self, group: Any, policy: Any) -> None:
        self.update, self.policy = StreamedUpdate(group), policy
        self.group = group
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
        group = st.finished_samples()
        self.update.add(group, self.group.advantages(group))
        self.streamed.add(st.key)

    def train(self, batch: list[Sample], advantages: Sequence) -> dict[str, float]:
        """One update on `batch` (equal to `train_step(batch, advantages)`); streamed parts are reused."""
        done = {s.sample_id for s in self.update.samples}
        ids = {s.sample_id for s in batch}
        self.streamed = set()
        if not done <= ids:
            self.update.discard()
            return self.group.train_step(batch, advantages=advantages)
        rest = [(s, a) for s, a in zip(batch, advantages) if s.sample_id not in done]
        if rest:
            self.update.add([s for s, _ in rest], [a for _, a in rest])
        metrics = self.update.step()
        metrics["stream_share"] = len(done) / max(1, len(batch))
        return metrics
