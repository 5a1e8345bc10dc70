"""Asynchronous reward scoring in worker processes, with a per-sample timeout.

    pool = RewardPool("megatron_sortedrl.rewards.arithmetic.reward", num_workers=1, timeout_s=10)
    pool.submit(sample)                      # as soon as a rollout finishes (overlaps generation)
    for sample in pool.poll():               # scored samples: sample.reward set, sample.reward_error on failure
        ...
    pool.drain()                             # blocks until everything submitted is scored
    pool.stats                               # {"scored": .., "errors": .., "timeouts": ..}
    pool.close()

The reward function is `def reward(sample, ground_truth) -> float` (see `megatron_sortedrl.rewards`), given
as a dotted path or a module-level callable. Workers are `spawn`ed, never forked: the driver process holds
Ray and vLLM threads that a fork would copy in a broken state. A worker dies with the pool's process, even
when that is SIGKILLed (`lifetime.die_with_parent`). A function that raises gives reward 0, the
exception text in `sample.reward_error`, and one line in `pool.failures` (sample id, error); a function
that runs past `timeout_s` has its worker killed and restarted, and the sample gets reward 0 with
"timeout" as its error. The run goes on either way.

Samples go to a free worker in batches (everything pending, up to `max_batch`) and come back one by one as
each is scored, so a burst of completions at the end of a round costs one round trip, not one per sample:
scoring one sample per message left the engines idle while the driver waited on the pipe. The timeout
clock restarts at each returned result, so it still bounds one call; when it fires, only the sample being
scored is lost (reward 0, "timeout") and the rest of its batch goes back to the front of the queue.

A reward may return a float or an object with `score` and `reason` (`rewards.code.RewardResult`): the
reason goes to `sample.meta["reward_reason"]`, and a reason starting with "timeout" (the code sandbox's own
wall-clock limit) counts as a timeout. Each result also brings the seconds the call took in the worker
(`sample.meta["reward_seconds"]`) and the driver's clock when it arrived (`sample.meta["reward_done"]`),
which the reward stage turns into queue wait, scoring time and the critical path. A sample may carry its
own limit in `sample.meta["reward_timeout_s"]` (timeouts from history): the worker is then killed
`grace_s` after it, instead of after `timeout_s`. `order_key` sorts what is pending before each dispatch
(the order the harvest needs), and `resize(n)` grows or shrinks the pool while it runs.

Tests: `python -m pytest tests/test_reward_pool.py -q`.
Left out: rewards on remote nodes (see `reward_stage.RayRewardPool`).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from collections import deque
from typing import Any, Callable, Iterator

from megatron_sortedrl.lifetime import die_with_parent
from megatron_sortedrl.sample import Sample


def worker_messages(conn: Any) -> Iterator[Any]:
    """What a worker process's pipe brings, until the pool closes it (None) or goes away (EOF); the loop of
    every worker of this pool's machinery (reward workers here, tool workers in agentic/runner.py)."""
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if msg is None:
            return
        yield msg


def _worker_main(fn_ref: Any, conn: Any, parent: int | None = None) -> None:
    # Dies with the pool's process, even when that is SIGKILLed (the pool is driven from one long-lived thread).
    die_with_parent(parent)
    if isinstance(fn_ref, str):
        from megatron_sortedrl.rewards import load_reward_fn

        fn = load_reward_fn(fn_ref)
    else:
        fn = fn_ref
    # A reward's `after_call` (the code reward: start the next sandbox ahead) runs after each result has
    # gone back, while the driver has what it waited for; failures there are the next call's problem.
    after = getattr(fn, "after_call", None)
    if after is not None:
        after()
    conn.send("ready")  # the timeout clock starts only after the (slow, spawned) import
    for msg in worker_messages(conn):
        for sample_id, sample in msg:  # a batch; each result goes back as soon as it is known
            t0 = time.monotonic()
            reward, err, reason = call_reward(fn, sample)
            conn.send((sample_id, reward, err, time.monotonic() - t0, reason))
            if after is not None:
                try:
                    after()
                except Exception:  # noqa: BLE001 - the next call starts its sandbox cold instead
                    pass


def call_reward(fn: Callable[..., Any], sample: Sample) -> tuple[float, str, str]:
    """(reward, error, reason) of one call; an exception is an error with reward 0, never raised. A result
    with `seconds` (the code reward's program run time) puts it in the reason as `reason|seconds`."""
    try:
        out = fn(sample, sample.ground_truth)
        if hasattr(out, "score"):
            reason = str(getattr(out, "reason", ""))
            if getattr(out, "seconds", None) is not None:
                reason = f"{reason}|{float(out.seconds):.6f}"
            return float(out.score), "", reason
        return float(out), "", ""
    except Exception as exc:  # a buggy reward must not stop the run: counted by the pool
        return 0.0, f"{type(exc).__name__}: {exc}", ""


class RewardWorker:
    """One spawned worker and its pipe; `target(fn_ref, conn, parent)` is its main (the tool runner passes its own)."""

    def __init__(self, ctx: Any, fn_ref: Any, target: Callable[..., None] | None = None) -> None:
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=target or _worker_main, args=(fn_ref, child, os.getpid()), daemon=True)
        self.proc.start()
        child.close()
        self.tasks: deque[Sample] = deque()  # the batch sent, in order; tasks[0] is being scored
        self.started = 0.0  # when tasks[0] started (the batch was sent, or the previous result came back)
        self.ready = False

    def check_ready(self) -> bool:
        if not self.ready and self.conn.poll():
            self.ready = self.conn.recv() == "ready"
        return self.ready

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(5)
        self.conn.close()


class RewardPool:
    def __init__(self, reward_fn: str | Callable[..., float], num_workers: int = 1, timeout_s: float = 10.0,
                 max_batch: int = 64, order_key: Callable[[Sample], Any] | None = None, grace_s: float = 5.0) -> None:
        if isinstance(reward_fn, str):  # fail in the driver, with a config error, not in a worker
            from megatron_sortedrl.rewards import load_reward_fn

            load_reward_fn(reward_fn)
        self.fn_ref, self.timeout_s, self.max_batch = reward_fn, timeout_s, max(1, max_batch)
        self.order_key, self.grace_s = order_key, grace_s
        self.target = max(1, num_workers)
        self._retiring: list[tuple[RewardWorker, float]] = []  # asked to exit, not yet gone
        self._ctx = mp.get_context("spawn")
        self.workers = [RewardWorker(self._ctx, reward_fn) for _ in range(max(1, num_workers))]
        self.pending: deque[Sample] = deque()
        self.done: list[Sample] = []
        self.failures: list[tuple[str, str]] = []  # (sample id, error) of every failed or timed-out call
        self.stats = {"scored": 0, "errors": 0, "timeouts": 0}

    def submit(self, sample: Sample) -> None:
        self.pending.append(sample)
        self._dispatch()

    def __len__(self) -> int:
        """Samples submitted and not yet returned by `poll`/`drain`."""
        return len(self.pending) + sum(len(w.tasks) for w in self.workers) + len(self.done)

    @property
    def size(self) -> int:
        return len(self.workers)

    @property
    def busy(self) -> int:
        """Workers scoring now."""
        return sum(1 for w in self.workers if w.tasks)

    def resize(self, n: int) -> None:
        """Grows to `n` workers now; shrinks by retiring idle workers (busy ones finish first)."""
        self.target = max(1, n)
        while len(self.workers) < self.target:
            self.workers.append(RewardWorker(self._ctx, self.fn_ref))
        self._retire()

    def _retire(self) -> None:
        # Without waiting for the process to exit: a join here would stall scoring for everyone else.
        for w in [w for w in self.workers if not w.tasks][: max(0, len(self.workers) - self.target)]:
            self.workers.remove(w)
            try:
                w.conn.send(None)
            except (OSError, BrokenPipeError):
                pass
            self._retiring.append((w, time.monotonic() + 10.0))
        keep = []
        for w, deadline in self._retiring:
            if w.proc.is_alive() and time.monotonic() > deadline:
                w.kill()
            elif w.proc.is_alive():
                keep.append((w, deadline))
            else:
                w.proc.join(0)
        self._retiring = keep

    def _limit(self, sample: Sample) -> float:
        own = sample.meta.get("reward_timeout_s")
        return float(own) + self.grace_s if own else self.timeout_s

    def _dispatch(self) -> None:
        if self.order_key is not None and len(self.pending) > 1:
            self.pending = deque(sorted(self.pending, key=self.order_key))
        idle = [w for w in self.workers if not w.tasks and w.check_ready()]
        for k, w in enumerate(idle):
            if not self.pending:
                break
            # Share what is pending among the idle workers; one message per worker.
            n = min(self.max_batch, -(-len(self.pending) // (len(idle) - k)))
            w.tasks.extend(self.pending.popleft() for _ in range(n))
            w.started = time.monotonic()
            w.conn.send([(t.sample_id, t) for t in w.tasks])

    def _finish(self, sample: Sample, reward: float, err: str, seconds: float | None = None, reason: str = "") -> None:
        now = time.monotonic()
        if "|" in reason:  # reason|program seconds (see call_reward)
            reason, _, program_s = reason.rpartition("|")
            sample.meta["reward_program_s"] = float(program_s)
        sample.reward, sample.reward_error = reward, err
        sample.meta["reward_reason"] = reason or err
        sample.meta["reward_seconds"] = seconds if seconds is not None else self._limit(sample)
        sample.meta["reward_done"] = now
        self.stats["scored"] += 1
        if err:
            self.stats["timeouts" if err == "timeout" else "errors"] += 1
            self.failures.append((sample.sample_id, err))
        elif reason.startswith("timeout"):  # the program ran past its own limit (code sandbox)
            self.stats["timeouts"] += 1
            self.failures.append((sample.sample_id, "timeout (program)"))
        self.done.append(sample)

    def _collect(self) -> None:
        for i, w in enumerate(self.workers):
            if not w.tasks:
                if not w.ready and not w.proc.is_alive():  # died while importing the function
                    self._restart(i)
                continue
            try:
                while w.tasks and w.conn.poll():
                    _sid, reward, err, seconds, reason = w.conn.recv()
                    self._finish(w.tasks.popleft(), reward, err, seconds, reason)
                    w.started = time.monotonic()
            except (EOFError, OSError):  # the worker died (e.g. the function called os._exit)
                self._lose_first(i, "reward worker died")
                continue
            if w.tasks and (not w.proc.is_alive() or time.monotonic() - w.started > self._limit(w.tasks[0])):
                self._lose_first(i, "timeout" if w.proc.is_alive() else "reward worker died")
        self._retire()
        self._dispatch()

    def _lose_first(self, i: int, err: str) -> None:
        """The sample being scored by worker i scores 0 with `err`; the rest of its batch is queued again first."""
        tasks = self.workers[i].tasks
        lost = tasks.popleft()
        self.pending.extendleft(reversed(tasks))
        tasks.clear()
        self._restart(i)
        self._finish(lost, 0.0, err)

    def _restart(self, i: int) -> None:
        self.workers[i].kill()
        self.workers[i] = RewardWorker(self._ctx, self.fn_ref)

    def poll(self) -> list[Sample]:
        """Samples scored since the last call (non-blocking)."""
        self._collect()
        out, self.done = self.done, []
        return out

    def drain(self, sleep_s: float = 0.002) -> list[Sample]:
        """Blocks until every submitted sample is scored; returns those not yet returned."""
        out = self.poll()
        while self.pending or any(w.tasks for w in self.workers):
            time.sleep(sleep_s)
            out.extend(self.poll())
        return out

    def score(self, samples: list[Sample]) -> list[Sample]:
        for s in samples:
            self.submit(s)
        return self.drain()

    def close(self) -> None:
        for w in self.workers + [w for w, _ in self._retiring]:
            close_reward_worker(w)

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def close_reward_worker(w: RewardWorker) -> None:
    try:
        w.conn.send(None)
    except (OSError, BrokenPipeError):
        pass
    w.proc.join(2)
    if w.proc.is_alive():
        w.kill()
