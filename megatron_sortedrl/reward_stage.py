"""The reward stage: scoring workers that scale with the backlog, timeouts learned from history, scoring in
the order the harvest needs, and the reward critical path of every step.

    stage = make_reward_stage(cfg, reward_fn=None, say=print)    # what the driver holds as `self.rewards`
    stage.submit(sample); stage.poll(); stage.drain(); stage.score(samples)   # as `RewardPool`
    row.update(stage.step_metrics(batch, step_s))                  # reward/* figures of the step

Backends (`reward.backend`): `process` (default), the `RewardPool` of spawned processes on the driver's node;
`ray`, `RayRewardPool`: one Ray actor per worker with CPU-only resources (`reward.ray_num_cpus`, no GPU),
spread over the cluster's nodes, so CPU-only nodes can score. Both are resized during the run when
`reward.autoscale` is on: every `reward.scale_interval_s` the `Autoscaler` estimates how long the backlog
(samples waiting plus being scored) takes to drain at the measured mean scoring time, and asks for enough
workers to drain it within `reward.target_drain_s`, between `reward.min_workers` and `reward.max_workers`;
it gives one worker back after `reward.idle_s` with nothing pending.

Timeouts (`reward.timeout=history`): a prompt's limit is `reward.timeout_multiple` times the slowest
scoring of a sample of it that passed, within [`reward.min_timeout_s`, `data.reward_timeout_s`]; a prompt
with no passing sample yet gets `data.reward_timeout_s`. The limit travels in
`sample.meta["reward_timeout_s"]`: the code sandbox kills the program there, and the pool's worker a grace
period later for any other reward. Timeouts are counted per prompt (`TimeoutHistory.timeouts`, the step's
`reward/timeouts_by_prompt`).

Order (`reward.order=harvest`): pending samples whose prompt group has all its responses finished are
scored first (the harvest takes whole groups), then groups nearer completion, then arrival order.

Per step (`step_metrics`): `reward/critical_path_s`, the time from the last sample of the batch finishing
generation to the last of its rewards arriving (what every GPU waits for reward alone), and its share of
the step; `reward/queue_wait_s` and `reward/scoring_s` (mean and max over the step's scored samples),
`reward/workers_active` (mean busy workers while the step ran), `reward/workers` (pool size),
`reward/drain_s` (waits for every outstanding reward: a checkpoint's; the driver no longer waits after a
harvest for rewards of samples it did not take, they score while the step trains, see round_stream.py),
`reward/timeouts` and `reward/timeouts_by_prompt`.

A reward function may take a batch: mark it `fn.batched = True` and it is called as
`fn(samples, ground_truths) -> list[float | RewardResult]` (the Ray backend sends it up to
`reward.max_batch` samples per call).

Checkpoints keep the timeout history and the measured scoring time (`state_dict`, restored exactly on
resume). Tests: `python -m pytest tests/test_reward_stage.py -q`. Left out: the LLM-judge backend (see
docs/rewards.md).
"""

from __future__ import annotations

import math
import time
from collections import Counter, deque
from typing import Any, Callable

from megatron_sortedrl.reward_pool import RewardPool, call_reward
from megatron_sortedrl.sample import Sample


class TimeoutHistory:
    """Per-prompt timeouts from the slowest passing scoring seen so far."""

    def __init__(self, multiple: float, min_s: float, max_s: float) -> None:
        self.multiple, self.min_s, self.max_s = multiple, min_s, max_s
        self.slowest_pass: dict[str, float] = {}
        self.timeouts: Counter[str] = Counter()

    def timeout_for(self, prompt_id: str) -> float:
        slowest = self.slowest_pass.get(prompt_id)
        if slowest is None:
            return self.max_s
        return min(self.max_s, max(self.min_s, self.multiple * slowest))

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps: the slowest passing scoring and the timeouts of every prompt seen."""
        return {"slowest_pass": dict(self.slowest_pass), "timeouts": dict(self.timeouts)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.slowest_pass = {str(k): float(v) for k, v in state.get("slowest_pass", {}).items()}
        self.timeouts = Counter({str(k): int(v) for k, v in state.get("timeouts", {}).items()})

    def record(self, s: Sample) -> bool:
        """Learns from a scored sample; True when it timed out."""
        if is_timeout(s):
            self.timeouts[s.prompt_id] += 1
            return True
        if (s.reward or 0.0) > 0 and not s.reward_error:
            # the program's own run time when the reward reports it (code), else the whole call's
            secs = float(s.meta.get("reward_program_s", s.meta.get("reward_seconds", 0.0)))
            self.slowest_pass[s.prompt_id] = max(secs, self.slowest_pass.get(s.prompt_id, 0.0))
        return False


def is_timeout(s: Sample) -> bool:
    return s.reward_error == "timeout" or str(s.meta.get("reward_reason", "")).startswith("timeout")


class Autoscaler:
    """Workers needed to drain the backlog within `target_drain_s` at the measured scoring time."""

    def __init__(self, min_workers: int, max_workers: int, target_drain_s: float, interval_s: float,
                 idle_s: float) -> None:
        self.min_w, self.max_w, self.target, self.interval, self.idle_s = (
            min_workers, max_workers, target_drain_s, interval_s, idle_s)
        self.mean_s = 0.0  # moving mean of scoring seconds per sample
        self._last, self._idle_since = 0.0, None

    def observe(self, seconds: float) -> None:
        self.mean_s = seconds if self.mean_s == 0.0 else 0.9 * self.mean_s + 0.1 * seconds

    def decide(self, now: float, size: int, backlog: int) -> int:
        if now - self._last < self.interval:
            return size
        self._last = now
        if backlog == 0:
            self._idle_since = self._idle_since if self._idle_since is not None else now
            if now - self._idle_since >= self.idle_s and size > self.min_w:
                self._idle_since = now
                return size - 1
            return size
        self._idle_since = None
        mean = self.mean_s or 0.5  # before any measurement: assume half a second a sample
        want = math.ceil(backlog * mean / max(self.target, 1e-3))
        return max(self.min_w, min(self.max_w, max(size, want)))


class RewardStage:
    """What the driver uses as its reward pool; see the module docstring."""

    def __init__(self, reward_fn: Any, rcfg, *, workers: int, timeout_s: float, group_size: int,
                 say: Callable[[str], None] = print) -> None:
        self.cfg, self.group_size = rcfg, max(1, group_size)
        self._seq = 0
        self._held: list[Sample] = []  # scored while `score` waited for other samples: the next poll's
        self._group_done: Counter[tuple[str, int]] = Counter()
        order = self._order_key if rcfg.order == "harvest" else None
        lo = rcfg.min_workers or workers
        hi = max(lo, rcfg.max_workers or workers)
        start = min(hi, max(lo, workers))
        if rcfg.backend == "ray":
            self.pool: Any = RayRewardPool(reward_fn, start, timeout_s, rcfg.max_batch, order, rcfg.ray_num_cpus)
        else:
            self.pool = RewardPool(reward_fn, num_workers=start, timeout_s=timeout_s, max_batch=rcfg.max_batch,
                                   order_key=order)
        self.history = TimeoutHistory(rcfg.timeout_multiple, rcfg.min_timeout_s, timeout_s)
        self.scaler = Autoscaler(lo, hi, rcfg.target_drain_s, rcfg.scale_interval_s, rcfg.idle_s) if rcfg.autoscale else None
        self.sandbox_line = _sandbox_line(reward_fn, rcfg.sandbox)
        if self.sandbox_line:
            say(self.sandbox_line)
        say(f"reward stage: {rcfg.backend} workers {start}"
            + (f" (autoscale {lo}..{hi})" if self.scaler else "") + f", timeouts {rcfg.timeout}, order {rcfg.order}")
        self._reset_step()

    # -------------------------------------------------- the RewardPool interface the driver uses

    @property
    def stats(self) -> dict[str, int]:
        return self.pool.stats

    @property
    def failures(self) -> list[tuple[str, str]]:
        return self.pool.failures

    def __len__(self) -> int:
        return len(self.pool) + len(self._held)

    def submit(self, s: Sample) -> None:
        s.meta["gen_done"] = time.monotonic()
        s.meta["sandbox_mode"] = self.cfg.sandbox
        s.meta["sandbox_warm"] = self.cfg.warm_sandbox
        s.meta["code_partial_credit"] = self.cfg.code_partial_credit
        if self.cfg.judge_model:
            s.meta["judge_model"] = self.cfg.judge_model
        if self.cfg.timeout == "history":
            s.meta["reward_timeout_s"] = self.history.timeout_for(s.prompt_id)
        self._seq += 1
        s.meta["reward_seq"] = self._seq
        self._group_done[(s.prompt_id, s.epoch)] += 1
        self.pool.submit(s)

    def poll(self) -> list[Sample]:
        out = self.pool.poll()
        self._account(out)
        held, self._held = self._held, []
        return held + out

    def drain(self, sleep_s: float = 0.002) -> list[Sample]:
        """Blocks until everything submitted is scored; the wait counts as the step's `reward/drain_s` (the
        driver drains before a checkpoint, so the saved policy holds every sample)."""
        t0 = time.monotonic()
        out = self._drain(sleep_s)
        self._drain_s += time.monotonic() - t0
        return out

    def _drain(self, sleep_s: float = 0.002) -> list[Sample]:
        out = self.poll()
        while len(self) > 0:
            time.sleep(sleep_s)
            out.extend(self.poll())
        return out

    def score(self, samples: list[Sample]) -> list[Sample]:
        """Scores `samples` and returns them; rewards of other samples that arrive meanwhile (a round's,
        still scoring while the driver evaluates) are kept for the next `poll`."""
        mine = {id(s) for s in samples}
        for s in samples:
            self.submit(s)
        out: list[Sample] = []
        while len(out) < len(samples):
            got = self.pool.poll()
            self._account(got)
            for s in got:
                (out if id(s) in mine else self._held).append(s)
            if len(out) < len(samples):
                time.sleep(0.002)
        return out

    def close(self) -> None:
        self.pool.close()

    def state_dict(self) -> dict[str, Any]:
        """Saved in every checkpoint (`extra["reward_stage"]`): the timeout history, so a resumed run gives
        each prompt the limit it had, and the autoscaler's measured scoring time."""
        return {"history": self.history.state_dict(),
                "scoring_mean_s": self.scaler.mean_s if self.scaler is not None else 0.0}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.history.load_state_dict(state.get("history", {}))
        if self.scaler is not None:
            self.scaler.mean_s = float(state.get("scoring_mean_s", 0.0))

    # -------------------------------------------------- order, scaling, accounting

    def _order_key(self, s: Sample) -> tuple:
        done = self._group_done[(s.prompt_id, s.epoch)]
        return (0 if done >= self.group_size else 1, -done, s.meta.get("reward_seq", 0))

    def _account(self, scored: list[Sample]) -> None:
        for s in scored:
            secs = float(s.meta.get("reward_seconds", 0.0))
            wait = float(s.meta.get("reward_done", 0.0)) - float(s.meta.get("gen_done", 0.0)) - secs
            self._waits.append(max(0.0, wait))
            self._scoring.append(secs)
            if self.history.record(s):
                self._timeouts[s.prompt_id] += 1
            if self.scaler is not None:
                self.scaler.observe(secs)
        busy, size = self.pool.busy, self.pool.size
        self._busy.append(busy)
        self._size_max = max(self._size_max, size)
        if self.scaler is not None:
            backlog = len(self.pool) - len(getattr(self.pool, "done", ()))
            new = self.scaler.decide(time.monotonic(), size, backlog)
            if new != size:
                self.pool.resize(new)
                self._resizes += 1

    def _reset_step(self) -> None:
        self._waits: list[float] = []
        self._scoring: list[float] = []
        self._busy: deque[int] = deque(maxlen=100_000)
        self._timeouts: Counter[str] = Counter()
        self._size_max, self._resizes = self.pool.size, 0
        self._drain_s = 0.0

    def step_metrics(self, batch: list[Sample], step_s: float) -> dict[str, Any]:
        """The step's reward/* figures (see the module docstring); resets the step's counters."""
        gen = [float(s.meta["gen_done"]) for s in batch if "gen_done" in s.meta]
        got = [float(s.meta["reward_done"]) for s in batch if "reward_done" in s.meta]
        # Within this step: a batch finished and scored during an earlier step's rollout costs this step nothing.
        start = time.monotonic() - step_s
        crit = max(0.0, max(got) - max(max(gen), start)) if gen and got else 0.0
        w, sc = self._waits, self._scoring
        row = {
            "reward/critical_path_s": crit,
            "reward/critical_path_share": crit / step_s if step_s > 0 else 0.0,
            "reward/queue_wait_s": sum(w) / len(w) if w else 0.0, "reward/queue_wait_max_s": max(w, default=0.0),
            "reward/scoring_s": sum(sc) / len(sc) if sc else 0.0, "reward/scoring_max_s": max(sc, default=0.0),
            "reward/scoring_total_s": sum(sc),
            "reward/workers_active": sum(self._busy) / len(self._busy) if self._busy else 0.0,
            "reward/workers": float(self.pool.size), "reward/workers_max": float(self._size_max),
            "reward/resizes": float(self._resizes),
            "reward/drain_s": self._drain_s,
            "reward/timeouts": float(sum(self._timeouts.values())),
            "reward/timeouts_by_prompt": dict(self._timeouts),
        }
        self._reset_step()
        return row


def _sandbox_line(reward_fn: Any, mode: str) -> str:
    """The one line saying which code sandbox is active, when the reward is the code reward."""
    name = reward_fn if isinstance(reward_fn, str) else getattr(reward_fn, "__module__", "")
    if "rewards.code" not in str(name):
        return ""
    from megatron_sortedrl.rewards.sandbox import Sandbox

    return Sandbox(mode).describe()


def make_reward_stage(cfg, reward_fn: Any = None, say: Callable[[str], None] = print) -> RewardStage:
    from megatron_sortedrl.rewards import reward_path

    return RewardStage(reward_fn or reward_path(cfg.data), cfg.reward, workers=cfg.data.reward_workers,
                       timeout_s=cfg.data.reward_timeout_s, group_size=cfg.rollout.n_samples_per_prompt, say=say)


# ------------------------------------------------------------------------------------------ Ray backend


class _RewardActor:
    """Scores batches in a Ray actor (CPU-only); the function is imported once, in the actor."""

    def __init__(self, fn_ref: Any) -> None:
        if isinstance(fn_ref, str):
            from megatron_sortedrl.rewards import load_reward_fn

            fn_ref = load_reward_fn(fn_ref)
        self.fn = fn_ref

    def ready(self) -> bool:
        return True

    def score(self, samples: list[Sample]) -> list[tuple[float, str, float, str]]:
        if getattr(self.fn, "batched", False):
            t0 = time.monotonic()
            try:
                outs = list(self.fn(samples, [s.ground_truth for s in samples]))
                per = (time.monotonic() - t0) / max(1, len(samples))
                return [(float(getattr(o, "score", o)), "", per, str(getattr(o, "reason", ""))) for o in outs]
            except Exception as exc:
                per = (time.monotonic() - t0) / max(1, len(samples))
                return [(0.0, f"{type(exc).__name__}: {exc}", per, "")] * len(samples)
        out = []
        for s in samples:
            t0 = time.monotonic()
            reward, err, reason = call_reward(self.fn, s)
            out.append((reward, err, time.monotonic() - t0, reason))
        return out


class RayRewardPool(RewardPool):
    """`RewardPool`'s interface and bookkeeping over Ray actors: one call in flight per actor; a call that
    runs past the sum of its samples' limits has its actor killed and replaced, its first sample scores 0
    ("timeout") and the rest are queued again. Batches go only to batch rewards (`fn.batched`): one sample a
    call otherwise, so a timeout loses one sample."""

    def __init__(self, reward_fn: Any, num_workers: int, timeout_s: float, max_batch: int,
                 order_key: Callable[[Sample], Any] | None, num_cpus: float, grace_s: float = 5.0) -> None:
        import ray

        if isinstance(reward_fn, str):
            from megatron_sortedrl.rewards import load_reward_fn

            batched = getattr(load_reward_fn(reward_fn), "batched", False)
        else:
            batched = getattr(reward_fn, "batched", False)
        self.fn_ref, self.timeout_s, self.grace_s, self.order_key = reward_fn, timeout_s, grace_s, order_key
        self.max_batch = max(1, max_batch) if batched else 1
        self._remote = ray.remote(num_cpus=num_cpus, num_gpus=0)(_RewardActor)
        self.target = max(1, num_workers)
        self._retiring: list = []
        self._start_failures = 0
        self.workers: list[dict[str, Any]] = []
        self.pending: deque[Sample] = deque()
        self.done: list[Sample] = []
        self.failures: list[tuple[str, str]] = []
        self.stats = {"scored": 0, "errors": 0, "timeouts": 0}
        self.resize(self.target)

    def _new(self) -> dict[str, Any]:
        actor = self._remote.options(scheduling_strategy="SPREAD").remote(self.fn_ref)
        return {"actor": actor, "ref": actor.ready.remote(), "tasks": [], "started": time.monotonic()}

    @property
    def busy(self) -> int:
        return sum(1 for w in self.workers if w["tasks"])

    def __len__(self) -> int:
        return len(self.pending) + sum(len(w["tasks"]) for w in self.workers) + len(self.done)

    def resize(self, n: int) -> None:
        self.target = max(1, n)
        while len(self.workers) < self.target:
            self.workers.append(self._new())
        self._retire()

    def _retire(self) -> None:
        import ray

        for w in [w for w in self.workers if not w["tasks"] and w["ref"] is None][: max(0, len(self.workers) - self.target)]:
            self.workers.remove(w)
            ray.kill(w["actor"])

    def _dispatch(self) -> None:
        if self.order_key is not None and len(self.pending) > 1:
            self.pending = deque(sorted(self.pending, key=self.order_key))
        for w in self.workers:
            if not self.pending:
                break
            if w["ref"] is None:
                w["tasks"] = [self.pending.popleft() for _ in range(min(self.max_batch, len(self.pending)))]
                w["started"] = time.monotonic()
                w["ref"] = w["actor"].score.remote(w["tasks"])

    def _collect(self) -> None:
        import ray

        refs = [w["ref"] for w in self.workers if w["ref"] is not None]
        ready = set(ray.wait(refs, num_returns=len(refs), timeout=0)[0]) if refs else set()
        for i, w in enumerate(self.workers):
            if w["ref"] is None:
                continue
            if w["ref"] in ready:
                tasks, w["tasks"], ref, w["ref"] = w["tasks"], [], w["ref"], None
                try:
                    results = ray.get(ref)
                    self._start_failures = 0
                except Exception as exc:  # the actor died (or its start failed): its samples score 0
                    results = [(0.0, f"reward worker died ({type(exc).__name__})", 0.0, "")] * len(tasks)
                    self._start_failures += 1
                    if self._start_failures >= 5:  # an actor that cannot start would be replaced forever
                        from megatron_sortedrl.errors import UserError

                        raise UserError(f"reward actors keep failing to start or dying ({exc}); check that "
                                        f"the reward function imports on every node") from None
                    self.workers[i] = self._new()
                if tasks:  # else: the start-up ping (`ready`)
                    for s, (reward, err, secs, reason) in zip(tasks, results):
                        self._finish(s, reward, err, secs, reason)
            elif w["tasks"] and time.monotonic() - w["started"] > sum(self._limit(s) for s in w["tasks"]):
                lost, rest = w["tasks"][0], w["tasks"][1:]
                ray.kill(w["actor"])
                self.workers[i] = self._new()
                self.pending.extendleft(reversed(rest))
                self._finish(lost, 0.0, "timeout")
        self._retire()
        self._dispatch()

    def drain(self, sleep_s: float = 0.002) -> list[Sample]:
        out = self.poll()
        while self.pending or any(w["tasks"] for w in self.workers):
            time.sleep(sleep_s)
            out.extend(self.poll())
        return out

    def close(self) -> None:
        import ray

        for w in self.workers:
            try:
                ray.kill(w["actor"])
            except Exception:  # already gone
                pass
        self.workers = []
