"""Multi-turn trajectories in the cluster simulator: assistant turns separated by tool calls.

    python -m megatron_sortedrl simulate configs/sim_agentic_7b_8gpu.yaml --policies sync,tail,twotier
    PYTHONPATH=. python benchmarks/simulate_agentic.py          # docs/benchmarks/sim_agentic.{json,png,md}

On with `workload.turns_max` > 1 (`scheduler/sim/sim_config.py`); with 1 the simulator never builds this and runs
single-turn samples exactly as before. A sample is a trajectory:

    turn 0 tokens | tool message 0 | turn 1 tokens | tool message 1 | ... | turn K-1 tokens

- **Turns.** K = clamp(round(exp(log(turns_median) + turns_sigma * (sqrt(share) * z_t[p, e]
  + sqrt(1 - share) * eps))), 1, turns_max), with z_t a per-prompt level that persists across epochs exactly as
  the length level does (`prompt_share`, `persistence`), so a prompt's history predicts its turns. Turn k's
  tokens are `SyntheticWorkload.turn_length` (the single-turn length model, one eps per turn: the prompt's level
  is shared by its turns, so long-winded prompts are long-winded in every turn).
- **Tools.** The call after turn k goes to a tool kind chosen by weight, seeded by (prompt, k): the same prompt
  calls the same tools in the same order every epoch (the task decides the tools). Its latency is log-normal,
  `median_s * exp(sigma * N(0, 1))` per call, cut at `tool_timeout_s` (a timed-out call returns a timeout
  message); its message has `tokens` x U(0.5, 1.5) tokens. With, e.g., a calculator at 0.1 s and a sandboxed
  test run at 10 s with sigma 1.2, the 99th percentile call takes about 16x its kind's median.
- **Budget.** The trajectory stops at `max_response_length` response tokens (turns and tool messages together):
  a turn that reaches it is cut there, and a tool message that would cross it ends the trajectory at its turn.

In the engine (`scheduler/sim/simulator.py` calls the hooks below): a turn decodes like any request; when it ends
and a tool call follows, the sample leaves the engine (its slot and KV are free: the engine serves others while
the tool runs off the engines), and when the tool answers it re-enters the same engine's waiting list ahead of
queued requests, its tool message prefilled on admission (the earlier context is in the prefix cache). A sample
aborted mid-turn keeps its tokens (partial mode resumes the turn); a sample waiting on a tool at the harvest is
aborted with its completed turns, and its tool keeps running: the next round resumes it when the answer is there
(prefilling its whole context, the weights having changed). On-policy resets start a new trajectory (attempt).

What the policies see: the policy's `trajectory_info` gives each finished sample's (turns, tool seconds), so the
history predicts the trajectory's cost, and `tokens_per_tool_s` converts a tool second into the tokens one
sequence decodes meanwhile in a half-full engine (`tokens_per_tool_s` below).

Left out: prefix-cache eviction during a tool call (a long wait on a full engine would re-prefill the context),
tool execution capacity (every call runs at once; the tool pool's queueing is not modelled), tool failures
other than timeouts, a per-prompt latency level (only the kinds persist), and timeline events for tool waits:
a request waiting on a tool still counts as active in the slot bubble (the worker bubble is exact).
"""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import dataclass
from typing import Any, NamedTuple

from megatron_sortedrl.sample import Sample
from scheduler.protocol import Request
from scheduler.sim.sim_config import WorkloadConfig
from scheduler.sim.sim_engine import SimEngine, SimSeq


class ToolCall(NamedTuple):
    kind: str
    latency_s: float
    tokens: int  # tool message tokens appended to the context when it answers


@dataclass(frozen=True)
class Trajectory:
    turns: tuple[int, ...]  # generated tokens per assistant turn
    tools: tuple[ToolCall, ...]  # the call after each turn but the last (len(turns) - 1 of them)

    @property
    def total(self) -> int:
        return sum(self.turns) + sum(c.tokens for c in self.tools)

    @property
    def tool_s(self) -> float:
        return sum(c.latency_s for c in self.tools)

    def ends(self) -> list[int]:
        """Response position at which each turn ends."""
        out, pos = [], 0
        for k, g in enumerate(self.turns):
            pos += g
            out.append(pos)
            if k < len(self.tools):
                pos += self.tools[k].tokens
        return out

    def turn_end(self, r: int) -> int:
        """End of the turn that a sample holding `r` response tokens is in (or resumes at)."""
        return next((e for e in self.ends() if e > r), self.total)

    def call_at(self, r: int) -> int | None:
        """k if `r` response tokens end turn k and tool call k follows (the sample waits on it), else None."""
        ends = self.ends()
        return next((k for k, e in enumerate(ends[:-1]) if e == r), None)

    def completed_turns(self, r: int) -> int:
        return sum(e <= r for e in self.ends())


class TurnLevel:
    """Per-prompt level of the turn count, persistent across epochs (the length level's process, own seeds)."""

    def __init__(self, cfg: WorkloadConfig) -> None:
        self.cfg, self.z = cfg, {}

    def __call__(self, prompt_id: str, epoch: int) -> float:
        if (prompt_id, epoch) not in self.z:
            fresh = random.Random(f"{self.cfg.seed}:zt:{prompt_id}:{epoch}").gauss(0.0, 1.0)
            rho = self.cfg.persistence
            self.z[prompt_id, epoch] = fresh if epoch == 0 else (
                rho * self(prompt_id, epoch - 1) + math.sqrt(1 - rho * rho) * fresh)
        return self.z[prompt_id, epoch]


def draw_trajectory(workload: Any, level: TurnLevel, prompt_id: str, epoch: int, index: int, attempt: int,
                    max_len: int) -> Trajectory:
    """The trajectory of one sample attempt (module docstring); seeded by its coordinates, the same for every policy."""
    workload_cfg: WorkloadConfig = workload.cfg
    share = workload_cfg.prompt_share
    eps = random.Random(f"{workload_cfg.seed}:turns:{prompt_id}:{epoch}:{index}:{attempt}").gauss(0.0, 1.0)
    k_max = min(workload_cfg.turns_max, max(1, round(math.exp(math.log(workload_cfg.turns_median) + workload_cfg.turns_sigma * (
        math.sqrt(share) * level(prompt_id, epoch) + math.sqrt(1 - share) * eps)))))
    kinds = list(workload_cfg.tool_kinds)
    turns: list[int] = []
    tools: list[ToolCall] = []
    pos = 0
    for k in range(k_max):
        g = min(workload.turn_length(prompt_id, epoch, index, attempt, k), max_len - pos)
        turns.append(g)
        pos += g
        if k == k_max - 1 or pos >= max_len:
            break
        kind = random.Random(f"{workload_cfg.seed}:toolkind:{prompt_id}:{k}").choices(kinds, [t.weight for t in kinds])[0]
        rng = random.Random(f"{workload_cfg.seed}:tool:{prompt_id}:{epoch}:{index}:{attempt}:{k}")
        latency = min(workload_cfg.tool_timeout_s, kind.median_s * math.exp(kind.sigma * rng.gauss(0.0, 1.0)))
        tokens = max(1, round(kind.tokens * rng.uniform(0.5, 1.5)))
        if pos + tokens >= max_len:
            break  # the tool's answer would not fit the budget: the trajectory ends with this turn
        tools.append(ToolCall(kind.name, latency, tokens))
        pos += tokens
    return Trajectory(tuple(turns), tuple(tools))


def tokens_per_tool_s(sim_cfg: Any, tp: int) -> float:
    """Tokens one sequence decodes per second in an engine running half its batch at a typical context: what a
    second of tool time on a trajectory's critical path is worth in the policies' token units."""
    e, w = sim_cfg.engine, sim_cfg.workload
    batch = max(1, e.max_num_seqs // 2)
    context = batch * (w.prompt_tokens + w.median_response * w.turns_median)
    return 1.0 / e.decode_step_s(tp, batch, context)


class ToolDone:
    """Heap item: the tool call of sample `sid` answers (ignored if `token` is stale: the sample was aborted)."""

    __slots__ = ("sid", "token")

    def __init__(self, sid: str, token: int) -> None:
        self.sid, self.token = sid, token


@dataclass
class _Wait:
    seq: Any  # the engine's sequence, or None for a carried sample the round has not started yet
    req: Request
    engine: Any
    ready_t: float
    token: int


class TrajectorySim:
    """The simulator's per-trajectory records and its hooks for turn ends, tool answers, aborts and harvests."""

    def __init__(self, sim: Any) -> None:
        self.sim = sim  # the `Simulator` that owns these hooks; it imports this module, never the other way round
        self.level = TurnLevel(sim.sim.workload)
        self.draws: dict[str, Trajectory] = {}  # sample id -> trajectory of its current attempt
        self.waiting: dict[str, _Wait] = {}  # sample id -> its tool call in flight this round
        self.ready: dict[str, tuple[int, float]] = {}  # carried at a tool call: (response tokens, answer time)
        self.log: dict[str, list[tuple]] = {}  # sample id -> (event, t, attempt, response tokens); tests read it
        self.tokens = itertools.count()
        self.calls = 0

    def _log(self, sid: str, event: str, t: float, r: int) -> None:
        self.log.setdefault(sid, []).append((event, t, self.sim.attempts.get(sid, 0), r))

    # -- hooks -------------------------------------------------------------------------------------------------
    def draw(self, s: Sample, attempt: int) -> int:
        """A fresh attempt: draws its trajectory; returns its total response tokens."""
        traj = draw_trajectory(self.sim.workload, self.level, s.prompt_id, s.epoch, s.index, attempt,
                               self.sim.run.rollout.max_response_length)
        self.draws[s.sample_id] = traj
        return traj.total

    def turn_end(self, s: Sample) -> int:
        return self.draws[s.sample_id].turn_end(s.response_length)

    def info(self, s: Sample) -> tuple[int, float]:
        """(assistant turns, tool seconds) of a finished sample: what the history records."""
        traj = self.draws[s.sample_id]
        return len(traj.turns), traj.tool_s

    def turn_ended(self, engine: SimEngine, seq: SimSeq) -> bool:
        """Called when `seq` reached its target: True if a tool call follows (the sample leaves the engine)."""
        sid = seq.req.sample.sample_id
        traj = self.draws[sid]
        k = traj.call_at(seq.target)
        if k is None:
            return False
        s = self.sim.commit(seq, self.sim.policy.version)  # the completed turn belongs to the sample now
        self.sim.where.pop(sid, None)
        self.calls += 1
        self._wait(sid, seq, seq.req, engine, engine.t + traj.tools[k].latency_s)
        self._log(sid, "tool_call", engine.t, s.response_length)
        return True

    def _wait(self, sid: str, seq: Any, req: Request, engine: Any, ready_t: float) -> None:
        token = next(self.tokens)
        self.waiting[sid] = _Wait(seq, req, engine, ready_t, token)
        self.sim.push(ready_t, ToolDone(sid, token))

    def hold(self, requests: list[Request], t_start: float) -> list[Request]:
        """Round start: a carried sample stopped at a tool call waits for its answer off the engines (its tool kept
        running through the update); the others are returned to be queued."""
        out = []
        for req in requests:
            s = req.sample
            traj = self.draws.get(s.sample_id)
            if traj is None or not s.response_length or traj.call_at(s.response_length) is None:
                out.append(req)
                continue
            r, ready = self.ready.get(s.sample_id, (s.response_length, t_start))
            self._wait(s.sample_id, None, req, self.sim.engines[req.worker], max(t_start, ready))
        return out

    def on_tool_done(self, item: ToolDone) -> None:
        w = self.waiting.get(item.sid)
        if w is None or w.token != item.token:
            return
        del self.waiting[item.sid]
        sim, s = self.sim, w.req.sample
        traj = self.draws[item.sid]
        call = traj.tools[traj.call_at(s.response_length)]
        s.append([0] * call.tokens, [0.0] * call.tokens, sim.policy.version)  # tool tokens: masked, no log-probs
        self.ready.pop(item.sid, None)
        engine = w.engine
        engine.advance_to(sim.clock.t, finish_step=True)
        engine.t = max(engine.t, sim.clock.t)
        if w.seq is None:  # a carried sample's first turn this round: its whole context is prefilled
            seq = sim.start(engine, w.req)
        else:  # same engine, same round: only the tool message is prefilled (the rest is in the prefix cache)
            seq = w.seq
            seq.gen = s.response_length
            seq.target = traj.turn_end(s.response_length)
            seq.cached = seq.context - call.tokens
            sim.where[item.sid] = engine
        self._log(item.sid, "tool_done", sim.clock.t, s.response_length)
        engine.preempted.append(seq)
        engine.admit()

    def abort(self, sid: str, t: float) -> Sample | None:
        """Aborts a sample waiting on a tool (None if it is not): it keeps its completed turns, its tool runs on."""
        w = self.waiting.pop(sid, None)
        if w is None:
            return None
        s = w.req.sample
        self.ready[sid] = (s.response_length, w.ready_t)
        if w.seq is not None:  # it was submitted this round: close its request on the timeline
            self.sim.emit("request", "abort", t, worker=w.engine.wid, sample_id=sid, tokens=s.response_length)
        self._log(sid, "abort", t, s.response_length)
        return s

    def aborted(self, s: Sample, t: float) -> None:
        """A sample aborted on an engine (mid-turn): logged with the tokens it keeps."""
        self._log(s.sample_id, "abort", t, s.response_length)

    def started(self, s: Sample, t: float) -> None:
        self._log(s.sample_id, "start", t, s.response_length)

    def stats(self) -> dict[str, Any]:
        trajs = list(self.draws.values())
        return {"tool_calls": self.calls, "trajectories": len(trajs),
                "mean_turns": sum(len(t.turns) for t in trajs) / max(1, len(trajs)),
                "mean_tool_s": sum(t.tool_s for t in trajs) / max(1, len(trajs))}

    def report(self) -> dict[str, Any]:
        """Per sample id: its last attempt's trajectory and its log (what the property tests check)."""
        return {sid: {"turns": list(t.turns), "tools": [list(c) for c in t.tools], "total": t.total,
                      "attempt": self.sim.attempts.get(sid, 0), "log": self.log.get(sid, [])}
                for sid, t in self.draws.items()}
