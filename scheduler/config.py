"""Configuration of the two-tier scheduler (one section of the run config, `scheduler.*`).

Kept beside the scheduler so the package stays importable on its own; `megatron_sortedrl.config`
composes it into the run schema. Validation errors name the dotted key, the value and what is allowed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_sortedrl.errors import ConfigError

POLICIES = ("sync", "sorted", "tail", "twotier", "async")
ADMISSIONS = ("length", "data")
MODES = ("on_policy", "partial")
PREDICTORS = ("prev_max", "prev_mean", "quantile")
PLACEMENTS = ("round_robin", "lpt")
LAYOUT_PLANNERS = ("fixed", "preemption", "cost_model")


@dataclass
class SchedulerConfig:
    policy: str = field(default="twotier", metadata={"help": "Tier-1 policy: sync | sorted | tail | twotier | async (rollout and training overlap under "
                                                                   "staleness_bound; docs/scheduler.md, \"Asynchronous\").", "choices": POLICIES})
    mode: str = field(
        default="partial",
        metadata={"help": "on_policy: abort and regenerate unfinished samples; partial: cache and resume them.", "choices": MODES},
    )
    rollout_batch_size: int = field(default=16, metadata={"help": "Prompts per rollout round (x n samples each).", "min": 1})
    update_batch_size: int = field(default=32, metadata={"help": "Samples per optimizer update (harvest size).", "min": 1})
    group_size: int = field(
        default=32, metadata={"help": "sorted: prompts per group (no new prompt loads before the group is consumed); twotier: prompts in flight at once.", "min": 1}
    )
    max_staleness: int = field(
        default=1, metadata={"help": "partial mode: drop cached samples older than this many policy versions.", "min": 0}
    )
    oversubscription: float = field(
        default=1.25, metadata={"help": "tail: eta, the over-provisioning factor for prompts and responses of short rounds.", "min": 1.0}
    )
    long_round_threshold: float = field(
        default=0.75,
        metadata={"help": "tail: prompts whose history predicts longer than this fraction of max_response_length are deferred to long rounds.", "gt": 0, "max": 1},
    )
    predictor: str = field(default="prev_max", metadata={"help": "Length predictor: prev_max | prev_mean | quantile.", "choices": PREDICTORS})
    predictor_quantile: float = field(default=0.9, metadata={"help": "Quantile used when predictor=quantile.", "gt": 0, "max": 1})
    history_max_prompts: int = field(
        default=1_000_000, metadata={"help": "Bound on prompts kept in the length history (least recently seen evicted).", "min": 1}
    )
    placement: str = field(default="lpt", metadata={"help": "Tier-2 placement: round_robin | lpt (longest predicted first).", "choices": PLACEMENTS})
    layout_planner: str = field(
        default="fixed", metadata={"help": "Engine layout per round: fixed | preemption (RollPacker; `simulate` only) | cost_model (scheduler/sim/layout_driver.py).", "choices": LAYOUT_PLANNERS}
    )
    layout_cost_model: str = field(
        default="", metadata={"help": "cost_model in `train`: a simulator YAML whose engine: section models the run's engines."}
    )
    staleness_bound: int = field(
        default=2, metadata={"help": "async: the most optimizer steps between the weights that sampled a trained sample's "
                                     "oldest token and its step; prompts are admitted only within it and nothing is "
                                     "discarded (scheduler/asynchronous.py; also the `async` rows of `simulate`).",
                             "min": 0}
    )
    weight_update_interval: int = field(
        default=1, metadata={"help": "async: optimizer steps between in-flight weight pushes to the engines; at most "
                                     "staleness_bound + 1.", "min": 1}
    )
    admission: str = field(
        default="length", metadata={"help": "async: admission order within an epoch: length (the history's longest "
                                            "predicted first, unseen prompts after) | data (data order).",
                                    "choices": ADMISSIONS}
    )
    lookahead: bool = field(
        default=False,
        metadata={"help": "twotier (other policies ignore it), partial mode: an engine that has run out of the round's "
                          "work starts the next round's prompts while the round waits for its tail (trained next round, "
                          "staleness <= 1)."},
    )

    def __post_init__(self) -> None:
        _one_of("scheduler.policy", self.policy, POLICIES)
        _one_of("scheduler.mode", self.mode, MODES)
        _one_of("scheduler.predictor", self.predictor, PREDICTORS)
        _one_of("scheduler.placement", self.placement, PLACEMENTS)
        _one_of("scheduler.admission", self.admission, ADMISSIONS)
        if self.staleness_bound < 0:
            raise ConfigError("scheduler.staleness_bound", self.staleness_bound, "an integer >= 0 (optimizer steps)")
        if self.weight_update_interval < 1 or self.weight_update_interval > self.staleness_bound + 1:
            raise ConfigError("scheduler.weight_update_interval", self.weight_update_interval,
                              f"an integer in [1, staleness_bound + 1 = {self.staleness_bound + 1}] (engines a push "
                              "behind would sample outside the bound)")
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
        if self.lookahead and (self.mode != "partial" or self.max_staleness < 1):
            raise ConfigError("scheduler.lookahead", self.lookahead, "false unless mode=partial and max_staleness >= 1")
        if not 0.0 < self.predictor_quantile <= 1.0:
            raise ConfigError("scheduler.predictor_quantile", self.predictor_quantile, "a float in (0, 1]")


def _one_of(key: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(key, value, "one of " + ", ".join(allowed))


@dataclass
class SamplingConfig:
    """DAPO's rollout-side rules and reward-history skip (`sampling.*`); see docs/selective_rollout.md."""

    dynamic: bool = field(
        default=False,
        metadata={"help": "Dynamic sampling: drop prompt groups whose n rewards are all equal (zero advantage) and keep generating until the update holds `min_informative_groups`."},
    )
    min_informative_groups: int = field(
        default=0,
        metadata={"help": "Informative groups an update needs (0: the policy's own update size in prompts: update_batch_size / n for sorted, rollout_batch_size otherwise).", "min": 0},
    )
    max_extra_rounds: int = field(
        default=4, metadata={"help": "Cap on extra rounds generated per update when too few groups are informative (DAPO's max_num_gen_batches - 1); past it the update trains on what it has.", "min": 0}
    )
    history_skip: bool = field(
        default=False,
        metadata={"help": "Skip prompts whose reward history predicts an uninformative group before they are generated (needs dynamic)."},
    )
    skip_target_uninformative: float = field(
        default=0.25, metadata={"help": "history_skip: the skip probability adapts so that this share of generated groups is uninformative.", "min": 0, "max": 1}
    )
    skip_initial_probability: float = field(default=0.5, metadata={"help": "history_skip: skip probability at the start.", "min": 0, "max": 1})
    skip_adapt_step: float = field(
        default=0.02, metadata={"help": "history_skip: feedback gain per complete group: after each harvested round, every uninformative group of it raises the skip probability by step * (1 - target), every informative one lowers it by step * target.", "min": 0, "max": 1}
    )
    skip_floor: float = field(
        default=0.1, metadata={"help": "history_skip: every prompt is tried with at least this probability (prompts that become informative again come back).", "gt": 0, "max": 1}
    )
    overlong_buffer: int = field(
        default=0, metadata={"help": "DAPO soft overlong penalty: tokens before max_response_length over which the penalty grows linearly to -overlong_penalty (0: off).", "min": 0}
    )
    overlong_penalty: float = field(default=1.0, metadata={"help": "Penalty at max_response_length (DAPO's penalty factor).", "min": 0})
    overlong_filter: bool = field(
        default=False, metadata={"help": "Overlong filtering: responses cut at max_response_length are masked out of the loss."}
    )

    def __post_init__(self) -> None:
        for key in ("min_informative_groups", "max_extra_rounds", "overlong_buffer"):
            if getattr(self, key) < 0:
                raise ConfigError(f"sampling.{key}", getattr(self, key), "an integer >= 0")
        for key in ("skip_target_uninformative", "skip_initial_probability", "skip_adapt_step", "skip_floor"):
            if not 0.0 <= getattr(self, key) <= 1.0:
                raise ConfigError(f"sampling.{key}", getattr(self, key), "a float in [0, 1]")
        if self.skip_floor <= 0.0:
            raise ConfigError("sampling.skip_floor", self.skip_floor, "a float in (0, 1]: a prompt must be able to come back")
        if self.overlong_penalty < 0:
            raise ConfigError("sampling.overlong_penalty", self.overlong_penalty, "a float >= 0")
        if self.history_skip and not self.dynamic:
            raise ConfigError("sampling.history_skip", self.history_skip, "false unless sampling.dynamic=true (the skip learns from the filter's outcomes)")
