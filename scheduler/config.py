"""Configuration of the two-tier scheduler (one section of the run config, `scheduler.*`).

Kept beside the scheduler so the package stays importable on its own; `megatron_sortedrl.config`
composes it into the run schema. Validation errors name the dotted key, the value and what is allowed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_sortedrl.errors import ConfigError

POLICIES = ("sync", "sorted", "tail", "twotier")
MODES = ("on_policy", "partial")
PREDICTORS = ("prev_max", "prev_mean", "quantile")
PLACEMENTS = ("round_robin", "lpt")
LAYOUT_PLANNERS = ("fixed", "preemption", "cost_model")


@dataclass
class SchedulerConfig:
    policy: str = field(default="twotier", metadata={"help": "Tier-1 policy: sync | sorted | tail | twotier."})
    mode: str = field(
        default="partial",
        metadata={"help": "on_policy: abort and regenerate unfinished samples; partial: cache and resume them."},
    )
    rollout_batch_size: int = field(default=16, metadata={"help": "Prompts per rollout round (x n samples each)."})
    update_batch_size: int = field(default=32, metadata={"help": "Samples per optimizer update (harvest size)."})
    group_size: int = field(
        default=32, metadata={"help": "sorted: prompts per group (no new prompt loads before the group is consumed); twotier: prompts in flight at once."}
    )
    max_staleness: int = field(
        default=1, metadata={"help": "partial mode: drop cached samples older than this many policy versions."}
    )
    oversubscription: float = field(
        default=1.25, metadata={"help": "tail: eta, the over-provisioning factor for prompts and responses of short rounds."}
    )
    long_round_threshold: float = field(
        default=0.75,
        metadata={"help": "tail: prompts whose history predicts longer than this fraction of max_response_length are deferred to long rounds."},
    )
    predictor: str = field(default="prev_max", metadata={"help": "Length predictor: prev_max | prev_mean | quantile."})
    predictor_quantile: float = field(default=0.9, metadata={"help": "Quantile used when predictor=quantile."})
    history_max_prompts: int = field(
        default=1_000_000, metadata={"help": "Bound on prompts kept in the length history (least recently seen evicted)."}
    )
    placement: str = field(default="lpt", metadata={"help": "Tier-2 placement: round_robin | lpt (longest predicted first)."})
    layout_planner: str = field(
        default="fixed", metadata={"help": "Engine layout per round: fixed | preemption (RollPacker) | cost_model (the last two in `simulate` only; `train` refuses them)."}
    )

    def __post_init__(self) -> None:
        _one_of("scheduler.policy", self.policy, POLICIES)
        _one_of("scheduler.mode", self.mode, MODES)
        _one_of("scheduler.predictor", self.predictor, PREDICTORS)
        _one_of("scheduler.placement", self.placement, PLACEMENTS)
        _one_of("scheduler.layout_planner", self.layout_planner, LAYOUT_PLANNERS)
        for key in ("rollout_batch_size", "update_batch_size", "group_size", "history_max_prompts"):
            if getattr(self, key) < 1:
                raise ConfigError(f"scheduler.{key}", getattr(self, key), "an integer >= 1")
        if self.max_staleness < 0:
            raise ConfigError("scheduler.max_staleness", self.max_staleness, "an integer >= 0")
        if self.oversubscription < 1.0:
            raise ConfigError("scheduler.oversubscription", self.oversubscription, "a float >= 1.0")
        if not 0.0 < self.long_round_threshold <= 1.0:
            raise ConfigError("scheduler.long_round_threshold", self.long_round_threshold, "a float in (0, 1]")
        if not 0.0 < self.predictor_quantile <= 1.0:
            raise ConfigError("scheduler.predictor_quantile", self.predictor_quantile, "a float in (0, 1]")


def _one_of(key: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(key, value, "one of " + ", ".join(allowed))
