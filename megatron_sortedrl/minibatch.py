"""Mini-batches of a harvest: the update size as a training setting, not a scheduling side effect.

    mb = MiniBatcher(size=cfg.algorithm.ppo_mini_batch_size, epochs=cfg.algorithm.ppo_epochs)
    batches = mb.plan(harvest)                     # whole prompt groups, `size` samples each; the rest waits
    for sample, age in zip(flat, mb.staleness(flat)): ...   # optimizer steps since its weights were current
    mb.stepped(len(batches) * epochs); mb.synced(version)   # after the update and the weight sync
    batches = mb.plan([], flush=True)              # the end of the data or of the run: the remainder trains

Each harvest (whatever the scheduling policy returned: `sync`'s whole rollout batch, `twotier`'s carry-over
round, `sorted`'s short-first cut) is cut into mini-batches of `algorithm.ppo_mini_batch_size` samples, as verl's
`ppo_mini_batch_size` x n and slime's global batch do, and each mini-batch is one optimizer step:

- **Whole groups.** Samples of one prompt group (prompt id and epoch) stay together, in the order the harvest
  holds them (carried samples first, oldest first); a mini-batch closes once it holds at least `size` samples.
  With whole groups of n and `size` a multiple of n (the config checks it) every mini-batch has exactly `size`
  samples; a short-first harvest that took part of a group keeps that part together.
- **The remainder waits.** Samples that do not fill a mini-batch are trained with the next harvest (their
  old log-probs are then taken at that harvest's start, their behaviour log-probs stay theirs). So the number
  of optimizer steps on the same data is the same for every policy: floor(samples / size) x epochs, plus one
  step per epoch for a final remainder when the data or the run ends (`flush`). `size` 0: the whole harvest is
  one mini-batch (one step per harvest, the update size then follows the policy's harvest).
- **Staleness in optimizer steps.** A sample's age at its first step is the optimizer steps made since the
  weights that sampled its oldest token were current (`synced` records the step count of every version the
  engines received). With one step per harvest it equals the policy-version staleness the scheduler reports.

Plain Python on `Sample` records, so the driver and the simulator run the same cut (scheduler/sim/simulator.py).
Left out: token-budgeted mini-batches (verl's dynamic batch size applies to micro-batches, which the trainer
packs by tokens already: `trainer.micro_batch_tokens`).
"""

from __future__ import annotations

from typing import Any, Sequence

from megatron_sortedrl.sample import Sample
from scheduler.base import prompt_key


def group_key(s: Sample) -> str:
    """A prompt group: the n samples of one prompt in one epoch (what group-baseline advantages average over),
    keyed as the scheduler keys it."""
    return prompt_key(s.prompt_id, s.epoch)


def groups_in_order(samples: Sequence[Sample]) -> list[list[Sample]]:
    """The samples grouped by prompt group, groups in order of their first sample, samples in order."""
    out: dict[str, list[Sample]] = {}
    for s in samples:
        out.setdefault(group_key(s), []).append(s)
    return list(out.values())


def split_minibatches(samples: Sequence[Sample], size: int) -> tuple[list[list[Sample]], list[Sample]]:
    """(mini-batches, remainder): whole groups, a mini-batch closing once it holds >= `size` samples; the
    remainder is the last groups that did not reach `size`. `size` <= 0: one mini-batch of everything."""
    if size <= 0:
        return ([list(samples)] if samples else []), []
    batches: list[list[Sample]] = []
    current: list[Sample] = []
    for group in groups_in_order(samples):
        current.extend(group)
        if len(current) >= size:
            batches.append(current)
            current = []
    return batches, current


class MiniBatcher:
    """Cuts harvests into mini-batches, holds the remainder between harvests and counts optimizer steps."""

    def __init__(self, size: int, epochs: int = 1) -> None:
        self.size, self.epochs = int(size), int(epochs)
        self.pending: list[Sample] = []  # trained with the next harvest (whole groups, oldest first)
        self.steps = 0  # optimizer steps made so far (every epoch's)
        self.step_at_version: dict[int, int] = {0: 0}  # weights version -> optimizer steps behind it

    def plan(self, harvest: Sequence[Sample], flush: bool = False) -> list[list[Sample]]:
        """This harvest's mini-batches (the waiting remainder first); with `flush` the remainder trains too."""
        batches, self.pending = split_minibatches(self.pending + list(harvest), self.size)
        if flush and self.pending:
            batches.append(self.pending)
            self.pending = []
        return batches

    def optimizer_steps(self, batches: Sequence[Sequence[Sample]]) -> int:
        return len(batches) * self.epochs

    def staleness(self, batches: Sequence[Sequence[Sample]]) -> list[int]:
        """Per sample of `batches` (flattened, in order): optimizer steps between the weights that sampled its
        oldest token and the step that first trains it."""
        out = []
        for k, batch in enumerate(batches):
            at = self.steps + k  # steps made before this mini-batch's first epoch
            for s in batch:
                v = s.oldest_version
                out.append(max(0, at - self.step_at_version.get(v, 0)) if v >= 0 else 0)
        return out

    def stepped(self, steps: int) -> None:
        self.steps += steps

    def synced(self, version: int) -> None:
        """The engines now hold `version`, the weights after `self.steps` optimizer steps."""
        self.step_at_version[version] = self.steps
        # versions older than every sample the scheduler may still hold are not needed; keep the map small
        if len(self.step_at_version) > 4096:
            for v in sorted(self.step_at_version)[:-2048]:
                del self.step_at_version[v]

    def state_dict(self) -> dict[str, Any]:
        return {"pending": [s.to_dict() for s in self.pending], "steps": self.steps,
                "step_at_version": {str(k): v for k, v in self.step_at_version.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.pending = [Sample.from_dict(d) for d in state.get("pending", [])]
        self.steps = int(state.get("steps", 0))
        self.step_at_version = {int(k): int(v) for k, v in state.get("step_at_version", {"0": 0}).items()}


def staleness_metrics(ages: Sequence[int]) -> dict[str, Any]:
    """Per-update staleness in optimizer steps over the trained samples: mean, max and the histogram (steps ->
    samples; every trained sample counted once, at its first step)."""
    if not ages:
        return {}
    hist: dict[str, int] = {}
    for a in sorted(ages):
        hist[str(a)] = hist.get(str(a), 0) + 1
    return {"staleness_steps_mean": sum(ages) / len(ages), "staleness_steps_max": float(max(ages)),
            "staleness_steps_hist": hist}


def train_update(trainer: Any, batcher: MiniBatcher, batch: Sequence[Sample], flush: bool = False,
                 stream: Any = None) -> dict[str, float]:
    """The driver's train phase on a (shaped) harvest: its mini-batches, advantages once over what they hold,
    one optimizer step each (`TrainerGroup.train_minibatches`; the stream trainer's one step when
    `trainer.stream`, which the config allows only with one mini-batch per harvest). Returns the trainer's
    metrics with `optimizer_steps` (0 when everything waits), `samples_trained`, `samples_waiting` and the
    staleness in optimizer steps."""
    batches = batcher.plan(batch, flush)
    if not batches:
        return {"optimizer_steps": 0.0, "samples_trained": 0.0, "samples_waiting": float(len(batcher.pending))}
    flat = [s for mb in batches for s in mb]
    ages = batcher.staleness(batches)
    adv = trainer.advantages(flat)  # once per harvest
    if stream is not None:
        out = {**stream.train(flat, adv), "optimizer_steps": 1.0}
    else:
        out = trainer.train_minibatches(batches, adv, batcher.epochs)
    batcher.stepped(batcher.optimizer_steps(batches))
    return {**out, **staleness_metrics(ages), "samples_trained": float(len(flat)),
            "samples_waiting": float(len(batcher.pending))}
