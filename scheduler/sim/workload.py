"""Response-length workloads for the simulator: synthetic heavy tails with per-prompt persistence, or
replay of a recorded run.

    from scheduler.sim.workload import make_workload
    w = make_workload(sim.workload, max_response_length=32768)
    w.length("p17", epoch=1, index=3, attempt=0)      # -> tokens this sample generates before EOS

Synthetic model (log-normal, truncated at max_response_length, which then finishes with "length"):

    log L = log(median) + sigma * (sqrt(share) * z[p, e] + sqrt(1 - share) * eps[p, e, i, attempt])
    z[p, 0] ~ N(0, 1),  z[p, e] = rho * z[p, e-1] + sqrt(1 - rho^2) * N(0, 1)     (rho = persistence)

so `share` sets how much of the spread is the prompt's (hard prompts run long for every sample) and
`persistence` how strongly that repeats across epochs (what history-based prediction relies on). A
regenerated sample (new attempt after an on-policy abort) draws a fresh eps. Every draw is seeded by its
coordinates, so all policies see the same lengths. The median-to-max ratio of real long-CoT RL (about
1:25 to 1:32 at 16k-32k) corresponds to median ~ max/32 with sigma around 1.2.

Replay: a run timeline (`finish` events, sample ids "<prompt>/e<epoch>/<index>") or a JSON file
{prompt_id: {epoch: [lengths]}} (read by `replay_lengths.load_lengths` and checked when the scenario loads: a wrong structure is
one line with the file and the JSON path); a regenerated sample takes the next recorded length of that prompt.

Rewards (`reward`, every workload): a per-prompt pass-rate process that persists across epochs and drifts as
the policy learns, DAPO-like. Each prompt has a fixed skill rank u ~ U(0, 1), moved per epoch by
`pass_rate_jitter` * N(0, 1); prompts below the epoch's `unsolved` share never pass, those above
`unsolved + mixed` always pass, and those in between pass with a rate rising from 0.05 to 0.95 across the
band. The shares move linearly from `*_start` to `*_end` over the epochs (more prompts solved, fewer in
between), so with n = 16 about 30% of groups are informative early and 20% late. A sample's reward is a
seeded Bernoulli draw of its prompt's rate, the same for every policy.

Multi-turn trajectories (`workload.turns_max` > 1) are drawn by `scheduler/sim/trajectory_sim.py`; each turn's tokens
come from `turn_length`, the model above with a per-turn eps (the prompt's level is shared by its turns).

Left out: correlation between length and reward, and length drift over training.
"""

from __future__ import annotations

import math
import random

from scheduler.sim.replay_lengths import load_lengths
from scheduler.sim.sim_config import WorkloadConfig


class PassRates:
    """Per-prompt pass rates per epoch (see the module docstring) and the seeded 0/1 reward of each sample."""

    def __init__(self, cfg: WorkloadConfig) -> None:
        self.cfg = cfg
        self._rate: dict[tuple[str, int], float] = {}

    def shares(self, epoch: int) -> tuple[float, float]:
        """(unsolved, mixed) shares of the prompts in `epoch`."""
        c = self.cfg
        f = min(1.0, epoch / max(1, c.num_epochs - 1))
        unsolved = c.unsolved_share_start + f * (c.unsolved_share_end - c.unsolved_share_start)
        mixed = c.mixed_share_start + f * (c.mixed_share_end - c.mixed_share_start)
        return unsolved, mixed

    def rate(self, prompt_id: str, epoch: int) -> float:
        key = (prompt_id, epoch)
        if key not in self._rate:
            c = self.cfg
            u = random.Random(f"{c.seed}:skill:{prompt_id}").random()
            u += c.pass_rate_jitter * random.Random(f"{c.seed}:skill:{prompt_id}:{epoch}").gauss(0.0, 1.0)
            lo, mixed = self.shares(epoch)
            if u <= lo:
                rate = 0.0
            elif u >= lo + mixed:
                rate = 1.0
            else:
                rate = 0.05 + 0.9 * (u - lo) / mixed
            self._rate[key] = rate
        return self._rate[key]

    def reward(self, prompt_id: str, epoch: int, index: int) -> float:
        draw = random.Random(f"{self.cfg.seed}:reward:{prompt_id}:{epoch}:{index}").random()
        return 1.0 if draw < self.rate(prompt_id, epoch) else 0.0


class SyntheticWorkload:
    def __init__(self, cfg: WorkloadConfig, max_response_length: int) -> None:
        self.cfg, self.max_len = cfg, max_response_length
        self._z: dict[tuple[str, int], float] = {}
        self.prompt_ids = [f"p{i}" for i in range(cfg.num_prompts)]
        self.pass_rates = PassRates(cfg)
        self.reward = self.pass_rates.reward

    def _level(self, prompt_id: str, epoch: int) -> float:
        key = (prompt_id, epoch)
        if key not in self._z:
            rng = random.Random(f"{self.cfg.seed}:z:{prompt_id}:{epoch}")
            fresh = rng.gauss(0.0, 1.0)
            if epoch == 0:
                self._z[key] = fresh
            else:
                rho = self.cfg.persistence
                self._z[key] = rho * self._level(prompt_id, epoch - 1) + math.sqrt(1 - rho * rho) * fresh
        return self._z[key]

    def length(self, prompt_id: str, epoch: int, index: int, attempt: int = 0) -> int:
        return self.turn_length(prompt_id, epoch, index, attempt, 0)

    def turn_length(self, prompt_id: str, epoch: int, index: int, attempt: int, turn: int) -> int:
        """Tokens of assistant turn `turn` of a trajectory (turn 0 is `length`: single-turn samples are unchanged)."""
        workload = self.cfg
        key = f"{workload.seed}:eps:{prompt_id}:{epoch}:{index}:{attempt}" + (f":t{turn}" if turn else "")
        eps = random.Random(key).gauss(0.0, 1.0)
        log_len = math.log(workload.median_response) + workload.sigma * (
            math.sqrt(workload.prompt_share) * self._level(prompt_id, epoch)
            + math.sqrt(1 - workload.prompt_share) * eps)
        return int(min(self.max_len, max(workload.min_response, round(math.exp(log_len)))))

    def prompt_tokens(self, prompt_id: str) -> int:
        rng = random.Random(f"{self.cfg.seed}:prompt:{prompt_id}")
        return max(1, int(self.cfg.prompt_tokens * rng.uniform(0.5, 1.5)))


class ReplayWorkload:
    def __init__(self, cfg: WorkloadConfig, max_response_length: int) -> None:
        self.cfg, self.max_len = cfg, max_response_length
        self.table = load_lengths(cfg.replay_path)
        self.prompt_ids = sorted(self.table)
        self.pass_rates = PassRates(cfg)
        self.reward = self.pass_rates.reward

    def length(self, prompt_id: str, epoch: int, index: int, attempt: int = 0) -> int:
        per_epoch = self.table[prompt_id]
        epochs = sorted(per_epoch)
        lengths = per_epoch[epochs[epoch % len(epochs)]]
        return int(min(self.max_len, max(1, lengths[(index + attempt * 7) % len(lengths)])))

    def prompt_tokens(self, prompt_id: str) -> int:
        return self.cfg.prompt_tokens


# A lengths file: {prompt_id: {epoch: [response lengths in tokens]}}, epochs written as JSON keys ("0", "1").
def make_workload(cfg: WorkloadConfig, max_response_length: int) -> SyntheticWorkload | ReplayWorkload:
    return (SyntheticWorkload if cfg.kind == "synthetic" else ReplayWorkload)(cfg, max_response_length)
