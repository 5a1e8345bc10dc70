"""The asynchronous RL loop (`scheduler.policy=async`): the engines never wait for the trainer.

    loop = AsyncLoop(driver)          # the driver builds it when scheduler.policy=async
    row, batch = loop.rl_step()       # one optimizer step; the engines generate before, during and after it

One step, as named phases::

    batch = collect()        # keep the engines full (admission within the bound), score what lands, until the
                             # controller's next mini-batch (whole groups, earliest deadline first) is complete
    train(batch)             # one optimizer step in a thread of its own; the engines keep generating and new
                             # groups are admitted while it runs
    push_weights()           # every scheduler.weight_update_interval steps, in flight: each engine pauses
                             # between decode steps, loads, and goes on
    update_history(batch); log()

What the bound means: a sample's staleness is the optimizer steps between the weights that sampled its oldest
token and the step that trains it (as `minibatch.py` counts it for the synchronous policies). A group is admitted
only if it can be trained within `scheduler.staleness_bound` steps of the weights the engines hold, and the
controller (`scheduler/asynchronous.py`) never hands out a mini-batch that would leave one past its deadline, so
no sample is ever discarded for staleness. In-flight updates keep a running request's tokens and its KV cache
(vLLM's `pause_generation(mode="keep")`): tokens after the push are sampled by the new weights over keys and values
the old ones computed, as PipelineRL and NeMo-RL do; each token carries its version (`Sample.version_spans`), and
the loss weighs it against its own behaviour log-prob (the decoupled objective, algorithms.py) and clips against
the weights at the step's start.

Checkpoints (the driver's, between steps) keep every admitted group: finished samples with their tokens and
rewards, unfinished ones by position, generated again on resume under the newer weights. Evaluation first
aborts what runs (`hold`) and puts the partials back in the queue, so the held-out prompts have the engines to
themselves; the partials continue afterwards with their version spans.

Left out: colocated engines, streamed training, dynamic sampling, tools and re-layouts (refused by the config,
`check_asynchronous`), and more than one optimizer step per mini-batch.
"""

from __future__ import annotations

import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from megatron_sortedrl.minibatch import staleness_metrics
from megatron_sortedrl.sample import Sample
from megatron_sortedrl.shaping import shape_batch

TAIL_SHARE = 0.25  # with 4 or more engines, this share of them takes the groups predicted long (the simulator's)


class AsyncLoop:
    def __init__(self, d: Any) -> None:
        from scheduler.placement import WorkerQueues

        self.d, self.policy = d, d.policy
        self.ctl = d.policy.ctl
        self.engines = d.pool.layout[0]
        self.tail = round(self.engines * TAIL_SHARE) if self.ctl.length_aware and self.engines >= 4 else 0
        self.queues = WorkerQueues(self.engines)
        self.live: dict[str, Sample] = {}  # submitted to an engine, not yet back
        self.inflight = [0] * self.engines
        self.cap = d.cfg.rollout.max_num_seqs
        self.every = d.cfg.scheduler.weight_update_interval
        self.since_push = 0
        self.generated: list[int] = []  # lengths of the responses finished since the last step
        self.trainer_thread = ThreadPoolExecutor(1, thread_name_prefix="async-train")

    # ------------------------------------------------------------------------------------------ phases

    def collect(self) -> list[Sample] | None:
        """Feeds the engines and scores what lands until the next mini-batch is complete; None: data used up."""
        self.d._phase("rollout", "start", layout=f"{self.engines}x{self.d.pool.layout[1]}")
        try:
            while (batch := self.ctl.next_minibatch()) is None:
                if self.ctl.done:
                    return None
                if not self.pump(0.02) and not self.live and not len(self.queues) and not len(self.d.rewards):
                    raise RuntimeError(f"step {self.d.step}: the async controller waits for samples that no engine, "
                                       f"queue or reward worker holds ({len(self.ctl.groups)} groups); a policy bug")
            return batch
        finally:
            self.d._phase("rollout", "end")

    def train(self, batch: list[Sample]) -> dict[str, Any]:
        """One optimizer step on `batch` in the trainer thread while this one keeps the engines fed."""
        d = self.d
        d._phase("train", "start")
        shaped, shaping = shape_batch(batch, d.cfg.sampling, d.cfg.rollout.max_response_length)
        job = self.trainer_thread.submit(lambda: d.trainer.train_minibatches([shaped], d.trainer.advantages(shaped)))
        while not job.done():
            self.pump(0.02)
        out = job.result()
        ages = self.ctl.stepped(batch)
        d.minibatch.stepped(1)
        self.since_push += 1
        d._phase("train", "end")
        lengths = sorted(s.response_length for s in batch)
        fresh, self.generated = self.generated, []
        return {**{f"train/{k}": v for k, v in {**out, **shaping, **staleness_metrics(ages)}.items()},
                "train/optimizer_steps": 1.0, "train/samples_trained": float(len(batch)),
                "async/trained_mean_length": statistics.fmean(lengths),
                "async/trained_p90_length": float(lengths[min(len(lengths) - 1, int(0.9 * len(lengths)))]),
                "async/generated_mean_length": statistics.fmean(fresh) if fresh else float("nan"),
                "async/oldest_age_steps": float(max(ages, default=0)), "async/discarded": float(self.ctl.discarded),
                "async/groups_waiting": float(len(self.ctl.groups)), "async/in_flight": float(len(self.live))}

    def push_weights(self) -> dict[str, float]:
        """In-flight weight update (every `weight_update_interval` steps, and after the last one)."""
        if self.since_push < self.every and not self.ctl.done:
            return {}
        self.since_push = 0
        return self.d.sync_weights()  # the pool pauses each engine between decode steps, loads, resumes

    def rl_step(self) -> tuple[dict[str, Any], list[Sample]] | None:
        """One step: (the metrics row, the trained mini-batch); None when the data is used up."""
        d = self.d
        t0 = time.monotonic()
        d.events, d.layout_row = [], {}
        batch = self.collect()
        if batch is None:
            return None
        train = self.train(batch)
        sync = self.push_weights()
        spec = d.update_history(batch)
        step_s = time.monotonic() - t0
        row = d.log(step_s, batch, {}, train, sync, spec, d.rewards.step_metrics(batch, step_s))
        return row, batch

    # ------------------------------------------------------------------------------------------ plumbing

    def pump(self, wait_s: float) -> bool:
        """Admits what the bound allows, fills free engine slots, takes completions and rewards; True if
        anything came back."""
        d = self.d
        reqs = self.policy.admit()
        if reqs:
            from scheduler.asynchronous import place_admitted

            place_admitted(reqs, self.engines, self.policy.long_cut, self.tail)
            self.queues.add(reqs)
        self.fill()
        got = d.pool.poll(wait_s) if self.live else []
        for c in got:
            self.on_completion(c)
        scored = d.rewards.poll()
        for s in scored:
            self.policy.on_sample_finished(s, d.clock)
        d.feed.maybe_ship()
        return bool(got or scored)

    def fill(self) -> None:
        from megatron_sortedrl.rollout import GenRequest

        d, items = self.d, []
        for steal in (False, True):  # own queues first, then the most loaded one's longest
            for w in range(self.engines):
                while self.inflight[w] < self.cap and (req := self.queues.pop(w, steal=steal)) is not None:
                    s = req.sample
                    if req.max_tokens <= 0:  # a held partial already at the length limit
                        s.finish_reason = "length"
                        d._score(s)
                        continue
                    s.submit_time = s.submit_time or d.clock.now()
                    items.append((GenRequest(s.sample_id, s.prompt_tokens + s.response_tokens,
                                             d._sampling(req.max_tokens)), w))
                    self.live[s.sample_id], self.inflight[w] = s, self.inflight[w] + 1
                    d.events.append(d.timeline.record("request", "submit", d.step, worker=w, sample_id=s.sample_id,
                                                      tokens=s.response_length))
        if items:
            d.pool.submit_many(items)

    def on_completion(self, c) -> None:
        from megatron_sortedrl.round_stream import request_of

        d = self.d
        s = self.live.pop(c.request_id)
        self.inflight[c.worker_id] = max(0, self.inflight[c.worker_id] - 1) if c.worker_id >= 0 else 0
        if c.finish_reason == "lost":  # the engine died: run it again (the pool restarted the slot)
            s.reset_response() if not s.response_length else None
            self.queues.add([request_of(s, d.cfg.rollout.max_response_length)])
            return
        c.to_sample(s)
        d.events.append(d.timeline.record("request", "finish" if c.finished else "abort", d.step,
                                          worker=c.worker_id, sample_id=s.sample_id, tokens=s.response_length))
        if not c.finished:  # held for an evaluation: it continues later with its tokens and versions
            self.queues.add([request_of(s, d.cfg.rollout.max_response_length)])
            return
        self.generated.append(s.response_length)
        d._score(s)
        d.feed.on_finished(s)  # siblings still running draft from it

    def hold(self) -> None:
        """Before an evaluation: what runs is aborted and queued again as partials (nothing lost)."""
        for c in self.d.pool.abort(list(self.live)):
            self.on_completion(c)
        while self.d.pool.in_flight:
            for c in self.d.pool.poll(0.02):
                self.on_completion(c)
        self.inflight = [0] * self.engines

    def close(self) -> None:
        self.trainer_thread.shutdown(wait=True)
