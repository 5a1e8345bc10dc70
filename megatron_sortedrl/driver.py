"""The RL loop as named phases: the one place where trainer, rollout pool, scheduler, rewards and HistoSpec meet.

    python -m megatron_sortedrl train configs/tiny_cpu.yaml [key=value ...]

    driver = Driver(cfg); summary = driver.run(); driver.close()

One step of `run()` reads like the algorithm::

    round   = compose_round()          # the scheduling policy picks prompts, layout and placement
    harvest = generate(round)          # stream completions; score each as it lands (reward pool);
                                       # the policy decides when to harvest and what to abort
    train(harvest.batch)               # advantages from rewards; one optimizer step per mini-batch
                                       # (algorithm.ppo_mini_batch_size, minibatch.py)
    sync_weights()                     # trainer -> rollout engines, policy version + 1
    update_history(harvest.batch)      # HistoSpec drafts come from the previous responses of a prompt
    log(); checkpoint(); evaluate()

Before RL, `warm_start()` runs a short supervised phase on the task's worked solutions, so that the tiny
model solves some problems and RL has a signal. Policies decide, the driver executes: everything here is
plumbing between `scheduler.protocol.SchedulingPolicy` and the engines.

Outputs in `logging.run_dir`: `config.yaml` (the resolved config), `metrics.jsonl` (+ TensorBoard),
`timeline.jsonl` (phases, requests), `reward_failures.jsonl` (sample id and error of every reward call that
raised or timed out), `checkpoints/iter_<step>/`, `summary.json` and `report/report.html`.

Checkpoint and resume: every `checkpoint.save_interval` steps, at the end, and when SIGTERM or SIGUSR1
arrives (Slurm's pre-timeout signal; the step in progress finishes first), the trainer writes an atomic
checkpoint whose `extra` holds everything else a run needs to continue exactly: step and policy version,
the scheduler's state (length history, long-tail queue, cached partial rollouts, data cursor), the HistoSpec
history, Python's RNG, the run clock and the reward failure counts. A new `train` with the same run
directory resumes from the newest complete one (`checkpoint.resume=auto`): the metrics, timeline and
TensorBoard records of steps after it are dropped (they will be run again), so every step appears once.

The bookkeeping around the loop (resume point, record files, the metrics row, summary, report, stop signals)
lives in `run_records.py`; the set-up before the first phase (tokenizer, Ray, trainer, engines, rewards,
policy) in `run_setup.py`; the streamed round (the `generate` phase) in `round_stream.py`.

With `scheduler.policy=async` the driver runs the asynchronous loop instead (`async_loop.py`): one step is one
optimizer step, the engines generate throughout, and weights reach them in flight under a staleness bound; the
phases around it (warm start, eval, checkpoint, resume, log) are the same.
"""

from __future__ import annotations

import random
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from megatron_sortedrl import lifetime
from megatron_sortedrl.agentic.trajectory import sample_meta, step_metrics
from megatron_sortedrl.async_loop import AsyncLoop
from megatron_sortedrl.errors import CheckpointError
from megatron_sortedrl.minibatch import train_update
from megatron_sortedrl.preflight import preflight
from megatron_sortedrl.relayout import apply_layout, apply_speculation, layout_name
from megatron_sortedrl.round_stream import compose_round, hand_over_rewards, stream_round
from megatron_sortedrl.run_records import RunRecords, catch_stop_signals, resume_point
from megatron_sortedrl.run_setup import set_up_run
from megatron_sortedrl.sample import Prompt, Sample
from megatron_sortedrl.shaping import shape_batch


@dataclass
class StepResult:
    step: int
    metrics: dict[str, Any]
    batch: list[Sample]


class Driver:
    def __init__(self, cfg, printer: Callable[[str], None] = print, reward_fn: Any = None) -> None:
        self.cfg, self.say = cfg, printer
        self.run_dir = Path(cfg.logging.run_dir)
        self.ckpt_root = Path(cfg.checkpoint.dir or self.run_dir / "checkpoints")
        self.step, self.version = 0, 0
        self.events: list = []  # the current step's timeline events, for its bubble ratio
        self.layout_row: dict[str, float] = {}  # the current step's engine layout metrics (relayout.py)
        self.stop_signal: str | None = None  # set by SIGTERM/SIGUSR1: checkpoint after this step and stop
        self.accuracy_before: float | None = None
        self._ptok: dict[str, list[int]] = {}  # prompt id -> its encoded tokens
        self._saved_step = -1
        self.resume_from = resume_point(cfg, self.ckpt_root)
        preflight(cfg, self.resume_from, reward_fn)  # one-line errors before Ray, trainer or engines start
        # Everything started from here on (local Ray, engines and their vLLM processes, reward workers) ends
        # with this process, even when it is SIGKILLed (lifetime.py); close() disarms it.
        self.lifetime = lifetime.guard()
        try:
            set_up_run(self, reward_fn)  # tokenizer, prompts, Ray, trainer, engines, rewards, policy (run_setup.py)
            self.async_loop = AsyncLoop(self) if cfg.scheduler.policy == "async" else None
            self._resumed = self._load_resume_state() if self.resume_from else {}
            self._open_records()
        except BaseException:
            self._end_failed_setup()
            raise

    # ------------------------------------------------------------------------------------------ set-up

    def _end_failed_setup(self) -> None:
        """A set-up that failed part way ends what it started; the error is the caller's to report."""
        import ray

        if getattr(self, "owns_ray", False) and ray.is_initialized():
            ray.shutdown()
        self.lifetime.close(end_rest=True)

    def _load_resume_state(self) -> dict[str, Any]:
        """Loads model and optimizer into the trainer and restores the driver's state from `extra`."""
        assert self.resume_from is not None
        extra = self.trainer.load_checkpoint(self.resume_from)
        if "scheduler" not in extra:
            raise CheckpointError(f"{self.resume_from} is a model checkpoint without RL run state (no scheduler "
                                  "state in it); start from it with model.path, or use checkpoint.resume=never")
        self.step, self.version = int(extra["step"]), int(extra["version"])
        self._saved_step = self.step
        self.policy.load_state_dict(extra["scheduler"])
        self.history.load_state_dict(extra["histospec"])
        self.minibatch.load_state_dict(extra.get("minibatch", {}))
        random.setstate(extra["rng"])
        self.rewards.stats.update(extra.get("reward_stats", {}))
        self.rewards.load_state_dict(extra.get("reward_stage", {}))  # per-prompt timeout history
        self.accuracy_before = extra.get("accuracy_before_rl")
        self.say(f"resuming from {self.resume_from}: step {self.step}, policy version {self.version}")
        return extra

    def _open_records(self) -> None:
        """Opens metrics, timeline and failure logs (trimmed to the checkpoint's step when resuming)."""
        self.records = RunRecords(self.cfg, self.run_dir, self.step if self._resumed else None,
                                  self._resumed.get("clock_epoch"), self.say)
        self.clock, self.timeline, self.metrics = self.records.clock, self.records.timeline, self.records.metrics
        self.colo.attach(self._phase)
        self.nvml = None
        if self.cfg.logging.nvml_sample_hz > 0 and _cluster_gpus() > 0:
            from megatron_sortedrl.telemetry.nodes import NodeSamplers

            self.nvml = NodeSamplers.start(self.run_dir, self.clock.epoch, 1.0 / self.cfg.logging.nvml_sample_hz)

    def encode_prompts(self, prompts: list[Prompt]) -> list[Prompt]:
        from megatron_sortedrl.data.prompting import keep_within_limit

        return keep_within_limit(self.encoder, prompts, self._ptok, self.run_dir / "skipped_prompts.jsonl", self.say)

    def _tokens(self, prompt: Prompt) -> list[int]:
        return self._ptok[prompt.prompt_id]

    def new_sample(self, prompt_id: str, epoch: int, index: int) -> Sample:
        p = self.prompts[prompt_id]
        return Sample(prompt_id=prompt_id, index=index, epoch=epoch, prompt_tokens=list(self._tokens(p)),
                      ground_truth=p.ground_truth, meta={"difficulty": p.difficulty, **sample_meta(p)})

    def tool_event(self, event: str, s: Sample) -> None:  # a trajectory's tool wait starts / ends
        self.events.append(self.timeline.record("request", event, self.step, sample_id=s.sample_id,
                                                tokens=s.response_length))

    def _phase(self, name: str, event: str, **fields: Any) -> None:
        self.events.append(self.timeline.record("phase", event, self.step, phase=name, **fields))

    # ------------------------------------------------------------------------------------------ phases

    def warm_start(self) -> dict[str, float]:
        """Supervised steps on worked solutions, then the engines get the warmed-up weights (warmup.py)."""
        from megatron_sortedrl.warmup import warm_start

        self.colo.to_train()
        return warm_start(self)

    def restore_engines(self) -> None:
        """After a resume: the engines get the checkpoint's weights and version, the drafters its whole history."""
        self.colo.hand_off(self.version)
        self.feed.reset_engines()

    def compose_round(self):
        rnd = compose_round(self)  # hands the policy the rewards that arrived while the last step trained
        if rnd is not None:  # the planner's layout for the round, on the engines (a relayout phase if it changed)
            apply_layout(self, rnd, self.layout_row)
            apply_speculation(self, rnd, self.layout_row)  # plain engines for a round without history
            self.colo.to_rollout()  # colocated: engines wake, the trainer's state leaves the devices
        self._phase("rollout", "start", layout=layout_name(*self.pool.layout))
        if rnd is None:  # data used up: close the phase, or it would stretch over the final eval
            self._phase("rollout", "end")
        return rnd

    def _sampling(self, max_tokens: int, greedy: bool = False) -> dict[str, Any]:
        r = self.cfg.rollout
        stops = [self.eos] + (self.agentic.stop_token_ids if self.agentic is not None else [])
        return {"max_tokens": max_tokens, "temperature": 0.0 if greedy else r.temperature, "top_p": r.top_p,
                "top_k": r.top_k, "stop_token_ids": stops}

    def generate(self, rnd):
        """Streams the round (`round_stream.py`): submits, scores completions as they land, lets the policy
        harvest; returns the `Harvest`."""
        harvest = stream_round(self, rnd)
        self.colo.to_train()  # colocated: engines sleep, the trainer's state comes back (the harvest trains after)
        return harvest

    def _score(self, s: Sample) -> None:
        s.response_text = self.tok.decode(s.response_tokens, skip_special_tokens=True)
        self.rewards.submit(s)

    def train(self, batch: list[Sample], flush: bool = False) -> dict[str, float]:
        """The harvest in mini-batches, one optimizer step each (minibatch.py); `flush`: the waiting remainder too."""
        self._phase("train", "start")
        batch, shaping = shape_batch(batch, self.cfg.sampling, self.cfg.rollout.max_response_length)  # overlong
        out = train_update(self.trainer, self.minibatch, batch, flush, self.stream)
        self._phase("train", "end")
        return {**out, **shaping}

    def sync_weights(self) -> dict[str, float]:
        self._phase("sync", "start")
        self.version += 1
        report = self.colo.hand_off(self.version)  # colocated: the engines' weights wake first
        self.minibatch.synced(self.version)
        self.policy.on_update(self.version, self.clock)
        self._phase("sync", "end")
        return {"sync/seconds": report.seconds, "sync/bytes": report.bytes}

    def update_history(self, batch: list[Sample], kind: str = "") -> dict[str, float]:
        """Records this step's responses per prompt, ships the change to every engine's drafter, measures."""
        self._phase("history", "start")
        out = self.feed.end_step(batch, kind)
        if self.agentic is not None:
            self.agentic.observe(batch)
        self._phase("history", "end")
        return out

    def evaluate(self) -> dict[str, float]:
        """Greedy accuracy on the held-out prompts (mean reward); with tools, trajectories through the same turn
        loop as rollouts (agentic/evaluate.py)."""
        from megatron_sortedrl.agentic.evaluate import eval_metrics, generate_eval

        if self.async_loop is not None:  # what runs steps aside (queued again as partials)
            self.async_loop.hold()
        self._phase("eval", "start")
        self.colo.to_rollout()
        out = generate_eval(self, self.eval_prompts)
        self.colo.to_train()
        scored = self.rewards.score(out)
        self._phase("eval", "end")
        return eval_metrics(scored, with_tools=self.agentic is not None)

    def checkpoint(self) -> str:
        """Atomic checkpoint of everything `_load_resume_state` restores; keeps the newest `keep_last`."""
        from megatron_sortedrl.trainer.checkpoint import complete_checkpoints

        self._phase("checkpoint", "start")
        hand_over_rewards(self, wait=True)  # samples still being scored belong to the policy's saved state
        path = self.trainer.save_checkpoint(self.ckpt_root / f"iter_{self.step:07d}", extra={
            "step": self.step, "version": self.version, "scheduler": self.policy.state_dict(),
            "histospec": self.history.state_dict(), "minibatch": self.minibatch.state_dict(),
            "rng": random.getstate(), "clock_epoch": self.clock.epoch,
            "reward_stats": dict(self.rewards.stats), "reward_stage": self.rewards.state_dict(),
            "accuracy_before_rl": self.accuracy_before})
        self._saved_step = self.step
        for old in complete_checkpoints(self.ckpt_root)[: -self.cfg.checkpoint.keep_last]:
            shutil.rmtree(old, ignore_errors=True)
        self._phase("checkpoint", "end")
        return path

    def log(self, step_s: float, batch: list[Sample], harvest_stats: dict, *parts: dict) -> dict[str, Any]:
        return self.records.log_step(self.step, self.version, step_s, batch, harvest_stats, self.events, self.rewards,
                                     *parts)

    # ------------------------------------------------------------------------------------------ the loop

    def rl_step(self) -> StepResult | None:
        """One step of the loop the config picks: the asynchronous one (`async_loop.py`) or the synchronous one."""
        if self.async_loop is None:
            return self.sync_step()
        out = self.async_loop.rl_step()
        return StepResult(self.step, *out) if out is not None else None

    def sync_step(self) -> StepResult | None:
        t0 = time.monotonic()
        self.events = []  # the bubble ratio of a step needs only that step's events
        self.layout_row = {}
        rnd = self.compose_round()
        harvest = self.generate(rnd) if rnd is not None else None
        while harvest is not None and harvest.stats.get("more"):  # dynamic sampling: another round before training
            harvest = self.generate(self.compose_round())
        batch, stats = (harvest.batch, harvest.stats) if harvest is not None else ([], {})
        if not batch and not self.minibatch.pending:  # data used up (the filter may have dropped all that was left)
            return None
        # the last step, or data used up with a remainder waiting: the remainder trains now
        train = self.train(batch, flush=not batch or self.step >= self.cfg.trainer.total_steps)
        sync = self.sync_weights() if train["optimizer_steps"] else {}  # no step: the engines' weights are current
        spec = self.update_history(batch, rnd.kind) if batch else {}
        step_s = time.monotonic() - t0
        row = self.log(step_s, batch, stats, {f"train/{k}": v for k, v in train.items()}, sync, spec,
                       self.rewards.step_metrics(batch, step_s), stats.get("sampling", {}), self.layout_row,
                       step_metrics(batch) if self.agentic is not None else {}, self.colo.step_row())
        return StepResult(self.step, row, batch)

    def run(self, on_step: Callable[[StepResult], None] | None = None) -> dict[str, Any]:
        cfg = self.cfg
        t_start = time.monotonic()
        start_step = self.step
        restore = catch_stop_signals(self._on_stop_signal)
        try:
            if self._resumed:
                self.restore_engines()
            else:
                self.warm_start()
                ev = self.evaluate()
                self.accuracy_before = ev["eval/accuracy"]
                self.say(f"accuracy after warm-up (before RL): {self.accuracy_before:.3f}")
                self.metrics.log(0, ev)
            exhausted = False
            while self.step < cfg.trainer.total_steps and not self.stop_signal:
                self.step += 1
                result = self.rl_step()
                if result is None:
                    self.step -= 1
                    exhausted = True
                    self.say("data exhausted: every prompt of data.num_epochs has been trained")
                    break
                if on_step:
                    on_step(result)
                last = self.step == cfg.trainer.total_steps
                if cfg.trainer.eval_interval and self.step % cfg.trainer.eval_interval == 0 and not last:
                    ev = self.evaluate()
                    self.metrics.log(self.step, ev)
                    self.say(f"step {self.step}: eval accuracy {ev['eval/accuracy']:.3f}")
                if cfg.checkpoint.save_interval and self.step % cfg.checkpoint.save_interval == 0:
                    self.checkpoint()
            if self.stop_signal:
                if self._saved_step != self.step:
                    self.checkpoint()
                self.say(f"{self.stop_signal}: stopped after step {self.step} with a checkpoint in {self.ckpt_root}; "
                         "run the same command again to resume")
                summary = self._summary(t_start, start_step, None, interrupted=self.stop_signal)
            else:
                ev = self.evaluate()
                after = ev["eval/accuracy"]
                self.metrics.log(self.step, ev)
                if self._saved_step != self.step:
                    self.checkpoint()
                summary = self._summary(t_start, start_step, after, data_exhausted=exhausted)
                before = self.accuracy_before if self.accuracy_before is not None else float("nan")
                self.say(f"done: {self.step} RL steps ({self.step - start_step} in this run, "
                         f"{summary['wall_s']:.0f}s); eval accuracy {before:.3f} -> {after:.3f}; run dir {self.run_dir}")
                self.say(self.feed.describe()) if self.feed.describe() else None
        finally:
            restore()
        self.write_report()
        return summary

    def _summary(self, t_start: float, start_step: int, after: float | None, **extra: Any) -> dict[str, Any]:
        return self.records.write_summary({
            "steps": self.step, "steps_this_run": self.step - start_step, "policy_version": self.version,
            "accuracy_before_rl": self.accuracy_before, "accuracy_after_rl": after,
            "wall_s": time.monotonic() - t_start, "resumed_from": str(self.resume_from or ""),
            "reward_errors": self.rewards.stats["errors"], "reward_timeouts": self.rewards.stats["timeouts"],
            **self.feed.summary(), **extra})

    def write_report(self) -> Path | None:
        return self.records.write_report()

    def _on_stop_signal(self, name: str) -> None:
        self.stop_signal = name
        self.say(f"{name} received: finishing step {self.step}, then checkpointing")

    def close(self) -> None:
        import ray

        closers = [self.rewards.close, self.pool.shutdown, self.trainer.shutdown, *self.records.closers()]
        closers += [self.async_loop.close] if getattr(self, "async_loop", None) is not None else []
        closers += [self.agentic.close] if getattr(self, "agentic", None) is not None else []
        if self.nvml is not None:
            closers.insert(0, self.nvml.stop)
        for closer in closers:
            try:
                closer()
            except Exception as exc:  # keep closing the rest; a half-closed run must not leak processes
                self.say(f"warning: {closer.__qualname__} failed: {exc}")
        if self.owns_ray and ray.is_initialized():
            ray.shutdown()
        self.lifetime.close(end_rest=True)  # what the closers above missed ends too; then the watchdog goes


def _cluster_gpus() -> float:
    import ray

    return float(ray.cluster_resources().get("GPU", 0)) if ray.is_initialized() else 0.0
