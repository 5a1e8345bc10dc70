"""One rollout round, streamed: the driver's `generate` phase.

    harvest = stream_round(driver, rnd)

Submits up to the engine batch per worker (own queue first, then stealing), polls completions, records
first-token/finish/abort events on the timeline, hands finished samples to the reward stage, lets the policy
decide the harvest and what to abort, feeds finished siblings to HistoSpec and, with `trainer.stream`, starts
the backward of finished groups while the rest generates. Split out of `driver.py` so that the driver stays
a short file of named phases; `d` is the `Driver` whose engines, policy, reward stage and timeline it uses.

Rewards of samples the harvest did not take are not waited for after the harvest: they score while the
step trains and reach the policy before the next round is composed (`compose_round`) or while it runs;
a checkpoint waits for all of them first (`hand_over_rewards(d, wait=True)`), so none is lost.

With tools on (`d.agentic`, megatron_sortedrl/agentic/trajectory.py) a finished turn that called a tool goes to
the tool runner instead of the reward stage and stays live; its outcome, polled in the same loop, appends the
tool tokens and queues the sample again as a continued request (`request_of`), until the trajectory ends. A
sample aborted while waiting for its tools is handed to the policy as a partial and re-runs them on resume.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

from megatron_sortedrl.sample import Sample


def stream_round(d: Any, rnd: Any):
    """Streams the round: submits up to the engine batch per worker, scores completions as they land, and
    lets the policy harvest; returns the `Harvest`."""
    from megatron_sortedrl.rollout import GenRequest
    from scheduler.placement import WorkerQueues

    queues = WorkerQueues(rnd.layout.num_engines)
    queues.add(rnd.requests)
    live: dict[str, Sample] = {}  # submitted to the pool or the reward pool, not yet handed back
    inflight = [0] * rnd.layout.num_engines
    cap = d.cfg.rollout.max_num_seqs

    traj = getattr(d, "agentic", None)  # tool-using trajectories, or None
    ahead = deque(rnd.lookahead)  # twotier lookahead: a worker with no round work left starts these (its share)
    share, ahead_w = -(-len(ahead) // max(1, len(inflight))), set()

    def next_request(w: int, steal: bool | None):
        if steal is not None:
            return queues.pop(w, steal=steal)
        if ahead and not len(queues) and (not inflight[w] or w in ahead_w) and inflight[w] < share:
            ahead_w.add(w)
            return ahead.popleft()
        return None

    def fill() -> None:
        items = []
        # Own queues first, else the first worker with free slots takes all; then lookahead for idle workers.
        for steal in (False, True, None):
            for w in range(len(inflight)):
                while inflight[w] < cap and (req := next_request(w, steal)) is not None:
                    s = req.sample
                    if req.max_tokens <= 0:  # a resumed partial already at the length limit
                        s.finish_reason = "length"
                        d._score(s)
                        live[s.sample_id] = s
                        continue
                    s.submit_time = s.submit_time or d.clock.now()
                    if traj is not None and traj.resume(s):  # carried over while its tools ran: run them again
                        live[s.sample_id] = s
                        continue
                    items.append((GenRequest(s.sample_id, s.prompt_tokens + s.response_tokens,
                                             d._sampling(req.max_tokens)), w))
                    live[s.sample_id], inflight[w] = s, inflight[w] + 1
                    d.events.append(d.timeline.record("request", "submit", d.step, worker=w,
                                                            sample_id=s.sample_id, tokens=s.response_length))
        if items:
            d.pool.submit_many(items)

    def on_completion(c) -> None:
        s = live[c.request_id]
        inflight[c.worker_id] = max(0, inflight[c.worker_id] - 1) if c.worker_id >= 0 else 0
        if c.finish_reason == "lost":  # the engine died: run it again (the pool restarted the slot)
            del live[c.request_id]
            s.reset_response() if not s.response_length else None
            queues.add([request_of(s, d.cfg.rollout.max_response_length)])
            return
        if c.first_token_time:  # the engine's stamp (driver monotonic clock) put on the run clock
            d.events.append(d.timeline.record(
                "request", "first_token", d.step, t=d.clock.now() - (time.monotonic() - c.first_token_time),
                worker=c.worker_id, sample_id=s.sample_id, tokens=s.response_length + 1))
        c.to_sample(s)
        d.events.append(d.timeline.record("request", "finish" if c.finished else "abort", d.step,
                                                worker=c.worker_id, sample_id=s.sample_id,
                                                tokens=s.response_length))
        if c.finished:
            if traj is None or not traj.turn_done(s):  # a turn that called a tool: the runner has it, still live
                finish(s)
        else:
            del live[s.sample_id]
            d.policy.on_sample_aborted(s, d.clock)

    def finish(s: Sample) -> None:
        d._score(s)
        d.feed.on_finished(s)  # siblings still running draft from it

    def tools_done() -> None:
        for s, more in traj.poll() if traj is not None else ():
            queues.add([request_of(s, d.cfg.rollout.max_response_length)]) if more else finish(s)

    def abort(ids: list[str]) -> None:
        for sid in ids:
            if traj is not None and (s := traj.drop(sid)) is not None:  # waiting for tools: a partial
                live.pop(sid, None)
                d.policy.on_sample_aborted(s, d.clock)
                continue
            req = queues.remove(sid) or next((r for r in ahead if r.sample.sample_id == sid), None)
            ahead.remove(req) if req is not None and req in ahead else None
            if req is not None:
                live.pop(sid, None)
                d.policy.on_sample_aborted(req.sample, d.clock)
        for c in d.pool.abort([sid for sid in ids if sid in live]):
            on_completion(c)

    def scored() -> None:
        for s in d.rewards.poll():
            mine = live.get(s.sample_id)
            if mine is not None and mine is not s and mine.submit_time != s.submit_time:
                continue  # an earlier attempt of a restarted sample (tail's long round reuses the ids): void
            live.pop(s.sample_id, None)
            abort(d.policy.on_sample_finished(s, d.clock))
            if d.stream:  # backward of a finished group that will be trained, while the rest generates
                d.stream.on_finished(s)

    fill()
    while (harvest := d.policy.harvest(d.clock)) is None:
        # checked against the harvest decision just taken, not a stale one; a sample may still be in the
        # reward stage from an earlier round (handed over by `scored`)
        if not live and not len(queues) and not len(d.rewards):
            raise RuntimeError(f"step {d.step}: the {d.policy.name} policy waits for samples that no "
                               f"engine or queue holds (round {rnd.index}, {rnd.kind}); this is a policy bug")
        for c in d.pool.poll(0.02):
            on_completion(c)
        tools_done()
        scored()
        fill()
        d.feed.maybe_ship()
    abort(harvest.abort)
    # Whatever finished while the abort was on its way still comes back once: hand it over too.
    while d.pool.in_flight:
        for c in d.pool.poll(0.02):
            on_completion(c)
    # Rewards of finished samples the harvest did not take keep scoring while the step trains: they reach
    # the policy through `hand_over_rewards` before the next round is composed, or during it (`scored`).
    for req in queues.drain() + list(ahead):
        d.policy.on_sample_aborted(req.sample, d.clock)
    for s in traj.drop_all() if traj is not None else ():  # still waiting for tools: carried as partials
        live.pop(s.sample_id, None)
        d.policy.on_sample_aborted(s, d.clock)
    d._phase("rollout", "end")
    return harvest


def hand_over_rewards(d: Any, wait: bool = False) -> int:
    """Gives the policy the samples scored since the last round (all still being scored with `wait`, which
    a checkpoint does, so no sample is left behind in the reward stage); returns how many."""
    got = d.rewards.drain() if wait else d.rewards.poll()
    for s in got:
        d.policy.on_sample_finished(s, d.clock)  # between rounds: nothing runs that an abort could stop
    return len(got)


def compose_round(d: Any):
    """The policy's next round, after handing it the rewards that arrived while the last step trained; when
    it has nothing to generate while rewards are still on their way, it waits for them and asks again."""
    hand_over_rewards(d)
    rnd = d.policy.compose_round(d.clock)
    if rnd is None and len(d.rewards):
        hand_over_rewards(d, wait=True)
        rnd = d.policy.compose_round(d.clock)
    return rnd


def request_of(s: Sample, max_len: int):
    """A queue entry that continues `s` (a lost request put back, or a resumed partial)."""
    from scheduler.protocol import Request

    return Request(sample=s, worker=0, predicted_length=s.predicted_length,
                   max_tokens=max_len - s.response_length)

