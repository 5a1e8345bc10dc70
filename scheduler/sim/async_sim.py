"""Asynchronous rollout and training in the simulator: engines never wait for the trainer, weights arrive in flight.

    python -m megatron_sortedrl simulate configs/sim_qwen32b_128gpu.yaml --policies sync,twotier,async,async-fifo
    python benchmarks/simulate_async.py           # the 32B scenario at several splits and bounds, equal steps
    from scheduler.sim.async_sim import simulate_any; res = simulate_any(sim, run, "async+histospec@t64s2")

Row labels: `async` (length-aware admission, the default's history), `async-fifo` (data order, as verl's
fully-async and AReaL admit) and `async-partial` (data order, the bound counted from each group's completion
and only the samples in flight capped: what partial-rollout systems keep; a comparison row, its oldest tokens
may be far older than the bound and its reported staleness says how old), each optionally `+histospec`, with an optional variant after `@`: `t<N>` trainer
GPUs (default `cluster.trainer_gpus`, else half the GPUs, in whole nodes where there are two or more), `s<B>` the staleness bound in optimizer
steps (default `run.scheduler.staleness_bound`), `k<K>` optimizer steps per weight push (default
`run.scheduler.weight_update_interval`). Every other label runs the synchronous simulator unchanged.

Model (disaggregated: `N` trainer GPUs train, the other GPUs generate; the asynchronous run needs a trainer of its
own, a colocated one cannot overlap):

- **Admission and harvest** are `scheduler/asynchronous.py`'s `AsyncController`: a prompt group is admitted only
  when every admitted group can still be trained within the bound; mini-batches of
  `run.algorithm.ppo_mini_batch_size` samples (whole groups, earliest deadline first). Nothing is discarded.
- **Engines** are the synchronous simulator's continuous batchers (`sim_engine.py`, TP `rollout.tensor_parallel_size`)
  and run from the first admission to the end; an engine with a free slot takes newly admitted work at once;
  placement is LPT on predicted length (`scheduler/placement.py`) with work stealing. `async` keeps `TAIL_SHARE`
  of the engines for groups predicted long, at most `TAIL_SEQS` sequences each (their tails decode at
  small-batch latency); `async-fifo` places everything alike.
- **Trainer**: a mini-batch takes `optimizer_step_s + tokens x ppo_epochs / (train_tokens_per_s x N / gpus)`,
  plus `train_fixed_s` on the first step after each weight push (the log-prob passes' set-up, per trainer call).
- **In-flight weight updates**: after every `K` optimizer steps the trainer pushes its weights for
  `weight_sync_s`; the engines pause for that time between decode steps (they finish the step they are in),
  load, and go on. Running requests keep their tokens and their KV cache (computed under the older weights,
  which is what PipelineRL's and NeMo-RL's in-flight updates do); their version spans grow, so the trainer's
  behaviour log-probs are per token. The trainer waits for the push to finish.
- **Reported per row** (besides `scheduler/sim/report.py`'s columns): `worker_bubble` is the share of engine time
  with nothing to run (pauses for weights apart, in `pause_share`), `trainer_idle_share`, the maximum staleness in
  steps (at most the bound, checked), `discarded` (0), and the length bias: per window of one epoch's optimizer
  steps, the trained samples' mean response length over the mean of every response of the run (`length_bias`,
  `length_bias_max` the largest deviation from 1). Per update (`rounds`): the trained samples' mean and p90 length,
  the mean of the responses that finished since the update before, the oldest sample's age in steps.

Left out: network contention of the pushes, the engines' KV recompute option (kept here, as in the driver's
loop, megatron_sortedrl/async_loop.py, which runs the same controller) and partial groups.
"""

from __future__ import annotations

import re
import statistics
from dataclasses import dataclass
from typing import Any

from megatron_sortedrl.errors import UserError
from megatron_sortedrl.sample import Sample
from scheduler.asynchronous import AsyncController, place_admitted
from scheduler.history import LengthHistory
from scheduler.protocol import Layout, Request
from scheduler.sim.simulator import SimResult, Simulator, simulate
from scheduler.sim.speculation_model import HistoSpecSim, split_policy
from scheduler.sim.workload import make_workload

ASYNC_POLICIES = {"async": True, "async-fifo": False, "async-partial": False}  # name -> length-aware admission
PARTIAL = "async-partial"  # the bound counted from a group's completion (scheduler/asynchronous.py): a comparison
# Length-aware placement (`async`): a share of the engines is kept for the groups the history predicts long
# (over `scheduler.long_round_threshold` x max_response_length), each running at most TAIL_SEQS sequences, so a
# due group's tail decodes at small-batch latency instead of sharing a full batch; the other engines pack the
# rest. Chosen on the 32B scenario (docs/scheduler.md "Asynchronous training").
TAIL_SHARE, TAIL_SEQS = 0.25, 32


def parse_label(label: str) -> tuple[str, bool, dict[str, int]] | None:
    """`async+histospec@t64s2` -> ("async", True, {"t": 64, "s": 2}); None for a synchronous label."""
    base, _, variant = label.partition("@")
    name, spec = split_policy(base)
    if name not in ASYNC_POLICIES:
        return None
    opts = {k: int(v) for k, v in re.findall(r"([tsk])(\d+)", variant)}
    if variant and re.sub(r"[tsk]\d+", "", variant):
        raise UserError(f"--policies: {label!r}: the part after @ takes t<trainer GPUs>, s<bound>, k<steps per push>")
    return name, spec, opts


@dataclass
class TrainDone:
    batch: list[Sample]
    tokens: int  # prompt + response tokens of the batch


class SyncDone:
    """The weight push has reached the engines."""


class _Engines:
    """What `SimEngine` reads of a policy: its name, the engines' weights version and its stats."""

    def __init__(self, name: str) -> None:
        self.name, self.version = name, 0
        self.stats: dict[str, Any] = {"staleness": {}, "wasted_tokens": 0}


class AsyncSimulator(Simulator):
    def __init__(self, sim: Any, run: Any, label: str, workload: Any = None) -> None:
        name, spec, opts = parse_label(label)  # type: ignore[misc]
        c, s, a = sim.cluster, run.scheduler, run.algorithm
        gpn = c.gpus_per_node
        self.trainer_gpus = opts.get("t", c.trainer_gpus or ((c.gpus // 2) // gpn * gpn or c.gpus // 2))
        self.bound = opts.get("s", s.staleness_bound)
        self.every = max(1, opts.get("k", s.weight_update_interval))
        tp = run.rollout.tensor_parallel_size
        engines = (c.gpus - self.trainer_gpus) // tp
        if not 0 < self.trainer_gpus < c.gpus or engines < 1:
            raise UserError(f"{label}: the asynchronous run needs trainer GPUs of its own and at least one engine "
                            f"(t{self.trainer_gpus} of cluster.gpus {c.gpus}, engines of TP {tp}); a colocated "
                            "trainer cannot overlap generation")
        if self.bound < self.every - 1:
            raise UserError(f"{label}: a staleness bound of {self.bound} optimizer steps cannot hold with weights pushed "
                            f"every {self.every} steps (samples generated just before a push are {self.every - 1} "
                            "steps old at best); raise the bound or push more often")
        if a.ppo_mini_batch_size <= 0:
            raise UserError(f"{label}: asynchronous training needs run.algorithm.ppo_mini_batch_size > 0 (the "
                            "mini-batch is its unit of work)")
        workload = workload or make_workload(sim.workload, run.rollout.max_response_length)
        super().__init__(sim, run, _Engines(label), workload)  # type: ignore[arg-type]
        if spec:
            self.spec = HistoSpecSim(sim.speculation, seed=sim.workload.seed)
        prompt_tokens = {pid: workload.prompt_tokens(pid) for pid in workload.prompt_ids}
        self.history = LengthHistory(s.predictor, s.predictor_quantile, s.history_max_prompts)
        self.ctl = AsyncController(
            workload.prompt_ids, n=run.rollout.n_samples_per_prompt, mini_batch=a.ppo_mini_batch_size,
            bound=self.bound, num_epochs=sim.workload.num_epochs, seed=run.seed, history=self.history,
            length_aware=ASYNC_POLICIES[name], from_finish=name == PARTIAL,
            factory=lambda pid, e, i: Sample(prompt_id=pid, index=i, epoch=e, prompt_tokens=[0] * prompt_tokens[pid]))
        self.layout_ = Layout(tp, engines)
        self.tail: list[Any] = []  # engines kept for predicted-long groups (set in run_all)
        self.ctl_threshold = s.long_round_threshold * run.rollout.max_response_length
        self.train_rate = c.train_tokens_per_s * self.trainer_gpus / c.gpus
        self.trainer_busy = False
        self.since_push = 0  # optimizer steps since the last weight push
        self.trainer_idle_s = 0.0
        self.idle_from: float | None = 0.0
        self.pause_s = 0.0
        self.generated: list[int] = []  # every finished response's length, in finishing order
        self.generated_at_step = 0  # len(self.generated) at the previous update

    # feeding the engines -----------------------------------------------------------------------------------
    def feed(self) -> None:
        groups = self.ctl.admit()
        if not groups:
            return
        reqs = [Request(smp, 0, self.history.predict(g.prompt_id) if self.history.known(g.prompt_id) else 0.0,
                        self.run.rollout.max_response_length) for g in groups for smp in g.samples]
        place_admitted(reqs, len(self.engines), self.ctl_threshold, len(self.tail))
        self.queues.add(reqs)
        for e in self.engines:  # engines with a free slot start the new work now (after the step they are in)
            if len(e.running) >= e.max_seqs:
                continue
            if e.t <= self.clock.t + 1e-9:  # not paused for weights: bring it to now first
                e.advance_to(self.clock.t, finish_step=True)
                e.t = max(e.t, self.clock.t)
            e.admit()

    # the trainer ---------------------------------------------------------------------------------------------
    def try_train(self) -> None:
        if self.trainer_busy:
            return
        batch = self.ctl.next_minibatch()
        if batch is None:
            return
        c, a = self.sim.cluster, self.run.algorithm
        tokens = sum(len(s.prompt_tokens) + s.response_length for s in batch)
        seconds = c.optimizer_step_s * a.ppo_epochs + tokens * a.ppo_epochs / self.train_rate
        if self.since_push == 0:
            seconds += c.train_fixed_s
        self.trainer_busy = True
        if self.idle_from is not None:
            self.trainer_idle_s += self.clock.t - self.idle_from
            self.idle_from = None
        self.emit("phase", "start", self.clock.t, phase="train")
        self.push(self.clock.t + seconds, TrainDone(batch, tokens))

    def trained(self, batch: list[Sample], tokens: int) -> None:
        self.emit("phase", "end", self.clock.t, phase="train")
        version = self.policy.version
        ages = self.ctl.stepped(batch, self.run.algorithm.ppo_epochs)
        stale = self.policy.stats["staleness"]
        for s in batch:
            k = version - s.oldest_version if s.oldest_version >= 0 else 0
            stale[k] = stale.get(k, 0) + 1
        lengths = [s.response_length for s in batch]
        fresh = self.generated[self.generated_at_step:]
        self.generated_at_step = len(self.generated)
        self.rounds.append({"round": len(self.rounds), "kind": "async", "samples": len(batch),
                            "trained_mean_length": statistics.fmean(lengths), "trained_p90_length": _p90(lengths),
                            "generated_mean_length": statistics.fmean(fresh) if fresh else None,
                            "oldest_age_steps": max(ages, default=0), "discarded": self.ctl.discarded,
                            "tokens": tokens, "optimizer_steps": self.run.algorithm.ppo_epochs, "staleness_steps": ages,
                            "response_lengths": lengths,
                            "trained": [f"{s.prompt_id}/e{s.epoch}" for s in batch], "preemptions": 0, "t": self.clock.t})
        self.since_push += self.run.algorithm.ppo_epochs
        if self.ctl.done:
            self.trainer_busy = False
        elif self.since_push >= self.every:
            self.emit("phase", "start", self.clock.t, phase="sync")
            self.pause_engines(self.sim.cluster.weight_sync_s)
            self.push(self.clock.t + self.sim.cluster.weight_sync_s, SyncDone())
        else:
            self.trainer_busy = False
            self.idle_from = self.clock.t

    def pause_engines(self, seconds: float) -> None:
        """In-flight update: each engine ends the decode step it is in, records its requests' tokens under the
        weights that sampled them, and waits `seconds` for the new weights; requests and KV cache stay."""
        t = self.clock.t
        for e in self.engines:
            e.advance_to(t, finish_step=True)
            for seq in e.running + list(e.preempted):
                self.commit(seq, self.policy.version)
            start = max(e.t, t)
            if e.running:
                self.pause_s += seconds
            e.t = start + seconds
            e.plan()

    def synced(self) -> None:
        self.emit("phase", "end", self.clock.t, phase="sync")
        self.policy.version += 1
        self.ctl.synced(self.policy.version)
        self.since_push = 0
        if self.spec is not None:
            self.spec.publish()  # the drafters get the responses finished so far with the weights
        self.trainer_busy = False
        self.idle_from = self.clock.t

    def finished(self, engine: Any, seq: Any) -> None:
        super().finished(engine, seq)
        s = seq.req.sample
        self.generated.append(s.response_length)

    # the event loop ----------------------------------------------------------------------------------------
    def run_all(self, max_rounds: int = 0) -> SimResult:
        self.rounds: list[dict[str, Any]] = []
        self.set_layout(self.layout_)
        k = round(len(self.engines) * TAIL_SHARE) if self.ctl.length_aware and len(self.engines) >= 4 else 0
        self.tail = self.engines[len(self.engines) - k:] if k else []
        for e in self.tail:
            e.max_seqs = min(e.max_seqs, TAIL_SEQS)
        self.emit("phase", "start", 0.0, phase="rollout")
        self.feed()
        self.try_train()
        while not self.ctl.done:
            if not self.heap:
                raise RuntimeError(f"{self.policy.name}: nothing runs and {len(self.ctl.groups)} groups wait")
            item = self.next_item()
            if item is None:
                continue
            if isinstance(item, TrainDone):
                self.trained(item.batch, item.tokens)
            elif isinstance(item, SyncDone):
                self.synced()
            else:  # a finished sample's reward is in
                self.history.record(item.prompt_id, item.epoch, item.response_length)
                self.ctl.on_finished(item)
            self.feed()
            self.try_train()
        end = self.clock.t
        for e in self.engines:
            if self.busy[e.wid]:
                self.emit("worker", "idle", end, worker=e.wid)
        self.emit("phase", "end", end, phase="rollout")
        result = SimResult(policy=self.policy.name, events=self.events, max_num_seqs=self.sim.engine.max_num_seqs)
        result.rounds = self.rounds
        result.total_s = end
        result.optimizer_steps = self.ctl.steps
        result.staleness = dict(self.policy.stats["staleness"])
        result.policy_stats = {"staleness": result.staleness, "wasted_tokens": 0, "async": self.figures(end),
                               "generated_lengths": list(self.generated)}
        if self.spec is not None:
            result.policy_stats["speculation"] = self.spec.stats()
        return result

    def figures(self, end: float) -> dict[str, Any]:
        busy_time, on = 0.0, {}
        for ev in self.events:
            if ev.kind != "worker":
                continue
            if ev.event == "busy" and ev.worker not in on:
                on[ev.worker] = ev.t
            elif ev.event == "idle" and ev.worker in on:
                busy_time += ev.t - on.pop(ev.worker)
        busy_time += sum(end - t for t in on.values())
        total = len(self.engines) * end
        idle = max(0.0, total - busy_time)
        window = max(1, -(-len(self.rounds) // max(1, self.sim.workload.num_epochs)))  # one epoch's steps
        data_mean = statistics.fmean(self.generated) if self.generated else 0.0
        bias = {}
        for i in range(0, len(self.rounds), window):
            trained = [n for r in self.rounds[i:i + window] for n in r["response_lengths"]]
            bias[f"{i}-{min(i + window, len(self.rounds)) - 1}"] = statistics.fmean(trained) / data_mean if data_mean else 1.0
        ages = self.ctl.ages
        trained_all = [n for r in self.rounds for n in r["response_lengths"]]
        return {"trainer_gpus": self.trainer_gpus, "engines": len(self.engines), "tp": self.layout_.tp,
                "bound": self.bound, "steps_per_push": self.every,
                "worker_bubble": idle / total if total else 0.0, "pause_share": self.pause_s / total if total else 0.0,
                "trainer_idle_share": self.trainer_idle_s / end if end else 0.0,
                "max_staleness_steps": max(ages, default=0), "discarded": self.ctl.discarded,
                "length_bias": bias, "length_bias_max": max((abs(b - 1.0) for b in bias.values()), default=0.0),
                "trained_mean_length": statistics.fmean(trained_all), "trained_p90_length": _p90(trained_all)}


def _p90(values: list[int]) -> float:
    return statistics.quantiles(values, n=10)[-1] if len(values) > 1 else float(values[0] if values else 0)


def simulate_async(sim: Any, run: Any, label: str) -> SimResult:
    result = AsyncSimulator(sim, run, label).run_all()
    result.policy = label
    return result


def simulate_any(sim: Any, run: Any, label: str | None = None, record: bool = True) -> SimResult:
    """`simulate` for every row label: asynchronous ones here, the rest in `scheduler/sim/simulator.py`."""
    if label and parse_label(label) is not None:
        return simulate_async(sim, run, label)
    return simulate(sim, run, label, record=record)


__all__ = ["ASYNC_POLICIES", "AsyncSimulator", "parse_label", "simulate_any", "simulate_async"]
