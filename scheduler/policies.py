"""Tier-1 policies: round composition and harvest. Each implements `scheduler.protocol.SchedulingPolicy`.

    from scheduler.policies import make_policy
    policy = make_policy(cfg.scheduler, prompt_ids, n_samples=4, max_response_length=256, planner=planner)

- `sync`: `rollout_batch_size` prompts x n; harvest when every sample finished (the slowest decides).
- `sorted` (SortedRL): a group of `group_size` prompts x n is submitted at once (oversubscribing the
  engines); as soon as `update_batch_size / n` prompts have all n samples finished, they are harvested
  (shortest first) and everything still running is aborted: re-queued from scratch (on_policy) or cached
  with tokens, log-probs and versions and resumed next round (partial, dropped past `max_staleness`).
  No new prompt is loaded before the whole group has been trained; the group's last round waits for all.
- `tail` (RollPacker tail batching, on-policy): a short round launches ceil(eta * P0) prompts with
  ceil(eta * n) responses each (eta = `oversubscription`, P0 = `rollout_batch_size`), keeps the first n
  responses of the first P0 prompts to complete, aborts the rest and defers those prompts to the long-tail
  queue. Prompts whose history predicts a long response are deferred before they run. A long round runs
  the first P0 queued prompts x n at full length (no over-provisioning) when the queue holds P0 of them, or
  whatever is queued once the data is exhausted.
- `twotier` (ours, the default): carry-over rounds. Up to `group_size` prompts x n run at once (enough to
  fill the engines, as SortedRL's group); a round is harvested once every prompt *carried* into it is
  complete and at least max(`rollout_batch_size`, half the round's prompts) are: every prompt complete then
  is trained (carrying a complete one would only make it stale). The unfinished ones are carried: running
  samples are aborted and resumed in the next round as partials (tokens, log-probs and versions kept),
  which then tops up the window with fresh prompts and must train every carried prompt. So every sample
  spans at most two policy versions (staleness <= 1), nothing is over-provisioned or restarted, and no token is thrown away in partial mode
  (in on_policy mode the carried partials restart). Whatever the tail, the slower half of the window is
  carried: its long responses finish in the next round while fresh prompts keep the engines full (the
  price: a quarter to a half of the trained samples are one version stale). Tier 2 places
  each round's requests by predicted length (history, `placement`). An update trains between
  `rollout_batch_size` and `group_size` prompts (the grid reports the number of updates). The group rule
  is replaced by a stronger per-prompt bound: a prompt is trained in the round it first runs or the next.
  With dynamic sampling (`scheduler/selective.py`) two things change, both because a round may end without an
  update: a prompt dropped by the filter counts as complete towards half the window (and towards what the
  round consumes), and a carried prompt is due only once the policy version has moved since it first ran, so
  the bound reads "in the update it first runs in or the next" (the same as above when every round updates).
  Per-round decisions are logged (`Harvest.stats["decision"]`).
  With `lookahead` (partial mode) the round also opens up to `target` prompts of the next window as
  `Round.lookahead`: an engine that has run out of the round's requests starts them while the round waits
  for its tail, instead of idling. They are never trained in that round; they are carried (due next round),
  so the per-prompt bound and staleness <= 1 hold unchanged.

Left out: asynchronous (overlapping) generation and training: `scheduler.policy=async` is
`scheduler.asynchronous.AsyncPolicy`, run by its own loop (megatron_sortedrl/async_loop.py).
"""

from __future__ import annotations

import math
from typing import Any

from scheduler.base import PolicyBase, PromptState
from scheduler.protocol import Clock, Harvest, Round

POLICIES = ("sync", "sorted", "tail", "twotier")


class SyncPolicy(PolicyBase):
    name = "sync"

    def compose_round(self, clock: Clock) -> Round | None:
        if not self.live:
            for pid, epoch in self.cursor.take(self.cfg.rollout_batch_size):
                self.open_prompt(pid, epoch, self.n)
        if not self.live:
            return None
        return self.make_round("sync", list(self.live.values()))

    def harvest(self, clock: Clock) -> Harvest | None:
        states = list(self.live.values())
        if not all(self.complete(st) for st in states):
            return None
        return self.finish_harvest(self.take(states), [])


class SortedPolicy(PolicyBase):
    """SortedRL; with `route_long` it is `twotier`."""

    name = "sorted"
    route_long = False

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.group_index = 0
        self.queue: list[str] = []  # twotier: keys of the current group's prompts routed to its long round
        self.final = False  # the current short round must wait for all its prompts

    @property
    def need(self) -> int:
        return max(1, self.cfg.update_batch_size // self.n)

    def compose_round(self, clock: Clock) -> Round | None:
        deferred: list[str] = []
        if not self.live:  # group consumed: load the next one
            self.queue = []
            for pid, epoch in self.cursor.take(self.cfg.group_size):
                self.open_prompt(pid, epoch, self.n, group=self.group_index)
            self.group_index += 1
        if not self.live:
            return None
        short = [st for st in self.live.values() if not st.long]
        if self.route_long:
            for st in short:
                if self.predicted_long(st):  # history, or an aborted partial that already ran past the threshold
                    deferred.append(self._defer(st))
            short = [st for st in short if not st.long]
            if short and len(short) < self.need and self.queue:
                deferred.extend(self._defer(st) for st in short)  # too few to fill an update: ride along
                short = []
        if short:
            self.final = len(short) <= self.need
            return self.make_round("short", short, deferred)
        return self.make_round("long", self.states(self.queue), deferred)

    def _defer(self, st: PromptState) -> str:
        st.long = True
        self.queue.append(st.key)
        return st.key

    def harvest(self, clock: Clock) -> Harvest | None:
        assert self.round is not None, "harvest before compose_round"
        states = self.states(self.round.prompts)  # (dynamic sampling may have dropped some)
        done = [st for st in states if self.complete(st)]
        if self.round.kind == "long" or self.final or len(states) <= self.need:
            if len(done) < len(states):
                return None
            chosen = done
        elif len(done) < self.need:
            return None
        else:
            chosen = sorted(done, key=self.completed_at)[: self.need]
        chosen_keys = {st.key for st in chosen}
        for st in states:
            if st.key not in chosen_keys and st.ids("running"):
                st.aborted_rounds += 1
        return self.finish_harvest(self.take(chosen), self.running_ids())

    def extra_state(self) -> dict[str, Any]:
        return {"group_index": self.group_index, "queue": list(self.queue), "final": self.final}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        self.group_index, self.queue, self.final = state["group_index"], list(state["queue"]), state["final"]


class TwoTierPolicy(PolicyBase):
    """Ours: carry-over rounds over a window of `group_size` prompts; see the module docstring.

    Every round logs one small dict (`decision`, also `Harvest.stats["decision"]` and `stats["decisions"]`):
    what it carried in, what it loaded, the harvest target and what it trained and carried out. The rules
    read only the policy's own state, so the same events give the same decisions.
    """

    name = "twotier"

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.carry: list[str] = []  # keys of prompts that ran in the last round and were not trained
        self.opened: dict[str, int] = {}  # key of a live prompt -> policy version when it first ran (due once older)
        self.target = 0  # prompts the current round trains at least
        self.ahead: list[str] = []  # keys of the lookahead prompts of the current round (trained next round)
        self.decision: dict[str, Any] = {}

    def compose_round(self, clock: Clock) -> Round | None:
        carried = self.states(self.carry)
        window = max(self.cfg.rollout_batch_size, self.cfg.group_size)
        fresh = [self.open_prompt(pid, epoch, self.n) for pid, epoch in self.cursor.take(window - len(carried))]
        states = carried + fresh
        if not states:
            return None
        # Train at least one rollout batch and at least half of what runs: a cut any earlier would carry more
        # prompts than the next update can hold, a cut any later waits on the tail.
        self.target = min(len(states), max(self.cfg.rollout_batch_size, math.ceil(len(states) / 2)))
        rnd = self.make_round("short", states)
        self.ahead = []
        if self.cfg.lookahead:  # at most what this harvest frees, so the next window stays `window` prompts
            ahead = [self.open_prompt(pid, epoch, self.n) for pid, epoch in self.cursor.take(self.target)]
            self.ahead = [st.key for st in ahead]
            rnd.lookahead = sorted(self.requests_for(ahead), key=lambda r: -r.predicted_length)
        self.opened = {k: v for k, v in self.opened.items() if k in self.live}  # (trained or dropped ones leave)
        for key in [st.key for st in fresh] + self.ahead:
            self.opened[key] = self.version
        self.decision = {"round": self.round_index, "carried": len(carried), "fresh": len(fresh), "target": self.target,
                         "lookahead": len(self.ahead)}
        return rnd

    def harvest(self, clock: Clock) -> Harvest | None:
        assert self.round is not None, "harvest before compose_round"
        states = self.states(self.round.prompts)  # (dynamic sampling may have dropped some)
        due = {k for k in self.carry if k in self.live and self.opened.get(k, -1) < self.version}
        if not all(self.complete(self.live[k]) for k in due):
            return None  # carried prompts hold tokens of the previous version: trained now, or they would go stale
        done = [st for st in states if self.complete(st)]
        # A prompt of this round that left the live set was dropped by dynamic sampling: its group is complete
        # (just not trained), so it counts towards the half of the window that must be complete, and towards
        # what this round consumes. Without the filter `filtered` is 0 and the rule is unchanged.
        filtered = len(self.round.prompts) - len(states)
        if len(done) + filtered < min(self.target, len(self.round.prompts)):
            return None
        # Every complete prompt is trained at the cut: carrying a complete one gains nothing (it has no tokens
        # left to generate) and only makes it one version stale. The target decides when to cut, not how much.
        chosen = [st for st in done if st.key in due] + sorted((st for st in done if st.key not in due),
                                                                key=self.completed_at)
        chosen_keys = {st.key for st in chosen}
        # Lookahead prompts were started early by idle engines: due next round like the carried ones.
        self.carry = [st.key for st in states if st.key not in chosen_keys] + [k for k in self.ahead if k in self.live]
        for st in states:
            if st.key not in chosen_keys and st.ids("running"):
                st.aborted_rounds += 1
        decision = {**self.decision, "due": len(due), "trained": len(chosen), "filtered": filtered, "carry_next": len(self.carry),
                    "t_harvest": round(clock.now(), 3)}
        self.stats.setdefault("decisions", []).append(decision)
        return self.finish_harvest(self.take(chosen), self.running_ids(), decision=decision)

    def extra_state(self) -> dict[str, Any]:
        return {"carry": list(self.carry), "target": self.target, "decision": dict(self.decision), "ahead": list(self.ahead),
                "opened": dict(self.opened)}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        self.carry, self.target, self.decision = list(state["carry"]), state["target"], dict(state["decision"])
        self.ahead = list(state.get("ahead", []))
        self.opened = dict(state.get("opened", {}))  # (absent in older checkpoints: every carried prompt is due)


class TailPolicy(PolicyBase):
    name = "tail"
    restart_aborted = True  # RollPacker is on-policy: aborted prompts restart from scratch in the long round

    def __init__(self, *args: Any, route_by_history: bool = True, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.route_by_history = route_by_history
        self.queue: list[str] = []  # long-tail queue of prompt keys, FIFO
        self.target = 0  # prompts the current short round keeps

    def compose_round(self, clock: Clock) -> Round | None:
        p0 = self.cfg.rollout_batch_size
        if len(self.queue) >= p0 or (self.cursor.exhausted and self.queue):
            return self._long_round()
        want, responses = math.ceil(self.cfg.oversubscription * p0), math.ceil(self.cfg.oversubscription * self.n)
        states: list[PromptState] = []
        deferred: list[str] = []
        while len(states) < want and not self.cursor.exhausted:
            for pid, epoch in self.cursor.take(want - len(states)):
                st = self.open_prompt(pid, epoch, responses)
                if self.route_by_history and self.predicted_long(st):
                    st.long = True
                    self.queue.append(st.key)
                    deferred.append(st.key)
                else:
                    states.append(st)
        if not states:
            return self._long_round(deferred) if self.queue else None
        self.target = min(p0, len(states))
        return self.make_round("short", states, deferred)

    def _long_round(self, deferred: list[str] | None = None) -> Round:
        keys, self.queue = self.queue[: self.cfg.rollout_batch_size], self.queue[self.cfg.rollout_batch_size:]
        states = self.states(keys)
        for st in states:  # fresh n responses, no over-provisioning
            for s in st.samples:
                self.by_sample.pop(s.sample_id, None)
                self.stats["wasted_tokens"] += s.response_length
            del self.live[st.key]
            self.open_prompt(st.prompt_id, st.epoch, self.n).long = True
        return self.make_round("long", self.states(keys), deferred or [])

    def on_sample_finished(self, sample: Any, clock: Clock) -> list[str]:
        super().on_sample_finished(sample, clock)
        st = self._state(sample)
        if st is not None and self.round is not None and self.round.kind == "short" and self.complete(st, self.n):
            return st.ids("running")  # the prompt has its n responses: free the surplus slots now
        return []

    def harvest(self, clock: Clock) -> Harvest | None:
        assert self.round is not None, "harvest before compose_round"
        states = self.states(self.round.prompts)  # (dynamic sampling may have dropped some)
        if self.round.kind == "long":
            if not all(self.complete(st, self.n) for st in states):
                return None
            return self.finish_harvest(self.take(states, self.n), [])
        done = [st for st in states if self.complete(st, self.n)]
        if len(done) < min(self.target, len(states)):
            return None
        chosen = sorted(done, key=lambda st: self.completed_at(st, self.n))[: self.target]
        chosen_keys = {st.key for st in chosen}
        deferred = []
        for st in states:
            if st.key not in chosen_keys:
                st.long = True
                self.queue.append(st.key)
                deferred.append(st.key)
        abort = self.running_ids()
        return self.finish_harvest(self.take(chosen, self.n), abort, deferred=deferred)

    def extra_state(self) -> dict[str, Any]:
        return {"queue": list(self.queue), "target": self.target}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        self.queue, self.target = list(state["queue"]), state["target"]


POLICY_CLASSES: dict[str, type[PolicyBase]] = {
    "sync": SyncPolicy, "sorted": SortedPolicy, "tail": TailPolicy, "twotier": TwoTierPolicy,
}


def make_policy(cfg: Any, prompt_ids: Any, *, sampling: Any = None, **kw: Any) -> Any:
    """The policy named by `cfg.policy` (a `SchedulerConfig`); keyword arguments as `PolicyBase`. With a
    `SamplingConfig` whose `dynamic` is on, it is wrapped in `scheduler.selective.SelectivePolicy`."""
    if cfg.policy == "async":  # the driver's asynchronous loop runs it (megatron_sortedrl/async_loop.py)
        from scheduler.asynchronous import AsyncPolicy

        return AsyncPolicy(cfg, prompt_ids, **kw)
    kw.pop("mini_batch", None)
    policy = POLICY_CLASSES[cfg.policy](cfg, prompt_ids, **kw)
    if sampling is not None and sampling.dynamic:
        from scheduler.selective import SelectivePolicy

        policy = SelectivePolicy(policy, sampling, seed=kw.get("seed", 0))
    return policy
