"""Records exchanged between the rollout pool, its engine workers and the scheduler.

    from megatron_sortedrl.rollout.types import GenRequest, Completion

Plain dataclasses with no engine import, so the scheduler, the simulator and tests use them without
vLLM. Times are seconds of `time.monotonic()` on the driver's clock: workers stamp their own clock and the
pool shifts the stamps by the offset it measured when the worker started (one node shares one clock).

Deliberately left out: text. Token ids go in and out; the driver tokenizes and detokenizes.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

from megatron_sortedrl.sample import RoutedExperts

FINISH_REASONS = ("stop", "length", "abort", "lost")
# Sampling keys a request may carry; anything else is refused early (a typo would otherwise be ignored).
SAMPLING_KEYS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "ignore_eos", "stop_token_ids", "min_tokens")


@dataclass
class GenRequest:
    request_id: str  # unique while in flight (the scheduler uses `Sample.sample_id`)
    prompt_tokens: list[int]  # token ids fed to the engine (a resumed partial: prompt + response so far)
    sampling: dict[str, Any] = field(default_factory=dict)  # SAMPLING_KEYS; missing keys take vLLM defaults

    def __post_init__(self) -> None:
        unknown = set(self.sampling) - set(SAMPLING_KEYS)
        if unknown:
            raise ValueError(f"request {self.request_id}: unknown sampling keys {sorted(unknown)}; allowed {SAMPLING_KEYS}")
        if not self.prompt_tokens:
            raise ValueError(f"request {self.request_id}: empty prompt")


@dataclass
class Completion:
    request_id: str
    worker_id: int  # pool index of the worker that produced it (-1: lost before any worker answered)
    tokens: list[int] = field(default_factory=list)  # response token ids (partial when aborted)
    logprobs: list[float] = field(default_factory=list)  # log p of each sampled token under the engine's policy (nats)
    # (first token index, policy version) pairs, ascending, as in `Sample.version_spans`; several spans when
    # weights changed while the request was paused in the engine.
    version_spans: list[tuple[int, int]] = field(default_factory=list)
    finish_reason: str = ""  # stop | length | abort (partial) | lost (worker died; tokens are gone)
    num_prompt_tokens: int = 0
    submit_time: float = 0.0  # when the worker received the request
    first_token_time: float = 0.0  # first response token (0 when none)
    finish_time: float = 0.0  # finished, aborted or declared lost
    # MoE engines with routed-experts capture: the experts of every input position of the request, from the
    # first prompt token (`RoutedExperts`); vLLM returns them when the request finishes, so a partial has none.
    routed_experts: RoutedExperts | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason in ("stop", "length")

    def append(self, tokens: list[int], logprobs: list[float], version: int) -> None:
        if tokens and (not self.version_spans or self.version_spans[-1][1] != version):
            self.version_spans.append((len(self.tokens), version))
        self.tokens.extend(tokens)
        self.logprobs.extend(logprobs)

    def to_sample(self, sample) -> None:
        """Appends this completion to a `megatron_sortedrl.sample.Sample` (tokens, log-probs, versions, timing)."""
        spans = self.version_spans + [(len(self.tokens), -1)]
        for (start, version), (end, _) in zip(spans, spans[1:]):
            sample.append(self.tokens[start:end], self.logprobs[start:end], version)
        if self.routed_experts is not None:  # the request's prompt starts where the sample's does
            sample.add_routes(self.routed_experts, start=0)
        sample.finish_reason = self.finish_reason
        sample.worker_id = self.worker_id
        if not sample.first_token_time and self.first_token_time:
            sample.first_token_time = self.first_token_time
        sample.finish_time = self.finish_time

    def shifted(self, offset: float) -> Completion:
        """Same record with every time moved by `offset` seconds (worker clock -> driver clock)."""
        out = replace(self, tokens=list(self.tokens), logprobs=list(self.logprobs),
                      version_spans=[tuple(s) for s in self.version_spans])
        for key in ("submit_time", "first_token_time", "finish_time"):
            if getattr(out, key):
                setattr(out, key, getattr(out, key) + offset)
        return out


@dataclass
class WorkerLoad:
    worker_id: int
    running: int  # requests submitted and not yet finished or aborted
    pending_tokens: int  # sum over running requests of tokens still allowed (max_tokens - generated)
    generated_tokens: int  # tokens generated since the worker started
    version: int  # policy version the engine holds
    tp: int


@dataclass
class SyncReport:
    version: int  # policy version after the sync
    num_tensors: int
    bytes: int  # bytes of tensor data moved from the trainer side (once, not per engine)
    num_buckets: int
    num_engines: int
    seconds: float  # wall time from the first tensor to every engine holding the new weights
    transport: str  # "object_store+shm" | "shm" (CPU) | "nccl" | "ipc" (GPU)
    mode: str = ""  # trainer pushes: "pipelined" or "serial" (`weight_sync.SYNC_MODES`)
    # The most bytes the stage senders' shared-memory slots held at once, summed over senders (CPU "shm")
    shm_peak_bytes: int = 0

    @property
    def gib_per_s(self) -> float:
        return self.bytes / max(self.seconds, 1e-9) / 2**30

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "gib_per_s": self.gib_per_s}


@dataclass
class EngineSlot:
    """One engine of the pool as the pool tracks it (its Ray actor, state and counters); the pool and its weight
    delivery (`pool_weights.py`) both read it, so it stands here, below both."""

    index: int
    tp: int
    actor: Any = None
    state: str = "starting"  # starting | ready | dead
    start_ref: Any = None
    poll_ref: Any = None
    pending: list[GenRequest] = field(default_factory=list)  # submitted while starting
    clock_offset: float = 0.0
    pid: int = -1
    generated: int = 0
    last_progress: float = 0.0
    info: dict[str, Any] = field(default_factory=dict)
