"""DAPO's rollout-side rules for every scheduling policy: dynamic sampling (drop prompt groups whose rewards are
all equal, keep generating until the update holds enough informative groups), selective rollout from the
per-prompt reward history (skip prompts predicted uninformative before they are generated), and overlong
reward shaping's settings (the shaping itself, a loss-side rule, is `megatron_sortedrl/shaping.py`). Configured by `sampling.*` (`scheduler.config.SamplingConfig`); docs/selective_rollout.md.

    from scheduler.policies import make_policy
    policy = make_policy(cfg.scheduler, prompt_ids, sampling=cfg.sampling, n_samples=16, ...)  # wrapped here
    pytest tests/test_selective.py

`SelectivePolicy` wraps any tier-1 policy and speaks the same protocol (`scheduler/protocol.py`), so the real
driver and the simulator run it unchanged but for one rule: a harvest whose `stats["more"]` is true trains
nothing; the caller composes and generates another round (same policy version) before training:

- *Filter.* As soon as a prompt's group is complete (its first n responses scored), a group whose rewards are
  all equal leaves the live set (`PolicyBase.drop`): it never reaches the trainer, its running surplus is
  aborted, it counts as consumed for its epoch (`filtered`). A harvest therefore only ever takes complete
  informative groups (short-first), and a prompt deferred to a long round is filtered there like any other.
  A final exact check runs on every harvested batch too.
- *Accumulate.* Harvested informative groups collect in `pending`; the update trains once it holds
  `min_informative_groups` (default: the policy's own update size in prompts), or after `max_extra_rounds`
  extra rounds (one log line, and the step trains on what it has, if that is at least one group), or when the
  data is used up (an empty final harvest: the caller ends the run). Groups,
  staleness and exactly-n rules hold: the version does not move between the rounds of one update.
- *Skip.* The wrapped policy's data cursor is replaced by one that asks `SkipGate` about every prompt it
  yields: a prompt whose last `k >= 1` groups were uninformative (reward streak, `scheduler/history.py`) is
  tried with probability `max(floor, (1 - p) ** k)` and otherwise skipped (counted, consumed for its epoch).
  `p` adapts after each harvested round, by a step per complete group, so that the share of uninformative
  generated groups approaches the target (GRESO, arXiv 2506.02177, uses the same feedback, per training step).
  Each draw is seeded by (seed, prompt, epoch), so the
  decisions are deterministic under the seed and independent of event order.
- *Shaping* is not done here: DAPO's soft overlong penalty and overlong filtering change the loss, so they sit
  beside it (`megatron_sortedrl/shaping.py`, `shape_batch`, applied by the driver to the trained batch). The
  filter above judges the task reward, as DAPO's `filter_groups.metric=acc` does.

Every prompt of every epoch ends up `trained`, `filtered` or `skipped` (`consumed`, per epoch); per update the
harvest carries `stats["sampling"]` metrics (`sampling/*`), which the driver logs and the run report draws.

Written here rather than taken from verl: verl's filter lives in its trainer loop and regenerates whole
batches; ours plugs into the length-aware policies, which already stream groups as they complete.
Left out: GRESO's separate easy/hard skip probabilities (one adaptive probability, scaled by the streak).
"""

from __future__ import annotations

import logging
import random
from collections import Counter
from typing import Any

from megatron_sortedrl.sample import Sample
from scheduler.base import DataCursor, PolicyBase, PromptState, prompt_key
from scheduler.config import SamplingConfig
from scheduler.protocol import Clock, Harvest, Round

log = logging.getLogger(__name__)
OUTCOMES = ("trained", "filtered", "skipped")


def informative(rewards: list[float]) -> bool:
    """A group teaches something only if its rewards differ (else every group-relative advantage is zero)."""
    return len(set(rewards)) > 1


class SkipGate:
    """Decides, per prompt instance, whether to generate it; adapts the skip probability to a target share."""

    def __init__(self, cfg: SamplingConfig, history: Any, seed: int) -> None:
        self.cfg, self.history, self.seed = cfg, history, seed
        self.p = cfg.skip_initial_probability if cfg.history_skip else 0.0

    def try_probability(self, prompt_id: str) -> float:
        return self.probability(self.history.reward_streak(prompt_id))

    def probability(self, streak: int) -> float:
        """Chance of generating a prompt whose last `streak` groups were uninformative."""
        if not self.cfg.history_skip or streak == 0:
            return 1.0
        return max(self.cfg.skip_floor, (1.0 - self.p) ** streak)

    def draw(self, prompt_id: str, epoch: int) -> float:
        """The instance's seeded uniform draw: generated when it is below the try probability."""
        return random.Random(f"{self.seed}:skip:{prompt_id}:{epoch}").random()

    def tried(self, prompt_id: str, epoch: int) -> bool:
        return self.draw(prompt_id, epoch) < self.try_probability(prompt_id)

    def adapt(self, uninformative: int, generated: int) -> None:
        """After every harvested round, summed over its complete groups: each uninformative group raises `p` by
        step * (1 - target), each informative one lowers it by step * target, so `p` rests where the uninformative
        share of generated groups is the target (or at a bound). The gain grows with the groups seen rather than
        being one step per round: a twotier round on a large cluster holds hundreds of prompts and a run only a few
        dozen rounds, while a CPU round holds a handful; summed per round (and bounded once), the result does not
        depend on the order in which the round's groups completed (filtered ones complete early, informative ones
        are counted at harvest)."""
        if not self.cfg.history_skip or generated == 0:
            return
        step, target = self.cfg.skip_adapt_step, self.cfg.skip_target_uninformative
        self.p = min(1.0 - self.cfg.skip_floor, max(0.0, self.p + step * (uninformative - target * generated)))


class SkippingCursor:
    """The wrapped policy's `DataCursor`, yielding only prompts the gate lets through (same interface)."""

    def __init__(self, inner: DataCursor, owner: SelectivePolicy) -> None:
        self.inner, self.owner = inner, owner

    @property
    def exhausted(self) -> bool:
        return self.inner.exhausted

    @property
    def epoch(self) -> int:
        return self.inner.epoch

    def take(self, k: int) -> list[tuple[str, int]]:
        out: list[tuple[str, int]] = []
        while len(out) < k and not self.inner.exhausted:
            for pid, epoch in self.inner.take(k - len(out)):
                if self.owner.gate.tried(pid, epoch):
                    out.append((pid, epoch))
                    self.owner.predicted[prompt_key(pid, epoch)] = self.owner.gate.history.reward_streak(pid) == 0
                else:
                    self.owner.account(prompt_key(pid, epoch), "skipped")
        return out

    def state_dict(self) -> dict[str, int]:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.inner.load_state_dict(state)


class SelectivePolicy:
    """Dynamic sampling (and history skip) around a tier-1 policy; see the module docstring."""

    def __init__(self, inner: PolicyBase, cfg: SamplingConfig, seed: int = 0) -> None:
        self.inner, self.cfg = inner, cfg
        self.name = inner.name
        self.gate = SkipGate(cfg, inner.history, seed)
        inner.cursor = SkippingCursor(inner.cursor, self)  # type: ignore[assignment]
        need = max(1, inner.cfg.update_batch_size // inner.n) if inner.name == "sorted" else inner.cfg.rollout_batch_size
        self.target = cfg.min_informative_groups or need
        self.pending: list[Sample] = []  # informative groups harvested this update, not trained yet
        self.extra_rounds = 0  # rounds generated this update beyond the first
        self.flush = False  # the data ran out mid-update: the next (empty) round hands over `pending`
        self.predicted: dict[str, bool] = {}  # live prompt key -> predicted informative when it was let through
        self.consumed: dict[int, Counter] = {}  # epoch -> outcome -> prompts
        self.step_counts: Counter = Counter()  # this update's outcomes and prediction hits
        self.round_counts: Counter = Counter()  # outcomes since the last harvested round (the skip's feedback)
        self.step_tokens = Counter()  # generated / trained response tokens this update
        self._wasted_seen = 0
        self.totals: Counter = Counter()  # whole run: outcomes, tokens
        inner.stats["sampling"] = self.totals

    def __getattr__(self, name: str) -> Any:  # everything else (version, stats, live, history, ...) is the policy's
        return getattr(self.inner, name)

    # -- accounting ---------------------------------------------------------------------------------------

    def account(self, key: str, outcome: str, rewards: list[float] | None = None) -> None:
        """Every prompt instance passes here exactly once: trained, filtered or skipped."""
        epoch = int(key.rsplit("/e", 1)[1])
        self.consumed.setdefault(epoch, Counter())[outcome] += 1
        self.step_counts[outcome] += 1
        self.round_counts[outcome] += 1
        self.totals[outcome] += 1
        if rewards is not None:
            pid = key.rsplit("/e", 1)[0]
            self.inner.history.record_rewards(pid, epoch, rewards)
            predicted = self.predicted.pop(key, True)
            actual = informative(rewards)
            self.step_counts["predicted_informative"] += predicted
            self.step_counts["actual_informative"] += actual
            self.step_counts["prediction_correct"] += predicted == actual

    def _group_rewards(self, st: PromptState) -> list[float]:
        return [float(s.reward or 0.0) for s in st.finished_samples()[: self.inner.n]]

    # -- protocol -----------------------------------------------------------------------------------------

    def compose_round(self, clock: Clock) -> Round | None:
        rnd = self.inner.compose_round(clock)
        if rnd is None and (self.pending or self.extra_rounds):  # data used up mid-update: an empty round ends it
            self.flush = True
            layout = self.inner.round.layout if self.inner.round else self.inner.planner.plan("sync", [], 0)
            rnd = Round(index=self.inner.round_index, kind="sync", version=self.inner.version, layout=layout)
        return rnd

    def on_sample_finished(self, sample: Sample, clock: Clock) -> list[str]:
        abort = list(self.inner.on_sample_finished(sample, clock))
        key = self.inner.by_sample.get(sample.sample_id)
        st = self.inner.live.get(key) if key else None
        if st is not None and self.inner.complete(st, self.inner.n):
            rewards = self._group_rewards(st)
            if not informative(rewards):
                self.step_tokens["filtered"] += sum(s.response_length for s in st.samples)
                abort = sorted(set(abort) | set(self.inner.drop(st)))  # (its surplus: counted when handed back)
                self.account(st.key, "filtered", rewards)
                abort += self._decide_again(st.prompt_id, st.epoch)
        return abort

    def _decide_again(self, prompt_id: str, epoch: int) -> list[str]:
        """Late binding of the skip. A later instance of `prompt_id` that was let through before this group
        completed (a window holding most of the dataset, or a lookahead, starts the next epoch's instances of
        prompts still running) was decided on older history. With the streak this group just extended, the same
        seeded draw decides it again: if it now says skip and none of the instance's responses has finished, the
        instance leaves the live set, counted as skipped. The ids returned are aborted; whatever it had generated
        counts as wasted (`generated_tokens`). A skip is never undone, so the outcome is the decision on the
        freshest history available before the group was generated, or a skip on older history.
        Measured in the 32B simulation (docs/benchmarks/selective_rollout_sim.md): without it, a third of the
        first epoch after the start and most later decisions read a history one to four epochs old."""
        if not self.cfg.history_skip:
            return []
        abort: list[str] = []
        for later in range(epoch + 1, self.inner.cursor.epoch + 1):
            st = self.inner.live.get(prompt_key(prompt_id, later))
            if st is None or st.n_finished or self.gate.tried(prompt_id, later):
                continue
            # what it holds is waste now (carried partials); what its running responses add, when handed back
            self.inner.stats["wasted_tokens"] += sum(s.response_length for s in st.samples)
            abort += self.inner.drop(st)
            self.predicted.pop(st.key, None)
            self.account(st.key, "skipped")
            self.step_counts["skipped_late"] += 1
            self.totals["skipped_late"] += 1
        return abort

    def on_sample_aborted(self, sample: Sample, clock: Clock) -> None:
        self.inner.on_sample_aborted(sample, clock)

    def harvest(self, clock: Clock) -> Harvest | None:
        if self.flush:
            self.flush = False
            return self._train([], {})
        h = self.inner.harvest(clock)
        if h is None:
            return None
        groups: dict[str, list[Sample]] = {}
        for s in h.batch:
            groups.setdefault(prompt_key(s.prompt_id, s.epoch), []).append(s)
        for key, samples in groups.items():
            rewards = [float(s.reward or 0.0) for s in samples]
            self.account(key, "trained" if informative(rewards) else "filtered", rewards)
            if informative(rewards):  # the exact check: an all-equal group never reaches the trainer
                self.pending.extend(samples)
            else:
                self.step_tokens["filtered"] += sum(s.response_length for s in samples)
        self.gate.adapt(self.round_counts["filtered"], self.round_counts["filtered"] + self.round_counts["trained"])
        self.round_counts = Counter()
        have = len({prompt_key(s.prompt_id, s.epoch) for s in self.pending})
        data_left = bool(self.inner.live) or not self.inner.cursor.exhausted
        if have >= self.target or not data_left:
            return self._train(h.abort, h.stats)
        if self.extra_rounds >= self.cfg.max_extra_rounds and have:  # an update needs one group to train at all
            log.warning("dynamic sampling: %d of %d informative groups after %d extra rounds "
                        "(sampling.max_extra_rounds); training on what there is", have, self.target, self.extra_rounds)
            self.step_counts["cap_hit"] += 1
            return self._train(h.abort, h.stats)
        self.extra_rounds += 1
        return Harvest(batch=[], abort=h.abort, stats={"more": True, "informative_groups": have})

    def _train(self, abort: list[str], stats: dict[str, Any]) -> Harvest:
        batch = sorted(self.pending, key=lambda s: s.response_length)
        self.pending = []
        c, t = self.step_counts, self.step_tokens
        wasted = self.inner.stats["wasted_tokens"] - self._wasted_seen
        self._wasted_seen = self.inner.stats["wasted_tokens"]
        trained_tokens = sum(s.response_length for s in batch)
        generated = trained_tokens + t["filtered"] + wasted
        groups = c["trained"] + c["filtered"]
        self.totals.update({"generated_tokens": generated, "trained_tokens": trained_tokens})
        metrics = {
            "sampling/trained_groups": c["trained"], "sampling/filtered_groups": c["filtered"],
            "sampling/skipped_prompts": c["skipped"], "sampling/extra_rounds": self.extra_rounds,
            "sampling/skipped_late": c["skipped_late"], "sampling/cap_hit": c["cap_hit"], "sampling/informative_share": c["trained"] / groups if groups else 0.0,
            "sampling/predicted_informative": c["predicted_informative"],
            "sampling/actual_informative": c["actual_informative"],
            "sampling/prediction_accuracy": c["prediction_correct"] / groups if groups else 0.0,
            "sampling/skip_probability": self.gate.p,
            "sampling/generated_tokens": generated, "sampling/trained_tokens": trained_tokens,
            "sampling/generated_per_trained_token": generated / trained_tokens if trained_tokens else 0.0,
        }
        self.step_counts, self.step_tokens, self.extra_rounds = Counter(), Counter(), 0
        staleness = [self.inner.version - s.oldest_version for s in batch]
        return Harvest(batch=batch, abort=abort, stats={**stats, "staleness": staleness, "sampling": metrics})

    def on_update(self, version: int, clock: Clock, preemptions: int = 0) -> None:
        self.inner.on_update(version, clock, preemptions)

    # -- checkpointing (between updates: `pending` is empty then) ---------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {**self.inner.state_dict(), "sampling": {
            "p": self.gate.p, "predicted": dict(self.predicted), "wasted_seen": self._wasted_seen,
            "consumed": {str(e): dict(c) for e, c in self.consumed.items()}, "totals": dict(self.totals)}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state)
        own = state.get("sampling", {})
        self.gate.p = own.get("p", self.gate.p)
        self.predicted = dict(own.get("predicted", {}))
        self._wasted_seen = own.get("wasted_seen", self.inner.stats["wasted_tokens"])
        self.consumed = {int(e): Counter(c) for e, c in own.get("consumed", {}).items()}
        self.totals.clear()
        self.totals.update(own.get("totals", {}))
