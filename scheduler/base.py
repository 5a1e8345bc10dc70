"""Bookkeeping shared by the tier-1 policies: data cursor, live prompts and their samples, staleness,
history updates, placement and checkpoint state. The policies in `scheduler/policies.py` only decide
round composition and harvest on top of it.

A *prompt instance* is one prompt in one epoch, keyed "<prompt_id>/e<epoch>"; it owns the samples
generated for it (n, or more when a policy over-provisions responses). A sample is in one of three
states: queued (not running: fresh, or a cached partial in partial mode), running, finished (scored).

Staleness of a sample at harvest is `version - sample.oldest_version` (0: fully on-policy). On-policy
mode resets any sample holding tokens from an older version before it is submitted or trained; partial
mode keeps them up to `max_staleness` versions and resets older ones (their tokens are counted as wasted).

Trajectories (multi-turn samples with tool calls): the driver (or the simulator) sets `trajectory_info`, a
function of a finished sample returning its (assistant turns, tool seconds), and `tokens_per_tool_s`; the history
then records each trajectory and every prediction the policies and placement use is the trajectory's cost
(`LengthHistory.predict_cost`: tokens plus tool seconds on its critical path, in token units). Aborts and
carry-over need nothing more: a partial sample keeps its tokens, so it keeps its completed turns (and in partial
mode the turn in progress too); on-policy resets drop them as they drop any stale token.

Left out: data loading itself (the cursor yields prompt ids; the driver's `sample_factory` fills tokens).
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from megatron_sortedrl.sample import Sample
from scheduler.config import SchedulerConfig
from scheduler.history import LengthHistory
from scheduler.layout import FixedPlanner
from scheduler.placement import place
from scheduler.protocol import Clock, Harvest, Request, Round

SampleFactory = Callable[[str, int, int], Sample]  # (prompt_id, epoch, index) -> fresh Sample


def prompt_key(prompt_id: str, epoch: int) -> str:
    return f"{prompt_id}/e{epoch}"


class DataCursor:
    """Prompt ids epoch by epoch, shuffled per epoch with a seeded RNG; `num_epochs=None` never ends."""

    def __init__(self, prompt_ids: Sequence[str], num_epochs: int | None = None, seed: int = 0) -> None:
        self.prompt_ids, self.num_epochs, self.seed = list(prompt_ids), num_epochs, seed
        self.epoch, self.pos = 0, 0

    def _order(self, epoch: int) -> list[str]:
        order = list(self.prompt_ids)
        random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    @property
    def exhausted(self) -> bool:
        return not self.prompt_ids or (self.num_epochs is not None and self.epoch >= self.num_epochs)

    def take(self, k: int) -> list[tuple[str, int]]:
        out: list[tuple[str, int]] = []
        while len(out) < k and not self.exhausted:
            order = self._order(self.epoch)
            chunk = order[self.pos: self.pos + k - len(out)]
            out.extend((pid, self.epoch) for pid in chunk)
            self.pos += len(chunk)
            if self.pos >= len(order):
                self.epoch, self.pos = self.epoch + 1, 0
        return out

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.pos = state["epoch"], state["pos"]


@dataclass
class PromptState:
    prompt_id: str
    epoch: int
    samples: list[Sample] = field(default_factory=list)
    status: dict[str, str] = field(default_factory=dict)  # sample_id -> queued | running | finished
    done_at: dict[str, float] = field(default_factory=dict)  # sample_id -> clock time it finished
    aborted_rounds: int = 0  # rounds in which some of its samples were aborted unfinished
    group: int = 0  # group index (sorted/twotier)
    long: bool = False  # routed to the long-tail queue
    n_finished: int = 0  # samples with status "finished" (kept by `mark`)

    @property
    def key(self) -> str:
        return prompt_key(self.prompt_id, self.epoch)

    def mark(self, sample_id: str, status: str) -> None:
        """Sets a sample's status, keeping the finished count that harvest checks after every event."""
        old = self.status.get(sample_id)
        self.status[sample_id] = status
        self.n_finished += (status == "finished") - (old == "finished")

    def ids(self, status: str) -> list[str]:
        return [sid for sid, st in self.status.items() if st == status]

    def finished_samples(self) -> list[Sample]:
        return sorted((s for s in self.samples if self.status[s.sample_id] == "finished"),
                      key=lambda s: self.done_at[s.sample_id])

    def to_dict(self) -> dict[str, Any]:
        return {"prompt_id": self.prompt_id, "epoch": self.epoch, "samples": [s.to_dict() for s in self.samples],
                "status": {k: ("queued" if v == "running" else v) for k, v in self.status.items()},
                "done_at": self.done_at, "aborted_rounds": self.aborted_rounds, "group": self.group, "long": self.long}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PromptState:
        st = cls(prompt_id=d["prompt_id"], epoch=d["epoch"], samples=[Sample.from_dict(s) for s in d["samples"]],
                 done_at=dict(d["done_at"]), aborted_rounds=d["aborted_rounds"], group=d["group"], long=d["long"])
        for sid, status in d["status"].items():
            st.mark(sid, status)
        return st


class PolicyBase:
    """Shared state and default event handling; subclasses implement `compose_round` and `harvest`."""

    name = "base"

    def __init__(self, cfg: SchedulerConfig, prompt_ids: Sequence[str], *, n_samples: int, max_response_length: int,
                 planner: FixedPlanner, num_epochs: int | None = None, seed: int = 0,
                 sample_factory: SampleFactory | None = None, history: LengthHistory | None = None) -> None:
        self.cfg, self.n, self.max_len, self.planner = cfg, n_samples, max_response_length, planner
        self.cursor = DataCursor(prompt_ids, num_epochs, seed)
        self.factory = sample_factory or (lambda pid, epoch, idx: Sample(prompt_id=pid, index=idx, epoch=epoch))
        self.history = history or LengthHistory(cfg.predictor, cfg.predictor_quantile, cfg.history_max_prompts)
        self.version, self.round_index = 0, 0
        self.live: dict[str, PromptState] = {}  # prompt key -> state, insertion order = arrival order
        self.by_sample: dict[str, str] = {}  # sample_id -> prompt key
        self.round: Round | None = None
        self.stats: dict[str, Any] = {"staleness": Counter(), "wasted_tokens": 0, "resumed": 0, "reset_stale": 0}
        # sample id -> tokens already counted, for responses still running when their prompt left the live set
        # (taken with its group complete, or dropped): what they generate until handed back is waste too
        self._gone: dict[str, int] = {}
        # Trajectories (module docstring): finished sample -> (turns, tool seconds); None for single-turn runs.
        self.trajectory_info: Callable[[Sample], tuple[int, float]] | None = None
        self.tokens_per_tool_s = 0.0

    # -- helpers for subclasses ---------------------------------------------------------------------------

    def open_prompt(self, prompt_id: str, epoch: int, responses: int, group: int = 0) -> PromptState:
        st = PromptState(prompt_id, epoch, group=group)
        st.samples = [self.factory(prompt_id, epoch, i) for i in range(responses)]
        for s in st.samples:
            st.mark(s.sample_id, "queued")
            self.by_sample[s.sample_id] = st.key
        self.live[st.key] = st
        return st

    def predict(self, st: PromptState) -> float:
        return self.history.predict_cost(st.prompt_id, self.tokens_per_tool_s)

    def predicted_long(self, st: PromptState) -> bool:
        """Only history about this prompt counts: the dataset-wide fallback must not route unseen prompts."""
        return self.history.known(st.prompt_id) and self.predict(st) > self.cfg.long_round_threshold * self.max_len

    def reset_sample(self, st: PromptState, s: Sample) -> None:
        self.stats["wasted_tokens"] += s.response_length
        s.reset_response()
        st.mark(s.sample_id, "queued")
        st.done_at.pop(s.sample_id, None)

    def refresh(self, st: PromptState) -> None:
        """Resets samples too old to be trained at the current version (see the module docstring)."""
        limit = 0 if self.cfg.mode == "on_policy" else self.cfg.max_staleness
        for s in st.samples:
            if st.status[s.sample_id] != "running" and s.version_spans and self.version - s.oldest_version > limit:
                self.stats["reset_stale"] += 1
                self.reset_sample(st, s)

    def make_round(self, kind: str, states: list[PromptState], deferred: Sequence[str] = ()) -> Round:
        """Refreshes, builds and places the requests for every queued sample of `states`."""
        self._gone.clear()  # (the last round's aborts were all handed back before this one is composed)
        requests = self.requests_for(states)
        prompt_len = sum(len(r.sample.prompt_tokens) for r in requests) / max(1, len(requests))
        layout = self.planner.plan(kind, [r.predicted_length for r in requests], prompt_len)
        model = self.planner.model
        place(requests, layout.num_engines, self.cfg.placement, model.kv_capacity(layout.tp) if model else None)
        self.round = Round(index=self.round_index, kind=kind, version=self.version, layout=layout, requests=requests,
                           prompts=[st.key for st in states], deferred=list(deferred))
        return self.round

    def requests_for(self, states: list[PromptState]) -> list[Request]:
        """Refreshes `states` and marks their queued samples running; one request each."""
        requests: list[Request] = []
        for st in states:
            self.refresh(st)
            guess = self.predict(st)
            for s in st.samples:
                if st.status[s.sample_id] != "queued":
                    continue
                if s.response_length:
                    s.num_resumes += 1
                    self.stats["resumed"] += 1
                st.mark(s.sample_id, "running")
                s.finish_reason, s.predicted_length = "", guess
                requests.append(Request(sample=s, worker=0, predicted_length=max(guess, s.response_length),
                                        max_tokens=self.max_len - s.response_length))
        return requests

    def complete(self, st: PromptState, need: int | None = None) -> bool:
        need = len(st.samples) if need is None else need
        return st.n_finished >= need

    def completed_at(self, st: PromptState, need: int | None = None) -> float:
        """Clock time at which `need` (default: all) of the prompt's samples had finished."""
        times = sorted(st.done_at.values())
        return times[min(len(times), need or len(st.samples)) - 1] if times else 0.0

    def states(self, keys: Sequence[str]) -> list[PromptState]:
        """The live prompts among `keys`: a prompt dropped by the dynamic-sampling filter has left the live set."""
        return [self.live[k] for k in keys if k in self.live]

    def drop(self, st: PromptState) -> list[str]:
        """Removes a prompt without training it (dynamic sampling: its group is uninformative); returns the ids of
        its samples still running, which the driver must abort. Its tokens count as `filtered_tokens`."""
        running = st.ids("running")
        for s in st.samples:
            self.by_sample.pop(s.sample_id, None)
            self.stats["filtered_tokens"] = self.stats.get("filtered_tokens", 0) + s.response_length
            if s.sample_id in running:
                self._gone[s.sample_id] = s.response_length
        del self.live[st.key]
        for name in ("queue", "carry"):  # the policies' own key lists (long-tail queue, carried prompts)
            keys = getattr(self, name, None)
            if isinstance(keys, list) and st.key in keys:
                keys.remove(st.key)
        return running

    def running_ids(self) -> list[str]:
        return [sid for st in self.live.values() for sid in st.ids("running")]

    def take(self, states: list[PromptState], per_prompt: int | None = None) -> list[Sample]:
        """Removes `states` from the live set; returns their first `per_prompt` finished samples, short-first."""
        batch: list[Sample] = []
        for st in states:
            kept = st.finished_samples()[: per_prompt or len(st.samples)]
            kept_ids = {s.sample_id for s in kept}
            for s in st.samples:
                self.by_sample.pop(s.sample_id, None)
                if s.sample_id not in kept_ids:
                    self.stats["wasted_tokens"] += s.response_length
                    if st.status[s.sample_id] == "running":
                        self._gone[s.sample_id] = s.response_length
            batch.extend(kept)
            del self.live[st.key]
        for s in batch:
            self.stats["staleness"][self.version - s.oldest_version] += 1
        return sorted(batch, key=lambda s: s.response_length)

    def finish_harvest(self, batch: list[Sample], abort: list[str], **stats: Any) -> Harvest:
        self.round_index += 1
        staleness = [self.version - s.oldest_version for s in batch]
        return Harvest(batch=batch, abort=abort, stats={"staleness": staleness, **stats})

    # -- protocol: event handling -------------------------------------------------------------------------

    def _state(self, sample: Sample) -> PromptState | None:
        key = self.by_sample.get(sample.sample_id)
        return self.live.get(key) if key else None

    def _count_gone(self, sample: Sample) -> bool:
        """A response handed back (finished or aborted) after its prompt left the live set while it ran: what it
        generated since counts as waste. Returns whether it was one."""
        if sample.sample_id not in self._gone:
            return False
        self.stats["wasted_tokens"] += max(0, sample.response_length - self._gone.pop(sample.sample_id))
        return True

    def on_sample_finished(self, sample: Sample, clock: Clock) -> list[str]:
        if self._count_gone(sample):
            return []
        st = self._state(sample)
        if st is None or sample.sample_id not in st.status:  # already dropped (e.g. a surplus response)
            return []
        if self.stale_attempt(st, sample):
            return []
        self._adopt(st, sample)
        st.mark(sample.sample_id, "finished")
        st.done_at[sample.sample_id] = clock.now()
        if self.trajectory_info is None:
            self.history.record(st.prompt_id, st.epoch, sample.response_length)
        else:
            turns, tool_s = self.trajectory_info(sample)
            self.history.record(st.prompt_id, st.epoch, sample.response_length, turns=turns, tool_s=tool_s)
        return []

    def on_sample_aborted(self, sample: Sample, clock: Clock) -> None:
        if self._count_gone(sample):
            return
        st = self._state(sample)
        if st is None or sample.sample_id not in st.status:
            return
        s = self._adopt(st, sample)
        self.history.record_lower_bound(st.prompt_id, s.response_length)
        s.finish_reason = "abort"
        st.mark(s.sample_id, "queued")
        if self.cfg.mode == "on_policy" or self.restart_aborted:
            self.reset_sample(st, s)

    restart_aborted = False  # tail batching restarts aborted samples from scratch even in partial mode

    def stale_attempt(self, st: PromptState, sample: Sample) -> bool:
        """Whether `sample` is an earlier attempt of a sample the policy has since restarted under the same id
        (tail batching reopens a deferred prompt for its long round while the short round's finished
        responses may still be in the reward stage): the driver stamps a sample's first submission
        (`submit_time`), which a copy keeps and a restarted sample does not share. The simulator leaves it 0."""
        mine = next((s for s in st.samples if s.sample_id == sample.sample_id), None)
        return mine is not None and mine is not sample and mine.submit_time != sample.submit_time

    def _adopt(self, st: PromptState, sample: Sample) -> Sample:
        """The driver may hand back a copy (e.g. from another process): keep the one it returned."""
        for i, s in enumerate(st.samples):
            if s.sample_id == sample.sample_id:
                st.samples[i] = sample
                return sample
        return sample

    def on_update(self, version: int, clock: Clock, preemptions: int = 0) -> None:
        self.version = version
        self.planner.observe(preemptions)

    # -- checkpointing ------------------------------------------------------------------------------------

    def extra_state(self) -> dict[str, Any]:
        return {}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume: running samples are stored as queued (the engines lose them)."""
        return {"policy": self.name, "version": self.version, "round_index": self.round_index,
                "cursor": self.cursor.state_dict(), "history": self.history.state_dict(),
                "planner": self.planner.state_dict(), "live": [st.to_dict() for st in self.live.values()],
                "extra": self.extra_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["policy"] != self.name:
            raise ValueError(f"checkpoint holds scheduler policy {state['policy']!r}, config says {self.name!r}")
        self.version, self.round_index = state["version"], state["round_index"]
        self.cursor.load_state_dict(state["cursor"])
        self.history.load_state_dict(state["history"])
        self.planner.load_state_dict(state["planner"])
        self.live = {}
        self.by_sample = {}
        for d in state["live"]:
            st = PromptState.from_dict(d)
            self.live[st.key] = st
            for s in st.samples:
                self.by_sample[s.sample_id] = st.key
        self.round = None
        self.load_extra_state(state["extra"])
