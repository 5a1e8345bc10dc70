"""The one protocol a tier-1 scheduling policy implements, and the records it exchanges with a driver.

The real RL driver and the simulator (`scheduler/sim/simulator.py`) run a policy the same way::

    round = policy.compose_round(clock)            # None: nothing left to do
    submit round.requests (each already placed on round.layout's worker `request.worker`)
    while (h := policy.harvest(clock)) is None:
        sample = next finished (and scored) sample
        for sid in policy.on_sample_finished(sample, clock):      # e.g. surplus responses of a prompt
            abort sid; hand the sample back with policy.on_sample_aborted(sample, clock)
    for sid in h.abort: abort sid; hand back with on_sample_aborted (or on_sample_finished if it ended first)
    train on h.batch (short-first); version += 1
    policy.on_update(version, clock, preemptions=<KV preemptions the engines reported this round>)

Signatures (`SchedulingPolicy`):

    compose_round(clock: Clock) -> Round | None
    on_sample_finished(sample: Sample, clock: Clock) -> list[str]     # sample ids to abort now
    on_sample_aborted(sample: Sample, clock: Clock) -> None           # sample carries its partial tokens
    harvest(clock: Clock) -> Harvest | None                           # None: keep generating
    on_update(version: int, clock: Clock, preemptions: int = 0) -> None
    state_dict() -> dict            # JSON-serialisable: history, queues, partial cache, data cursor
    load_state_dict(state: dict) -> None

`Clock` is anything with `now() -> float` (seconds): the driver's run clock or the simulator's virtual
clock. A sample id is `Sample.sample_id`. A resumed partial sample arrives in a `Request` with its tokens,
log-probs and version spans; the engine continues it (prompt + response as the new prompt) for at most
`request.max_tokens` more tokens and appends with `Sample.append(tokens, logprobs, version)`.

Within a round the driver keeps at most the engine's batch in flight per worker and queues the rest
itself (`scheduler.placement.WorkerQueues`), so queued requests can still move between workers.

Left out: asynchronous (overlapping) rollout and training in this protocol; a round ends at its harvest. The
asynchronous controller (`scheduler/asynchronous.py`) is a protocol of its own: admission under a staleness bound
and earliest-deadline-first mini-batches, run by the simulator (`scheduler/sim/async_sim.py`) and by the driver's
asynchronous loop (`megatron_sortedrl/async_loop.py`, `scheduler.policy=async`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from megatron_sortedrl.sample import Sample

ROUND_KINDS = ("sync", "short", "long")


class Clock(Protocol):
    def now(self) -> float: ...


class ManualClock:
    """A clock that only moves when told; the simulator's virtual time and the tests' clock."""

    def __init__(self, t: float = 0.0) -> None:
        self.t = t

    def now(self) -> float:
        return self.t


@dataclass(frozen=True)
class Layout:
    tp: int  # tensor-parallel size of every rollout engine in this layout
    num_engines: int  # engines (= workers) in this layout; tp * num_engines <= rollout GPUs

    def to_dict(self) -> dict[str, int]:
        return {"tp": self.tp, "num_engines": self.num_engines}


@dataclass
class Request:
    sample: Sample  # fresh (no response yet) or a resumed partial rollout (tokens, log-probs, versions kept)
    worker: int  # target worker, 0..layout.num_engines-1 (tier-2 placement)
    predicted_length: float  # predicted total response tokens of this sample (0: no prediction)
    max_tokens: int  # response tokens still allowed: max_response_length - len(sample.response_tokens)


@dataclass
class Round:
    index: int  # 0, 1, ...: the training step this round's harvest feeds
    kind: str  # "sync" | "short" | "long" (ROUND_KINDS)
    version: int  # policy version the engines hold while generating this round
    layout: Layout  # engine layout to run this round in (change it before submitting if it differs)
    requests: list[Request] = field(default_factory=list)
    prompts: list[str] = field(default_factory=list)  # prompt keys ("<prompt_id>/e<epoch>") the round serves
    deferred: list[str] = field(default_factory=list)  # prompt keys sent to the long-tail queue while composing
    # Lookahead (twotier): the next round's requests, started early by an engine that has run out of this
    # round's work while the round waits for its tail; they are not harvested in this round.
    lookahead: list[Request] = field(default_factory=list)


@dataclass
class Harvest:
    batch: list[Sample]  # the update batch: finished samples, whole prompt groups, shortest response first
    abort: list[str]  # ids of samples still generating that the driver must abort now and hand back
    stats: dict[str, Any] = field(default_factory=dict)  # e.g. staleness per sample, prompts deferred


class SchedulingPolicy(Protocol):
    def compose_round(self, clock: Clock) -> Round | None: ...

    def on_sample_finished(self, sample: Sample, clock: Clock) -> list[str]: ...

    def on_sample_aborted(self, sample: Sample, clock: Clock) -> None: ...

    def harvest(self, clock: Clock) -> Harvest | None: ...

    def on_update(self, version: int, clock: Clock, preemptions: int = 0) -> None: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...
