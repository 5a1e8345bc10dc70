"""Discrete-event cluster simulator that drives the real scheduling policies.

    python -m megatron_sortedrl simulate configs/sim_tiny_cpu.yaml --policies sync,sorted,tail,twotier
    from scheduler.sim.simulator import simulate; result = simulate(sim_cfg, run_cfg, "twotier")

Model (colocated, synchronous, as verl and RollPacker): each round the policy composes requests; the
simulator builds the round's engine layout (re-layout costs `cluster.relayout_s`), queues requests per
worker (`WorkerQueues`, work stealing on), and after `round_start_s` (composition and submission) runs
every engine as a continuous batcher:

- an engine admits queued requests while it has fewer than `max_num_seqs` running and KV room for their
  context; admission costs prefill time (a resumed partial re-prefills prompt + response);
- decode advances all running sequences one token per step; step time is `EngineCostModel.decode_step_s`
  of the batch and its context; the simulator jumps from event to event (next finish or KV overflow),
  integrating the step time over the growing context;
- on KV overflow the most recently admitted sequence is preempted (recompute: it re-queues at the front,
  keeps its tokens and re-prefills), counted as a preemption;
- a finished sample reaches the policy `reward_latency_s` later (rewards are scored asynchronously), plus
  its heavy-tailed scoring time on `reward.workers` reward workers when that section is on
  (`scheduler/sim/reward_cost.py`; each round reports `reward_critical_s`);
- at harvest the remaining requests are aborted and handed back with their tokens; the harvest is cut into
  mini-batches of `run.algorithm.ppo_mini_batch_size` samples as the driver cuts it (`megatron_sortedrl/minibatch.py`:
  whole groups, the remainder waits for the next harvest, flushed after the last round), and training takes
  `train_fixed_s + steps x optimizer_step_s + tokens x ppo_epochs / train_tokens_per_s`, then one `weight_sync_s`
  (or the layout's own step: a colocated switch around training, a disaggregated network sync;
  `scheduler/sim/layout_sim.py`); a harvest smaller than one mini-batch makes no step and no sync; then the next round.

Every request, phase and worker transition is written as a `megatron_sortedrl.telemetry.timeline` event,
so the bubble ratios come from the same functions as for a real run (see `scheduler/sim/report.py`).

HistoSpec (`<policy>+histospec`, `scheduler/sim/speculation_model.py`): each request advances `rate` tokens
per engine step (expected tokens per target forward at its history's age) and a step verifies `pos`
positions per sequence; without it both are 1 and the engine is the plain decoder above.

Engines may differ in speed (`cluster.engine_slowdown`) and, round to round, by a random factor
(`cluster.engine_jitter`, lognormal with mean 1): engines on shared cores, measured by `scheduler/sim/calibrate.py`.

Stream training (`cluster.stream_training`, `scheduler/sim/stream_sim.py`): colocated, GPUs of engines with nothing
left to run train the update's finished samples before the harvest; disaggregated (`cluster.trainer_gpus`), the
trainer's own GPUs do, from the round's start; the train phase keeps the rest.
Tail migration (`cluster.tail_migration`, `scheduler/sim/tail_migration.py`): an engine that ran dry takes over a
running request of the busiest engine.

Multi-turn trajectories (`workload.turns_max` > 1, `scheduler/sim/trajectory_sim.py`): turns decode as above; between
two turns the sample leaves its engine while its tool runs (log-normal latency per tool kind), then re-enters it
and prefills the tool message. With one turn none of it runs.

Left out: asynchronous RL (overlapping rollout and training across updates: `scheduler/sim/async_sim.py` runs it,
on this module's engines), stragglers and failures, and network contention during weight sync.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from megatron_sortedrl.config import RunConfig
from megatron_sortedrl.errors import UserError
from megatron_sortedrl.minibatch import MiniBatcher
from megatron_sortedrl.sample import Sample
from megatron_sortedrl.telemetry.timeline import Event
from scheduler.base import PolicyBase
from scheduler.sim.reward_cost import RewardQueue
from scheduler.cost_model import EngineCostModel
from scheduler.layout import make_planner
from scheduler.sim.layout_sim import step_phases
from scheduler.placement import WorkerQueues
from scheduler.policies import make_policy
from scheduler.protocol import Layout, ManualClock, Request, Round
from scheduler.sim.sim_config import SimConfig
from scheduler.sim.speculation_model import HistoSpecSim, split_policy
from scheduler.sim.sim_engine import SimEngine, SimSeq
from scheduler.sim.stream_sim import train_phase_s
from scheduler.sim.trajectory_sim import ToolDone, TrajectorySim, tokens_per_tool_s
from scheduler.sim.workload import make_workload


class SimulationError(RuntimeError):
    """The policy waited for samples while nothing could run (a policy bug, not a user error)."""


@dataclass
class SimResult:
    policy: str
    events: list[Event]
    rounds: list[dict[str, Any]] = field(default_factory=list)  # per round: kind, layout, samples, times
    trained: dict[str, int] = field(default_factory=dict)  # prompt key -> samples trained
    staleness: dict[int, int] = field(default_factory=dict)
    policy_stats: dict[str, Any] = field(default_factory=dict)
    total_s: float = 0.0
    max_num_seqs: int = 0
    trajectories: dict[str, Any] = field(default_factory=dict)  # multi-turn: per sample id (TrajectorySim.report)
    optimizer_steps: int = 0  # every optimizer step of the run, the final remainder's included


class Simulator:
    def __init__(self, sim: SimConfig, run: RunConfig, policy: PolicyBase, workload: Any, record: bool = True) -> None:
        self.sim, self.run, self.policy, self.workload = sim, run, policy, workload
        self.clock = ManualClock()
        self.events: list[Event] = []
        self.record = record
        self.heap: list[tuple[float, int, Any]] = []
        self.seq = itertools.count()
        self.engines: list[SimEngine] = []
        self.layout: Layout | None = None
        self.queues = WorkerQueues(1)
        self.ahead: deque[Request] = deque()  # the round's lookahead requests, longest predicted first
        self.ahead_share = 0  # lookahead requests one engine runs at a time
        self.busy: list[bool] = []
        self.targets: dict[str, int] = {}  # sample id -> length the current attempt will reach
        self.attempts: dict[str, int] = {}
        self.where: dict[str, SimEngine] = {}
        self.step = 0
        self.preemptions = 0
        self.migrations = 0  # running requests moved to an engine that ran dry (cluster.tail_migration)
        self.spec: HistoSpecSim | None = None  # set by `simulate` for `+histospec` variants
        self.by_prompt: dict[str, dict[str, SimSeq]] = {}  # prompt id -> its submitted, unfinished requests
        self.rerate: set[str] = set()  # prompts whose running requests draft from a newer sibling (HistoSpec)
        self.rewards = RewardQueue(sim.reward, sim.cluster.reward_latency_s)  # reward workers and cost per sample
        self.traj: TrajectorySim | None = None  # multi-turn trajectories (set by `simulate`; None: single-turn)
        self.minibatch = MiniBatcher(run.algorithm.ppo_mini_batch_size, run.algorithm.ppo_epochs)  # as the driver

    # plumbing ---------------------------------------------------------------------------------------------
    def emit(self, kind: str, event: str, t: float, **kw: Any) -> None:
        if self.record:
            self.events.append(Event(t=t, kind=kind, event=event, step=self.step, **kw))

    def push(self, t: float, item: Any) -> None:
        heapq.heappush(self.heap, (t, next(self.seq), (item, item.token) if isinstance(item, SimEngine) else item))

    def step_s(self, model: EngineCostModel, tp: int, batch: int, positions: float, context: float) -> float:
        if self.spec is None:
            return model.decode_step_s(tp, batch, context)
        return self.spec.step_s(model, tp, batch, positions, context)

    def start(self, engine: SimEngine, req: Request) -> SimSeq:
        s = req.sample
        sid = s.sample_id
        if s.response_length == 0 or sid not in self.targets:  # a fresh attempt draws a new length
            attempt = self.attempts.get(sid, -1) + 1
            self.attempts[sid] = attempt
            self.targets[sid] = (self.traj.draw(s, attempt) if self.traj else
                                 self.workload.length(s.prompt_id, s.epoch, s.index, attempt))
        end = self.traj.turn_end(s) if self.traj else self.targets[sid]  # a trajectory decodes turn by turn
        target = min(end, s.response_length + req.max_tokens)
        seq = SimSeq(req, max(target, s.response_length + 1))
        if self.spec is not None:
            seq.rate, seq.pos = self.spec.rate(s.prompt_id, sid, self.attempts[sid], self.policy.version)
            self.by_prompt.setdefault(s.prompt_id, {})[sid] = seq
        self.where[sid] = engine
        if self.traj:
            self.traj.started(s, engine.t)
        self.emit("request", "submit", engine.t, worker=engine.wid, sample_id=sid, tokens=s.response_length)
        return seq

    def commit(self, seq: SimSeq, version: int) -> Sample:
        s = seq.req.sample
        k = min(int(seq.gen + 1e-6), seq.target) - s.response_length
        if k > 0:  # the simulator's tokens are placeholders; lengths and versions are what matter
            s.append([0] * k, [0.0] * k, version)
        return s

    def finished(self, engine: SimEngine, seq: SimSeq) -> None:
        if self.traj is not None and self.traj.turn_ended(engine, seq):
            return  # a turn ended and a tool call follows: the sample waits off the engine
        s = self.commit(seq, self.policy.version)
        s.finish_reason = "length" if s.response_length >= self.run.rollout.max_response_length else "stop"
        if hasattr(self.workload, "reward"):  # a workload without a pass-rate process leaves rewards unset
            s.reward = self.workload.reward(s.prompt_id, s.epoch, s.index)
        s.finish_time, s.worker_id = engine.t, engine.wid
        if self.spec is not None:
            self.spec.record(s.prompt_id, s.epoch, self.policy.version)
            self.by_prompt.get(s.prompt_id, {}).pop(s.sample_id, None)
            if self.spec.ship_sibling(s.prompt_id, s.epoch, self.policy.version) and self.by_prompt.get(s.prompt_id):
                self.rerate.add(s.prompt_id)
        self.where.pop(s.sample_id, None)
        self.emit("request", "finish", engine.t, worker=engine.wid, sample_id=s.sample_id, tokens=s.response_length)
        self.push(self.rewards.arrival(engine.t, s.sample_id), s)

    def rerate_siblings(self) -> None:
        """Sibling drafts: the running siblings of a just-finished response draft from it from the next engine
        step on. Each engine holding one finishes its current step, then re-plans with the new rates."""
        while self.rerate:
            prompt = self.rerate.pop()
            seqs = [seq for sid, seq in self.by_prompt.get(prompt, {}).items() if sid in self.where]
            # Rates first (they depend on the prompt's history only): an engine none of whose sequences drafts
            # faster keeps its planned chunk, so zero acceptance leaves the run exactly as without speculation.
            faster = []
            for q in seqs:
                sid = q.req.sample.sample_id
                if q.gen < q.target and (rp := self.spec.rerate(prompt, sid, self.attempts[sid],
                                                                self.policy.version))[0] > q.rate:
                    faster.append((q, rp))
            for engine in {id(self.where[q.req.sample.sample_id]): self.where[q.req.sample.sample_id]
                           for q, _ in faster}.values():
                engine.advance_to(self.clock.t, finish_step=True)  # may finish sequences (and queue more prompts)
            touched = {}
            for q, (rate, pos) in faster:
                sid = q.req.sample.sample_id
                if sid not in self.where or q.gen >= q.target:
                    continue
                q.rate, q.pos = rate, pos
                touched[id(self.where[sid])] = self.where[sid]
            for engine in touched.values():
                engine.plan()

    def next_item(self) -> Any:
        """Pops the next event. An engine's chunk end runs here (None is returned); anything else moves the clock to
        its time and is returned (a finished sample whose reward is in, a tool call's end, a caller's own event)."""
        t, _, item = heapq.heappop(self.heap)
        if isinstance(item, tuple):
            engine, token = item
            if token == engine.token:
                self.clock.t = max(self.clock.t, t)
                engine.on_event()
                self.rerate_siblings()
            return None
        self.clock.t = max(self.clock.t, t)
        return item

    # layout -----------------------------------------------------------------------------------------------
    def set_layout(self, layout: Layout) -> None:
        if layout != self.layout:
            if self.layout is not None and self.sim.cluster.relayout_s > 0:
                self.phase("relayout", self.sim.cluster.relayout_s)
            self.layout = layout
        slow = self.sim.cluster.engine_slowdown
        jit = self.sim.cluster.engine_jitter
        rng = random.Random(f"{self.sim.workload.seed}/{self.step}")  # the same draws for every policy's round i
        self.engines = [SimEngine(w, layout.tp, self.sim.engine.scaled(
            (slow[w] if w < len(slow) else 1.0) * (math.exp(jit * rng.gauss(0, 1) - jit * jit / 2) if jit else 1.0)),
            self) for w in range(layout.num_engines)]
        self.busy = [False] * layout.num_engines
        self.queues = WorkerQueues(layout.num_engines)

    def phase(self, name: str, seconds: float) -> None:
        self.emit("phase", "start", self.clock.t, phase=name)
        self.clock.t += seconds
        self.emit("phase", "end", self.clock.t, phase=name)

    # one round --------------------------------------------------------------------------------------------
    def run_round(self, rnd: Round) -> dict[str, Any]:
        self.step = rnd.index
        self.set_layout(rnd.layout)
        if self.spec is not None:
            self.spec.publish()  # the driver ships the last round's finished samples to the drafters
        t0 = self.clock.t
        self.emit("phase", "start", t0, phase="rollout")
        self.preemptions = self.migrations = 0
        self.heap = []
        self.queues.add(self.traj.hold(rnd.requests, t0 + self.sim.cluster.round_start_s) if self.traj else rnd.requests)
        self.ahead = deque(rnd.lookahead)
        self.ahead_share = math.ceil(len(rnd.lookahead) / max(1, len(self.engines)))
        for e in self.engines:
            e.t = t0 + self.sim.cluster.round_start_s
        # As the driver fills a round (round_stream.fill): every engine takes its own queue first, then the
        # ones with free slots steal; otherwise the first engine would steal a round that fits its batch.
        for steal in (False, True):
            for e in self.engines:
                e.admit(steal=steal)
        while (h := self.policy.harvest(self.clock)) is None:
            if not self.heap:
                raise SimulationError(f"{self.policy.name}: round {rnd.index} waits for samples but none is running")
            item = self.next_item()
            if item is None:
                continue
            if isinstance(item, ToolDone):
                self.traj.on_tool_done(item)  # type: ignore[union-attr]
                self.rerate_siblings()
                continue
            for sid in self.policy.on_sample_finished(item, self.clock):
                self.abort(sid)
            self.rerate_siblings()
        t_end = self.clock.t
        for e in self.engines:
            e.advance_to(t_end)
        pending = [item for _, _, item in sorted(self.heap, key=lambda x: x[:2]) if isinstance(item, Sample)]
        self.heap = []
        if self.sim.reward.workers:  # as the driver, wait for the rewards still being scored before training
            t_end = self.clock.t = max([t_end] + [self.rewards.done[s.sample_id] for s in pending])
        for sample in pending:  # finished, reward still in flight: it did finish
            self.policy.on_sample_finished(sample, self.clock)
        # Bulk abort (thousands of requests in an oversubscribed round): engines first, then the queues.
        wanted = set(h.abort)
        for e in self.engines:
            for seq in e.running + list(e.preempted):
                sid = seq.req.sample.sample_id
                if sid in wanted:
                    wanted.discard(sid)
                    self.where.pop(sid, None)
                    s = self.commit(seq, self.policy.version)
                    self.emit("request", "abort", max(e.t, t_end), worker=e.wid, sample_id=sid, tokens=s.response_length)
                    if self.traj:
                        self.traj.aborted(s, t_end)
                    self.policy.on_sample_aborted(s, self.clock)
            e.running, e.preempted, e.ctx = [], deque(), 0
        for sid in list(self.traj.waiting) if self.traj else []:  # waiting on a tool: carried with its turns
            s = self.traj.abort(sid, t_end)
            if sid in wanted:
                wanted.discard(sid)
                self.policy.on_sample_aborted(s, self.clock)
        self.by_prompt, self.rerate = {}, set()
        for req in self.queues.drain() + list(self.ahead):
            if req.sample.sample_id in wanted:
                self.policy.on_sample_aborted(req.sample, self.clock)
        self.ahead = deque()
        for e in self.engines:
            if self.busy[e.wid]:
                self.emit("worker", "idle", t_end, worker=e.wid)
        self.emit("phase", "end", t_end, phase="rollout")
        tokens = sum(len(s.prompt_tokens) + s.response_length for s in h.batch)
        update = bool(h.batch) or not h.stats.get("sampling")  # dynamic sampling: no update on an empty batch
        streamed, steps, ages = 0.0, 0, []
        if update and not h.stats.get("more"):  # dynamic sampling may ask for another round before the update
            steps, ages, streamed = self.train_update(h.batch, t0, t_end)
            self.policy.on_update(self.policy.version + (1 if steps else 0), self.clock, preemptions=self.preemptions)
            if steps:
                self.minibatch.synced(self.policy.version)
        groups: dict[str, set] = {}
        for s in h.batch:
            groups.setdefault(f"{s.prompt_id}/e{s.epoch}", set()).add(s.reward)
        return {"round": rnd.index, "kind": rnd.kind, "tp": rnd.layout.tp, "engines": rnd.layout.num_engines,
                "requests": len(rnd.requests), "samples": len(h.batch), "rollout_s": t_end - t0,
                "preemptions": self.preemptions, "moves": self.queues.moves, "migrations": self.migrations, "tokens": tokens, "streamed_tokens": streamed,
                "trained": [f"{s.prompt_id}/e{s.epoch}" for s in h.batch], "deferred": list(rnd.deferred),
                "deferred_at_harvest": list(h.stats.get("deferred", [])), "staleness": h.stats.get("staleness", []),
                "round_prompts": list(rnd.prompts), "response_lengths": [s.response_length for s in h.batch],
                "reward_critical_s": self.rewards.critical_path(h.batch, t0, t_end), "reward_timeouts": self.rewards.timeouts,
                "reward_workers": self.rewards.size, "reward_workers_max": self.rewards.size_max,
                "reward_worker_s": self.rewards.worker_seconds(t_end),
                "sample_ids": [s.sample_id for s in h.batch], "optimizer_steps": steps, "staleness_steps": ages,
                "update": update and not h.stats.get("more"), "informative_groups": sum(len(r) > 1 for r in groups.values()),
                "sampling": dict(h.stats.get("sampling", {}))}

    def train_update(self, batch: list[Sample], t0: float, t_end: float, flush: bool = False
                     ) -> tuple[int, list[int], float]:
        """The train phase of a harvest (`batch`, round from `t0` to `t_end`) in mini-batches, and its weight sync:
        (optimizer steps, each trained sample's staleness in steps, tokens streamed before the harvest). Without
        mini-batches (`ppo_mini_batch_size` 0) every harvest is one step, an empty one included, as before."""
        mb = self.minibatch
        batches = mb.plan(batch, flush) or ([batch] if mb.size <= 0 and not flush else [])
        steps = mb.optimizer_steps(batches)
        if not steps:
            return 0, [], 0.0
        ages = mb.staleness(batches)
        trained = sum(len(s.prompt_tokens) + s.response_length for b in batches for s in b)
        cap = None if steps == 1 else sum(len(s.prompt_tokens) + s.response_length for s in batches[0])
        # Stream training and the trainer's placement (scheduler/sim/stream_sim.py): what is left after the harvest.
        train_s, streamed = train_phase_s(self, batch, t0, t_end, trained, steps, mb.epochs, cap)
        step_phases(self, train_s)  # train and sync, or a colocated switch around train (layout_sim.py)
        mb.stepped(steps)
        return steps, ages, streamed

    def abort(self, sample_id: str, mid_round: bool = True) -> None:
        engine = self.where.pop(sample_id, None)
        if engine is not None:
            if mid_round:
                engine.advance_to(self.clock.t, finish_step=True)
            seq = engine.abort(sample_id)
            if seq is not None:
                s = self.commit(seq, self.policy.version)
                self.emit("request", "abort", max(engine.t, self.clock.t), worker=engine.wid, sample_id=sample_id,
                          tokens=s.response_length)
                if self.traj:
                    self.traj.aborted(s, self.clock.t)
                if mid_round:  # a slot freed up: admit more and re-plan the engine's next chunk
                    engine.admit()
                self.policy.on_sample_aborted(s, self.clock)
                return
        if self.traj is not None and (s := self.traj.abort(sample_id, self.clock.t)) is not None:
            self.policy.on_sample_aborted(s, self.clock)
            return
        req = self.queues.remove(sample_id)
        if req is None and (req := next((r for r in self.ahead if r.sample.sample_id == sample_id), None)):
            self.ahead.remove(req)
        if req is not None:  # never started
            self.policy.on_sample_aborted(req.sample, self.clock)

    def run_all(self, max_rounds: int = 100_000) -> SimResult:
        result = SimResult(policy=self.policy.name, events=self.events, max_num_seqs=self.sim.engine.max_num_seqs)
        for _ in range(max_rounds):
            rnd = self.policy.compose_round(self.clock)
            if rnd is None:
                break
            row = self.run_round(rnd)
            for key in row["trained"]:
                result.trained[key] = result.trained.get(key, 0) + 1
            result.rounds.append(row)
        if self.minibatch.pending:  # the data's last samples that did not fill a mini-batch train now
            self.step += 1
            self.train_update([], self.clock.t, self.clock.t, flush=True)
        result.optimizer_steps = self.minibatch.steps
        result.total_s = self.clock.t
        result.policy_stats = {k: (dict(v) if isinstance(v, dict) else v) for k, v in self.policy.stats.items()}
        result.staleness = dict(self.policy.stats["staleness"])
        return result


def build_policy(sim: SimConfig, run: RunConfig, policy_name: str | None = None, workload: Any = None) -> tuple[PolicyBase, Any]:
    """The policy of `run.scheduler` (or `policy_name`) wired to the simulated cluster, and the workload."""
    from dataclasses import replace

    cfg = replace(run.scheduler, policy=policy_name) if policy_name else run.scheduler
    workload = workload or make_workload(sim.workload, run.rollout.max_response_length)
    planner = make_planner(cfg.layout_planner, gpus=sim.cluster.gpus - sim.cluster.trainer_gpus, gpus_per_node=sim.cluster.gpus_per_node,
                           tp_short=run.rollout.tensor_parallel_size, tp_long=run.rollout.long_round_tensor_parallel_size,
                           model=sim.engine, relayout_s=sim.cluster.relayout_s)
    prompt_tokens = {pid: workload.prompt_tokens(pid) for pid in workload.prompt_ids}

    def factory(pid: str, epoch: int, index: int) -> Sample:
        return Sample(prompt_id=pid, index=index, epoch=epoch, prompt_tokens=[0] * prompt_tokens[pid])

    policy = make_policy(cfg, workload.prompt_ids, n_samples=run.rollout.n_samples_per_prompt,
                         max_response_length=run.rollout.max_response_length, planner=planner,
                         num_epochs=sim.workload.num_epochs, seed=run.seed, sample_factory=factory, sampling=run.sampling)
    return policy, workload


def simulate(sim: SimConfig, run: RunConfig, policy_name: str | None = None, record: bool = True) -> SimResult:
    """Runs one policy over the whole workload (every prompt x n samples x epochs) and returns the result."""
    base, speculative = split_policy(policy_name or run.scheduler.policy)
    policy, workload = build_policy(sim, run, base)
    if sim.engine.kv_capacity(sim.engine.min_tp()) <= 0 or sim.engine.min_tp() > sim.cluster.gpus_per_node:
        raise UserError(f"engine: the model ({sim.engine.weight_gib} GiB) does not fit a node of "
                        f"{sim.cluster.gpus_per_node} x {sim.engine.gpu_mem_gib} GiB GPUs")
    simulator = Simulator(sim, run, policy, workload, record=record)
    if sim.workload.turns_max > 1:  # the policy's history then predicts trajectory cost (scheduler/base.py)
        simulator.traj = TrajectorySim(simulator)
        inner = getattr(policy, "inner", policy)  # (dynamic sampling wraps the policy)
        inner.trajectory_info = simulator.traj.info
        inner.tokens_per_tool_s = tokens_per_tool_s(sim, run.rollout.tensor_parallel_size)
    if speculative:
        simulator.spec = HistoSpecSim(sim.speculation, seed=sim.workload.seed)
    result = simulator.run_all()
    result.policy = policy_name or result.policy
    if simulator.spec is not None:
        result.policy_stats["speculation"] = simulator.spec.stats()
    if simulator.traj is not None:
        result.policy_stats["trajectory"] = simulator.traj.stats()
        result.trajectories = simulator.traj.report()
    return result
