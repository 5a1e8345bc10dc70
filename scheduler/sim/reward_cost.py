"""Reward cost in the simulator: heavy-tailed scoring time per sample on a number of reward workers.

    reward:                 # a section of configs/sim_*.yaml
      workers: 4            # 0: off, a finished sample's reward arrives cluster.reward_latency_s later (as before)
      median_s: 0.5         # log-normal scoring time per sample (code tests are heavy-tailed)
      sigma: 1.5
      timeout_s: 10.0       # a draw past this is cut here and counted as a timeout

`RewardQueue` is a first-come first-served multi-server queue: a sample finishing at t starts scoring on the
first worker free at or after t and its reward reaches the policy `latency + cost` later, so the simulator
shows when scoring, not generation, ends a round (`reward_critical_s` of each round: the last reward of the
trained batch minus the last generation finish among it) and what more workers buy. Costs are drawn per
sample id with a fixed seed, so two policies see the same costs.

Autoscaling (`max_workers` > `workers`), as the real stage's `Autoscaler`: when a sample arrives and would
wait longer than `target_drain_s` for a free worker, one more worker is started (free `start_s` later,
its start-up), up to `max_workers`; a worker idle for `idle_s` is given back, down to `workers`. Each round
reports the workers it ended with and the most it used (`reward_workers`, `reward_workers_max`), and
`worker_seconds` counts what the workers cost (alive time, idle included).

Left out: history timeouts (the real stage learns them per prompt; see `megatron_sortedrl/reward_stage.py`
and `benchmarks/reward_stage.py`); here every draw is cut at `timeout_s`.
"""

from __future__ import annotations

import heapq
import math
import random
import zlib
from dataclasses import dataclass

from megatron_sortedrl.schema import help_field
from megatron_sortedrl.errors import ConfigError


@dataclass
class RewardCostConfig:
    workers: int = help_field("Reward workers scoring in parallel (0: off, use cluster.reward_latency_s).", 0, min=0)
    median_s: float = help_field("Median scoring seconds per sample (log-normal).", 0.5, gt=0)
    sigma: float = help_field("Log-normal sigma of scoring time (heavier tail when larger).", 1.5, min=0)
    timeout_s: float = help_field("Scoring time is cut here (a timeout).", 10.0, gt=0)
    seed: int = help_field("Seed of the scoring-time draws.", 0, min=0)
    max_workers: int = help_field("Autoscaling: most workers (0 or <= workers: a fixed pool of `workers`).", 0, min=0)
    target_drain_s: float = help_field("Autoscaling: start a worker when a sample would wait longer than this.", 1.0, min=0)
    start_s: float = help_field("Autoscaling: seconds from starting a worker to its first sample.", 2.0, min=0)
    idle_s: float = help_field("Autoscaling: give a worker back after this long idle.", 10.0, min=0)

    def __post_init__(self) -> None:
        if self.workers < 0:
            raise ConfigError("reward.workers", self.workers, "an integer >= 0 (0: off)")
        if self.median_s <= 0 or self.sigma < 0 or self.timeout_s <= 0:
            raise ConfigError("reward.median_s", (self.median_s, self.sigma, self.timeout_s),
                              "median_s > 0, sigma >= 0, timeout_s > 0")
        if self.max_workers < 0 or self.target_drain_s < 0 or self.start_s < 0 or self.idle_s < 0:
            raise ConfigError("reward.max_workers", (self.max_workers, self.target_drain_s, self.start_s, self.idle_s),
                              "max_workers, target_drain_s, start_s and idle_s >= 0")

    @property
    def autoscale(self) -> bool:
        return self.workers > 0 and self.max_workers > self.workers


class RewardQueue:
    def __init__(self, cfg: RewardCostConfig, latency_s: float) -> None:
        self.cfg, self.latency = cfg, latency_s
        self.free = [0.0] * cfg.workers  # when each worker is next free (a heap)
        self.born = [0.0] * cfg.workers  # start time of each live worker (for worker_seconds)
        self.retired_s = 0.0  # alive time of workers already given back
        self.size_max = cfg.workers
        self.done: dict[str, float] = {}
        self.timeouts = 0

    @property
    def size(self) -> int:
        return len(self.free)

    def worker_seconds(self, t: float) -> float:
        """Seconds of worker time paid up to `t` (alive, busy or idle)."""
        return self.retired_s + sum(max(0.0, t - b) for b in self.born)

    def _scale(self, t: float) -> None:
        cfg = self.cfg
        # Give back workers idle for idle_s (their free time is that long past), never below `workers`.
        # It left at free + idle_s (between two arrivals, e.g. while the step trained), not now.
        while len(self.free) > cfg.workers and self.free[0] + cfg.idle_s <= t:
            gone = heapq.heappop(self.free) + cfg.idle_s
            # Workers are not tracked one by one: the sum of lifetimes is the same whichever birth goes.
            b = self.born.pop(self.born.index(min(self.born)))
            self.retired_s += max(0.0, gone - b)
        # Start one when this sample would wait longer than the target (the backlog outruns the workers).
        if self.free[0] - t > cfg.target_drain_s and len(self.free) < cfg.max_workers:
            heapq.heappush(self.free, t + cfg.start_s)
            self.born.append(t)
            self.size_max = max(self.size_max, len(self.free))

    def cost(self, sample_id: str) -> float:
        rng = random.Random(zlib.crc32(sample_id.encode()) ^ self.cfg.seed)
        draw = self.cfg.median_s * math.exp(self.cfg.sigma * rng.gauss(0.0, 1.0))
        return min(draw, self.cfg.timeout_s)

    def arrival(self, t: float, sample_id: str) -> float:
        """When the reward of a sample whose generation finished at `t` reaches the policy."""
        if not self.free:
            done = t + self.latency
        else:
            c = self.cost(sample_id)
            self.timeouts += c >= self.cfg.timeout_s
            if self.cfg.autoscale:
                self._scale(t)
            start = max(t, heapq.heappop(self.free))
            heapq.heappush(self.free, start + c)
            done = start + c + self.latency
        self.done[sample_id] = done
        return done

    def critical_path(self, batch: list, t0: float, t1: float) -> float:
        """Last reward arrival of the batch minus its last generation finish, within the round [t0, t1]
        (a batch of samples finished and scored in earlier rounds costs this round nothing)."""
        got = [self.done[s.sample_id] for s in batch if s.sample_id in self.done]
        gen = [s.finish_time for s in batch]
        return max(0.0, min(max(got), t1) - max(max(gen), t0)) if got and gen else 0.0
