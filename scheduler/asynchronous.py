"""Asynchronous RL under a staleness bound: admission control and oldest-first mini-batches (pure logic).

    ctl = AsyncController(prompt_ids, n=16, mini_batch=512, bound=2, num_epochs=3, history=LengthHistory())
    for group in ctl.admit():  ...submit the group's n samples...               # never more than the bound allows
    ctl.on_finished(sample)                                                     # scored, back from an engine
    batch = ctl.next_minibatch()       # None: wait (a due group is still generating, or too few are done)
    ctl.stepped(batch)                 # after its optimizer step(s); ctl.synced(version) after a weight push
    python -m megatron_sortedrl simulate configs/sim_qwen32b_128gpu.yaml --policies sync,async,async+histospec

Engines keep generating while the trainer trains; new weights reach them in flight (the simulator,
`scheduler/sim/async_sim.py`, pauses them between decode steps; running requests keep their tokens and their
version spans grow). What keeps it correct is here, as a controller both the simulator and a driver can run:

- **Staleness in optimizer steps** (as `megatron_sortedrl/minibatch.py` counts it): a group admitted while the
  engines hold the weights after `s` optimizer steps has every token sampled by weights at least that new, so
  training it at step `j` makes it `j - s` steps stale. Its **deadline** is `s + bound`: it must be in a
  mini-batch that starts at most `bound` steps after its weights.
- **Admission control, never discard.** A group is admitted only if every deadline can still be met: with
  `D_j` the untrained samples due by step `j` and `c` the steps made, `D_j <= (j - c + 1) x mini_batch` for every
  `j` (each step trains one mini-batch). A finished sample is never dropped for staleness: `discarded` stays 0.
- **Earliest deadline first.** A mini-batch takes the groups due now (all must be complete, else the trainer
  waits), then complete groups in deadline order (= admission order), whole groups only, until it holds
  `mini_batch` samples; it then checks that the groups it leaves behind can still meet their deadlines (the
  same inequality one step on), else it waits. EDF is optimal for this check, so the trainer waits only when a
  deadline forces it. Harvests therefore train oldest first, and what is trained follows what was admitted.
- **Length awareness** (`length_aware`, the default policy's): the per-prompt history (scheduler/history.py)
  decides admission order. Within each epoch the prompts it knows are admitted longest predicted first, the
  unseen ones after them in data order. A long group pins the trainer to at most `bound` steps while it
  generates; admitted together at the start of the epoch the long groups cost that once per epoch instead of
  once per mini-batch (RollPacker's tail batching, inside the bound), and their generation overlaps the short
  groups' training. An epoch's prompts are all admitted before the next epoch's, so what is trained per epoch is
  the data's distribution of lengths (the simulator reports it). Placement by predicted length is the caller's
  (`scheduler.placement.place`).

- **Counted from completion** (`from_finish`, the simulator's `async-partial` rows; for comparison, it does not
  keep the bound): the deadline is set when a group completes (`bound` steps after it) and admission only caps
  the samples in flight at `(bound + 1) x mini_batch` (AReaL's rule). That is what partial-rollout systems bound in
  practice; a long group's oldest tokens can then be far older than the bound, and `stepped` reports their real age.

`AsyncPolicy` (below) is the controller as the driver's scheduling policy (`scheduler.policy=async`): scored
samples in, the length history kept, state for checkpoints; the driver's loop is
`megatron_sortedrl/async_loop.py`. `place_admitted` places admitted samples on engines, predicted-long groups on
the tail engines, for both the driver and the simulator.

Plain Python on `Sample` records; the clock is the caller's.
Left out: partial groups (a group is admitted and trained whole, so group-baseline advantages see all n
samples); more than one optimizer step per mini-batch (`algorithm.ppo_epochs` > 1: the deadlines count one step
per mini-batch).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from megatron_sortedrl.sample import Sample
from scheduler.base import DataCursor
from scheduler.history import LengthHistory
from scheduler.placement import place
from scheduler.protocol import Request


@dataclass
class Group:
    """One prompt instance (prompt, epoch) in flight: its n samples, its weights' step and its deadline."""

    prompt_id: str
    epoch: int
    samples: list[Sample]
    admit_step: int  # optimizer steps behind the weights the engines held when it was admitted
    deadline: int  # the last optimizer step index (steps made before it) that may train it
    order: int  # admission order (ties in deadline keep it)
    finished: set[str] = field(default_factory=set)

    @property
    def complete(self) -> bool:
        return len(self.finished) == len(self.samples)


class AsyncController:
    """Admission and oldest-first (earliest-deadline-first) mini-batches under a staleness bound in steps."""

    def __init__(self, prompt_ids: Sequence[str], *, n: int, mini_batch: int, bound: int, num_epochs: int | None,
                 seed: int = 0, history: LengthHistory | None = None, length_aware: bool = True,
                 from_finish: bool = False, factory: Callable[[str, int, int], Sample] | None = None) -> None:
        if bound < 0:
            raise ValueError(f"bound must be >= 0 optimizer steps (got {bound})")
        if mini_batch <= 0 or mini_batch % n:
            raise ValueError(f"mini_batch must be a positive multiple of n={n} (got {mini_batch})")
        self.n, self.m, self.bound = n, mini_batch, bound
        self.cursor = DataCursor(prompt_ids, num_epochs, seed)
        self.epoch_size = len(prompt_ids)
        self.history = history if history is not None else LengthHistory()  # (an empty one is falsy)
        self.length_aware = length_aware
        self.from_finish = from_finish  # count the bound from a group's completion, not its admission (see below)
        self.factory = factory or (lambda pid, epoch, idx: Sample(prompt_id=pid, index=idx, epoch=epoch))
        self.steps = 0  # optimizer steps made
        self.engine_step = 0  # optimizer steps behind the weights the engines hold now
        self.step_at_version: dict[int, int] = {0: 0}
        self.groups: list[Group] = []  # admitted, untrained, in admission order
        self.by_sample: dict[str, Group] = {}
        self.next_up: list[tuple[str, int]] = []  # this epoch's prompts not yet admitted, in admission order
        self.admitted = self.trained = self.discarded = 0
        self._order = 0
        self.ages: list[int] = []  # staleness in steps of every trained sample, at its step

    # -- weights ---------------------------------------------------------------------------------------------
    def synced(self, version: int) -> None:
        """The engines now hold `version`, the weights after `self.steps` optimizer steps."""
        self.step_at_version[version] = self.steps
        self.engine_step = self.steps

    # -- admission --------------------------------------------------------------------------------------------
    def feasible(self, groups: Sequence[Group], start: int, extra: tuple[int, int] | None = None) -> bool:
        """Can `groups` (untrained, plus `extra` = (deadline, samples)) all meet their deadlines from step `start`
        on, one mini-batch a step? `D_j <= (j - start + 1) x mini_batch` for every deadline j."""
        due: dict[int, int] = {}
        for g in groups:
            due[g.deadline] = due.get(g.deadline, 0) + len(g.samples)
        if extra is not None:
            due[extra[0]] = due.get(extra[0], 0) + extra[1]
        total = 0
        for j in sorted(due):
            total += due[j]
            if j < start or total > (j - start + 1) * self.m:
                return False
        return True

    def _candidates(self) -> list[tuple[str, int]]:
        """Prompts not yet admitted, in the order they will be: one epoch at a time; with `length_aware` the
        prompts the history knows go longest predicted first, unseen ones after them in data order."""
        if not self.next_up and not self.cursor.exhausted:
            epoch = self.cursor.epoch
            self.next_up = [p for p in self.cursor.take(self.epoch_size) if p[1] == epoch]
            if self.length_aware:
                known = [p for p in self.next_up if self.history.known(p[0])]
                known.sort(key=lambda p: -self.history.predict(p[0]))  # stable: ties keep data order
                self.next_up = known + [p for p in self.next_up if not self.history.known(p[0])]
        return self.next_up

    def admit(self) -> list[Group]:
        """Groups to start now (their samples fresh), as many as the bound allows, in admission order."""
        out: list[Group] = []
        deadline = self.engine_step + self.bound
        while True:
            cands = self._candidates()
            if not cands:
                break
            pid, epoch = cands[0]
            if self.from_finish:
                if self.admitted - self.trained + self.n > (self.bound + 1) * self.m:
                    break  # AReaL's count rule: at most bound + 1 mini-batches in flight
                deadline = 1 << 60  # set when the group completes
            elif deadline < self.steps or not self.feasible(self.groups, self.steps, (deadline, self.n)):
                break
            self.next_up.pop(0)
            g = Group(pid, epoch, [self.factory(pid, epoch, i) for i in range(self.n)], self.engine_step, deadline,
                      self._order)
            self._order += 1
            self.groups.append(g)
            for s in g.samples:
                self.by_sample[s.sample_id] = g
            self.admitted += self.n
            out.append(g)
        return out

    @property
    def exhausted(self) -> bool:
        """Every prompt of every epoch admitted."""
        return self.cursor.exhausted and not self.next_up

    @property
    def done(self) -> bool:
        return self.exhausted and not self.groups

    # -- samples ---------------------------------------------------------------------------------------------
    def on_finished(self, sample: Sample) -> None:
        g = self.by_sample.get(sample.sample_id)
        if g is not None:
            g.finished.add(sample.sample_id)
            if self.from_finish and g.complete:
                g.deadline = self.steps + self.bound

    # -- training ----------------------------------------------------------------------------------------------
    def next_minibatch(self) -> list[Sample] | None:
        """The next mini-batch (whole groups, earliest deadline first), or None when the trainer must wait. At the
        end of the data the last groups train even when they hold fewer than `mini_batch` samples."""
        if not self.groups:
            return None
        pick: list[Group] = []
        taken = 0
        for g in sorted(self.groups, key=lambda g: (g.deadline, g.order)):
            if g.deadline <= self.steps and not g.complete:
                return None  # due now and still generating: the trainer waits for it
            if taken >= self.m:
                break
            if g.complete:
                pick.append(g)
                taken += len(g.samples)
        if not pick or (taken < self.m and (not self.exhausted or any(not g.complete for g in self.groups))):
            return None  # too few done for a full mini-batch (a short last one only once everything is done)
        left = [g for g in self.groups if g not in pick]
        if not self.from_finish and not self.feasible(left, self.steps + 1):
            return None  # training these now would leave a deadline unmet: wait for an earlier group
        return [s for g in pick for s in g.samples]

    def stepped(self, batch: Sequence[Sample], steps: int = 1) -> list[int]:
        """`batch` (from `next_minibatch`) was trained in `steps` optimizer steps; returns each sample's staleness
        in steps (steps made before it minus the step behind its oldest token's weights)."""
        ages = []
        keys = set()
        for s in batch:
            g = self.by_sample.pop(s.sample_id)
            keys.add(id(g))
            v = s.oldest_version
            ages.append(max(0, self.steps - self.step_at_version.get(v, g.admit_step)) if v >= 0 else 0)
        self.groups = [g for g in self.groups if id(g) not in keys]
        self.trained += len(batch)
        self.steps += steps
        self.ages.extend(ages)
        return ages

    # -- checkpointing -----------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable. Finished samples are kept with their tokens and rewards; the unfinished ones (in an
        engine or queued) are stored by position only and start afresh on resume (`load_state_dict`)."""
        return {"steps": self.steps, "engine_step": self.engine_step, "order": self._order,
                "step_at_version": {str(k): v for k, v in self.step_at_version.items()},
                "cursor": self.cursor.state_dict(), "next_up": [list(p) for p in self.next_up],
                "admitted": self.admitted, "trained": self.trained, "discarded": self.discarded,
                "groups": [{"prompt_id": g.prompt_id, "epoch": g.epoch, "admit_step": g.admit_step,
                            "deadline": g.deadline, "order": g.order,
                            "samples": [s.to_dict() if s.sample_id in g.finished else None for s in g.samples]}
                           for g in self.groups]}

    def load_state_dict(self, state: dict[str, Any]) -> list[Sample]:
        """Restores the controller; returns the samples to generate again (fresh, under the current weights:
        newer than the ones they replace, so every deadline still holds)."""
        self.steps, self.engine_step, self._order = state["steps"], state["engine_step"], state["order"]
        self.step_at_version = {int(k): int(v) for k, v in state["step_at_version"].items()}
        self.cursor.load_state_dict(state["cursor"])
        self.next_up = [(p[0], int(p[1])) for p in state["next_up"]]
        self.admitted, self.trained, self.discarded = state["admitted"], state["trained"], state["discarded"]
        self.groups, self.by_sample, again = [], {}, []
        for gs in state["groups"]:
            samples = []
            for i, d in enumerate(gs["samples"]):
                if d is None:
                    again.append(self.factory(gs["prompt_id"], gs["epoch"], i))
                samples.append(Sample.from_dict(d) if d is not None else again[-1])
            g = Group(gs["prompt_id"], gs["epoch"], samples, gs["admit_step"], gs["deadline"], gs["order"],
                      {s.sample_id for s, d in zip(samples, gs["samples"]) if d is not None})
            self.groups.append(g)
            for s in samples:
                self.by_sample[s.sample_id] = g
        return again


def place_admitted(requests: list[Request], num_engines: int, long_cut: float, tail_engines: int = 0) -> None:
    """Sets `request.worker`: with `tail_engines` > 0 the requests predicted longer than `long_cut` tokens go to the
    last `tail_engines` engines and the rest to the others, each set longest predicted first (LPT); else LPT over
    all engines."""
    if tail_engines <= 0 or tail_engines >= num_engines:
        place(requests, num_engines)
        return
    long = [r for r in requests if r.predicted_length > long_cut]
    short = [r for r in requests if r.predicted_length <= long_cut]
    place(long, tail_engines)
    for r in long:
        r.worker += num_engines - tail_engines
    place(short, num_engines - tail_engines)


class AsyncPolicy:
    """The controller as the driver's scheduling policy (`scheduler.policy=async`).

    The driver's loop (`megatron_sortedrl/async_loop.py`) asks `admit()` for new samples, hands every scored one to
    `on_sample_finished`, trains `next_minibatch()` and reports it with `stepped`; a weight push reaches
    `on_update`. The prompt length history (the default policy's predictor) learns from every finished sample
    and orders admission (`scheduler.admission=length`)."""

    name = "async"

    def __init__(self, cfg: Any, prompt_ids: Sequence[str], *, n_samples: int, mini_batch: int,
                 max_response_length: int, seed: int = 0, num_epochs: int | None = None,
                 sample_factory: Callable[[str, int, int], Sample] | None = None, **_: Any) -> None:
        self.history = LengthHistory(cfg.predictor, cfg.predictor_quantile, cfg.history_max_prompts)
        self.ctl = AsyncController(prompt_ids, n=n_samples, mini_batch=mini_batch, bound=cfg.staleness_bound,
                                   num_epochs=num_epochs, seed=seed, history=self.history,
                                   length_aware=cfg.admission == "length", factory=sample_factory)
        self.long_cut = cfg.long_round_threshold * max_response_length
        self.max_len = max_response_length
        self.version = 0
        self.again: list[Sample] = []  # restored from a checkpoint, to generate again

    def admit(self) -> list[Request]:
        """Requests for the samples to start now (restored ones first), each with its predicted length."""
        samples, self.again = self.again, []
        samples += [s for g in self.ctl.admit() for s in g.samples]
        return [Request(s, 0, self.history.predict(s.prompt_id) if self.history.known(s.prompt_id) else 0.0,
                        self.max_len - s.response_length) for s in samples]

    def on_sample_finished(self, sample: Sample, clock: Any = None) -> list[str]:
        g = self.ctl.by_sample.get(sample.sample_id)
        if g is None or sample.sample_id in g.finished:
            return []  # trained already, or a second copy: nothing to count twice
        g.samples[sample.index] = sample  # the scored record (the reward stage may hand back a copy)
        self.history.record(sample.prompt_id, sample.epoch, sample.response_length)
        self.ctl.on_finished(sample)
        return []

    def on_sample_aborted(self, sample: Sample, clock: Any = None) -> None:
        """Nothing is aborted for staleness; the loop puts a partial it aborted itself back in its queue."""

    def on_update(self, version: int, clock: Any = None, preemptions: int = 0) -> None:
        self.version = version
        self.ctl.synced(version)

    def state_dict(self) -> dict[str, Any]:
        return {"policy": self.name, "version": self.version, "controller": self.ctl.state_dict(),
                "history": self.history.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["policy"] != self.name:
            raise ValueError(f"checkpoint holds scheduler policy {state['policy']!r}, config says {self.name!r}")
        self.version = state["version"]
        self.history.load_state_dict(state["history"])
        self.again = self.ctl.load_state_dict(state["controller"])
