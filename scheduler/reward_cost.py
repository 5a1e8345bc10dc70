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

Left out: autoscaling of the workers during a round and history timeouts (the real stage does both; see
`megatron_sortedrl/reward_stage.py` and `benchmarks/reward_stage.py`).
"""

from __future__ import annotations

import heapq
import math
import random
import zlib
from dataclasses import dataclass

from megatron_sortedrl.config import help_field
from megatron_sortedrl.errors import ConfigError


@dataclass
class RewardCostConfig:
    workers: int = help_field("Reward workers scoring in parallel (0: off, use cluster.reward_latency_s).", 0)
    median_s: float = help_field("Median scoring seconds per sample (log-normal).", 0.5)
    sigma: float = help_field("Log-normal sigma of scoring time (heavier tail when larger).", 1.5)
    timeout_s: float = help_field("Scoring time is cut here (a timeout).", 10.0)
    seed: int = help_field("Seed of the scoring-time draws.", 0)

    def __post_init__(self) -> None:
        if self.workers < 0:
            raise ConfigError("reward.workers", self.workers, "an integer >= 0 (0: off)")
        if self.median_s <= 0 or self.sigma < 0 or self.timeout_s <= 0:
            raise ConfigError("reward.median_s", (self.median_s, self.sigma, self.timeout_s),
                              "median_s > 0, sigma >= 0, timeout_s > 0")


class RewardQueue:
    def __init__(self, cfg: RewardCostConfig, latency_s: float) -> None:
        self.cfg, self.latency = cfg, latency_s
        self.free = [0.0] * cfg.workers  # when each worker is next free (a heap)
        self.done: dict[str, float] = {}
        self.timeouts = 0

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
