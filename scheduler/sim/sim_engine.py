"""One continuously batched engine of the cluster simulator (`scheduler/sim/simulator.py`, which documents the model:
admission with prefill, decode chunks from event to event, KV preemption, lookahead and tail migration).

    from scheduler.sim.sim_engine import SimEngine      # built by Simulator.set_layout, one per engine of the layout

Split out of simulator.py to keep both files readable; the event loop, rounds and harvests stay there.
Left out: everything above one engine (queues across engines, policies, rewards): the `Simulator` does them.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any

from scheduler.cost_model import EngineCostModel
from scheduler.protocol import Request
from scheduler.sim.tail_migration import take_running


class SimSeq:
    __slots__ = ("req", "target", "gen0", "gen", "prompt", "first", "rate", "pos", "cached")

    def __init__(self, req: Request, target: int) -> None:
        self.req, self.target = req, target
        self.gen0 = self.gen = req.sample.response_length  # tokens at submission / now
        self.prompt = max(1, len(req.sample.prompt_tokens))
        self.first = True  # a first_token event is due after its first prefill (not after a preemption's)
        self.rate, self.pos = 1, 1  # tokens per engine step, positions verified per step (HistoSpec)
        self.cached = 0  # context tokens its next admission need not prefill (prefix cache after a tool call)

    @property
    def context(self) -> int:
        return self.prompt + self.gen


class SimEngine:
    """One continuously batched engine; state is exact at `t` and a planned chunk runs to `t_next`."""

    def __init__(self, wid: int, tp: int, model: EngineCostModel, sim: Any) -> None:
        # `sim` is the `Simulator` that owns this engine (its queues, clock and hooks); it imports this module,
        # never the other way round, so the engine names it only here.
        self.wid, self.tp, self.model, self.sim = wid, tp, model, sim
        self.cap, self.max_seqs = model.kv_capacity(tp), model.max_num_seqs
        self.t = 0.0
        self.running: list[SimSeq] = []  # admission order (the last one is preempted first)
        self.preempted: deque[SimSeq] = deque()
        self.ctx = 0  # KV tokens held by running sequences
        self.ahead = False  # runs the next round's lookahead requests (took one while it had no round work)
        self.idle_since: float | None = None  # since when it has had nothing to run (stream training uses its GPUs)
        self.chunk = (0, 0.0)  # planned decode steps and their duration from t
        self.token = 0  # invalidates stale heap entries

    # planning ---------------------------------------------------------------------------------------------
    def plan(self) -> None:
        self.token += 1
        if not self.running:
            self.chunk = (0, 0.0)
            return
        b = len(self.running)
        if self.sim.spec is None:
            steps = min(s.target - s.gen for s in self.running)
            rates = pos = b
        else:
            steps = min(math.ceil((s.target - s.gen) / s.rate - 1e-9) for s in self.running)
            rates, pos = sum(s.rate for s in self.running), sum(s.pos for s in self.running)
        room = int((self.cap - self.ctx) // rates)
        steps = max(1, min(steps, room)) if room >= 1 else 1
        dt = steps * self.sim.step_s(self.model, self.tp, b, pos, self.ctx + rates * steps / 2)
        self.chunk = (steps, dt)
        self.sim.push(self.t + dt, self)

    def advance_to(self, t: float, finish_step: bool = False) -> None:
        """Applies the part of the planned chunk that fits before `t`: the steps completed by then (the round
        is harvested at `t`), or with `finish_step` up to the end of the step running at `t` (a mid-round abort:
        a real engine finishes its step, then drops the request, so no time is lost to a half step)."""
        steps, dt = self.chunk
        if not self.running or t <= self.t or dt <= 0:
            return
        frac = steps * (t - self.t) / dt
        done = min(steps, math.ceil(frac) if finish_step else int(frac))
        if finish_step and done == steps:  # the chunk ends with this step: its finishes happen as planned
            self.on_event()
            return
        for s in self.running:
            s.gen += done * s.rate
            self.ctx += done * s.rate
        self.t = self.t + dt * done / steps if finish_step else t

    # events -----------------------------------------------------------------------------------------------
    def on_event(self) -> None:
        steps, dt = self.chunk
        for s in self.running:
            s.gen += steps * s.rate
            self.ctx += steps * s.rate
        self.t += dt
        still = []
        for s in self.running:
            if s.gen >= s.target - 1e-6:
                self.ctx -= s.context
                s.gen = s.target  # a speculative step may overshoot in expectation: EOS ends it
                self.sim.finished(self, s)
            else:
                still.append(s)
        self.running = still
        # The next step would overflow the KV cache: preempt (a lone sequence is let through rather than thrash).
        while len(self.running) > 1 and self.ctx + len(self.running) > self.cap:
            victim = self.running.pop()
            self.ctx -= victim.context
            self.preempted.appendleft(victim)
            self.sim.preemptions += 1
        self.admit()

    def admit(self, steal: bool = True) -> None:
        prefill, started = 0, []
        while len(self.running) < self.max_seqs:
            if not self.preempted:
                # Take work from another worker's queue only when there is KV room to start it now.
                req = self.sim.queues.pop(self.wid, steal=steal and self.ctx < 0.9 * self.cap)
                if (req is None and steal and self.sim.ahead and (self.ahead or not self.running)
                        and len(self.running) < self.sim.ahead_share):
                    # Lookahead: only an engine with no round work left starts them, so the round's tail never
                    # shares a batch with them; each takes its share in flight, so every engine that runs dry
                    # finds some (an engine that filled all its slots would leave the last ones nothing).
                    req, self.ahead = self.sim.ahead.popleft(), True
                if req is None:
                    # Tail migration (scheduler/sim/tail_migration.py): run dry, take a running request of the busiest.
                    moved = (take_running(self.sim, self) if steal and self.sim.sim.cluster.tail_migration
                             and not self.running else None)
                    if moved is None:
                        break
                    self.preempted.append(moved)
                else:
                    self.preempted.append(self.sim.start(self, req))
            seq = self.preempted[0]
            if self.running and self.ctx + seq.context + len(self.running) + 1 > self.cap:
                break  # no KV room yet: it waits inside the engine
            self.preempted.popleft()
            self.running.append(seq)
            self.ctx += seq.context
            prefill += seq.context - seq.cached
            seq.cached = 0
            started.append(seq)
        if prefill:
            self.t += self.model.prefill_s(self.tp, prefill)
            for seq in started:
                if seq.first:
                    seq.first = False
                    self.sim.emit("request", "first_token", self.t, worker=self.wid, sample_id=seq.req.sample.sample_id,
                                  tokens=seq.gen)
        if self.running or self.preempted:
            self.idle_since = None
        elif self.idle_since is None:
            self.idle_since = self.t
        if self.running and not self.sim.busy[self.wid]:
            self.sim.busy[self.wid] = True
            self.sim.emit("worker", "busy", self.t, worker=self.wid)
        elif not self.running and not self.preempted and self.sim.busy[self.wid]:
            self.sim.busy[self.wid] = False
            self.sim.emit("worker", "idle", self.t, worker=self.wid)
        self.plan()

    def abort(self, sample_id: str) -> SimSeq | None:
        for pool in (self.running, self.preempted):
            for s in pool:
                if s.req.sample.sample_id == sample_id:
                    pool.remove(s)
                    if pool is self.running:
                        self.ctx -= s.context
                    return s
        return None
