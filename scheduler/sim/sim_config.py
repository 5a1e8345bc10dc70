"""Parameters of the cluster simulator, loaded from their own YAML (`configs/sim_*.yaml`).

    from scheduler.sim.sim_config import load_sim_config
    sim, run = load_sim_config("configs/sim_qwen32b_128gpu.yaml", ["workload.persistence=0.5"])

A sim YAML names a run config (`run_config`, default configs/tiny_cpu.yaml) plus `run_overrides`
(key=value, as on the command line) for the run-side settings the scheduler reads (rollout.* and
scheduler.*), and holds the simulator's own sections: `cluster` (GPUs and the costs outside rollout),
`engine` (`EngineCostModel`) and `workload`. Command-line overrides starting with `run.` go to the run
config, the others to this file's sections. The file and overrides load through the run config's schema
(`megatron_sortedrl/schema.py`: every key known, every value of its type and declared range), then each section's
`__post_init__`, the layout (`check_layout`, `check_engines`) and a replay file's structure; every error is one
line naming the dotted key and ending with the scenario file. A run config given in a scenario's place is named
as such. Tests: `python -m pytest tests/test_scenario_schema.py -q`.

Left out: network topology (weight-sync time is one number) and failures.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from megatron_sortedrl.config import RunConfig, help_field, load_config
from megatron_sortedrl.config.run import load_schema
from megatron_sortedrl.errors import ConfigError, UserError
from scheduler.cost_model import EngineCostModel
from scheduler.sim.layout_sim import LayoutCosts, check_layout
from scheduler.sim.speculation_model import SpeculationConfig
from scheduler.sim.reward_cost import RewardCostConfig

WORKLOADS = ("synthetic", "replay")


@dataclass
class ClusterCosts:
    gpus: int = help_field("Rollout GPUs (colocated: the trainer uses the same GPUs between rounds).", 2, min=1)
    gpus_per_node: int = help_field("GPUs per node; a rollout TP group never spans nodes.", 2, min=1)
    train_tokens_per_s: float = help_field("Trainer throughput over prompt+response tokens (log-probs + update), whole cluster.", 2000.0, gt=0)
    train_fixed_s: float = help_field("Fixed seconds per harvest's train phase (log-prob passes, offload/onload; with "
                                      "optimizer_step_s 0 also the optimizer step).", 1.0, min=0)
    optimizer_step_s: float = help_field(
        "Fixed seconds of each optimizer step: a harvest trained in k mini-batches (run.algorithm.ppo_mini_batch_size) "
        "for e epochs pays it k x e times, besides train_fixed_s once (0: the step is in train_fixed_s).", 0.0, min=0)
    weight_sync_s: float = help_field("Seconds to push new weights to the rollout engines after a step.", 0.5, min=0)
    relayout_s: float = help_field("Seconds to rebuild the engines when the rollout TP changes.", 5.0, min=0)
    reward_latency_s: float = help_field("Seconds from a sample's last token to its reward (scored asynchronously).", 0.05, min=0)
    round_start_s: float = help_field("Seconds from a round's start until its requests reach the engines (composition, "
                                      "placement, submission round trip).", 0.0, min=0)
    engine_slowdown: list[float] = help_field("Per engine, a multiplier of its decode and prefill time (measured engines "
                                              "differ, e.g. on unevenly shared cores); engines past the list run at 1.",
                                              factory=list, gt=0)
    engine_jitter: float = help_field("Round-to-round spread of each engine's speed: per round and engine its decode "
                                      "and prefill time is multiplied by exp(jitter * z - jitter^2 / 2), z standard "
                                      "normal (mean 1; engines on shared cores; 0 = steady engines).", 0.0, min=0)
    stream_training: bool = help_field("Stream training, colocated (scheduler/sim/stream_sim.py): GPUs of engines that have "
                                       "run out of the round's work compute the backward of finished samples the harvest "
                                       "will train, while the tail still generates.", False)
    tail_migration: bool = help_field("Tail migration (scheduler/sim/tail_migration.py): an engine with nothing left to run "
                                      "takes over a running request of the engine running the most (abort there, "
                                      "resubmit with its tokens, re-prefill).", False)
    trainer_gpus: int = help_field("Disaggregated placement (scheduler/sim/stream_sim.py): GPUs of `gpus` kept for the "
                                   "trainer alone (it trains at train_tokens_per_s * trainer_gpus / gpus); the engines "
                                   "get the rest. 0 = colocated.", 0, min=0)

    def __post_init__(self) -> None:
        if self.engine_jitter < 0:
            raise ConfigError("cluster.engine_jitter", self.engine_jitter, "a number >= 0")
        if self.gpus < 1 or self.gpus_per_node < 1:
            raise ConfigError("cluster.gpus", (self.gpus, self.gpus_per_node), "gpus and gpus_per_node >= 1")
        if self.train_tokens_per_s <= 0:
            raise ConfigError("cluster.train_tokens_per_s", self.train_tokens_per_s, "a positive number")
        for key in ("train_fixed_s", "optimizer_step_s", "weight_sync_s", "relayout_s", "reward_latency_s", "round_start_s"):
            if getattr(self, key) < 0:
                raise ConfigError(f"cluster.{key}", getattr(self, key), "a number >= 0")
        # A one-node scenario may give the trainer up to half of its GPUs (scheduler/sim/layout_sim.py).
        if not 0 <= self.trainer_gpus <= self.gpus - min(self.gpus_per_node, self.gpus // 2):
            raise ConfigError("cluster.trainer_gpus", self.trainer_gpus,
                              f"0 (colocated) or a number that leaves the engines at least a node of {self.gpus} GPUs "
                              "(half of them on one node)")
        if any(k <= 0 for k in self.engine_slowdown):
            raise ConfigError("cluster.engine_slowdown", self.engine_slowdown, "positive multipliers")


@dataclass
class ToolKind:
    """One kind of tool a multi-turn workload calls (scheduler/sim/trajectory_sim.py): its latency is log-normal."""

    name: str = help_field("Label in tables (e.g. calculator, python, search).", "tool")
    weight: float = help_field("Relative share of the calls that go to this kind.", 1.0, gt=0)
    median_s: float = help_field("Median latency of one call in seconds.", 1.0, gt=0)
    sigma: float = help_field("Log-normal sigma of the latency (heavier tail when larger).", 1.0, min=0)
    tokens: int = help_field("Mean tokens of the tool message appended to the context (drawn 0.5-1.5x).", 64, min=1)  # type: ignore[assignment]


@dataclass
class WorkloadConfig:
    kind: str = help_field("synthetic (heavy-tailed lengths below) | replay (lengths recorded in `replay_path`).", "synthetic", choices=WORKLOADS)
    replay_path: str = help_field("replay: a run timeline (.jsonl) or a {prompt_id: {epoch: [lengths]}} JSON file.", "")
    num_prompts: int = help_field("Prompts in the dataset.", 64, min=1)
    num_epochs: int = help_field("Passes over the dataset (all policies train the same samples).", 3, min=1)
    prompt_tokens: int = help_field("Mean prompt length in tokens.", 64, min=1)
    median_response: float = help_field("Median response length in tokens.", 24.0, gt=0)
    sigma: float = help_field("Log-normal sigma of response lengths (heavier tail when larger).", 1.0, min=0)
    prompt_share: float = help_field("Fraction of the log-length variance that belongs to the prompt (vs the sample).", 0.6, min=0, max=1)
    persistence: float = help_field("Correlation of a prompt's length level between consecutive epochs (0..1).", 0.8, min=0, max=1)
    min_response: int = help_field("Shortest response in tokens.", 1, min=1)
    seed: int = help_field("Seed of the synthetic lengths.", 0, min=0)
    unsolved_share_start: float = help_field("Rewards: share of prompts never solved in the first epoch.", 0.40, min=0, max=1)
    unsolved_share_end: float = help_field("Rewards: share of prompts never solved in the last epoch.", 0.20, min=0, max=1)
    mixed_share_start: float = help_field("Rewards: share of prompts solved sometimes (informative groups) in the first epoch.", 0.32, min=0, max=1)
    mixed_share_end: float = help_field("Rewards: share of prompts solved sometimes in the last epoch.", 0.21, min=0, max=1)
    pass_rate_jitter: float = help_field("Rewards: per-epoch random move of a prompt's skill rank (0: classes persist exactly).", 0.04, min=0, max=1)
    turns_max: int = help_field("Multi-turn (scheduler/sim/trajectory_sim.py): most assistant turns per trajectory, a tool "
                                "call between two turns; 1 = single-turn samples, no tools.", 1, min=1)  # type: ignore[assignment]
    turns_median: float = help_field("Multi-turn: median assistant turns per trajectory (before the 1..turns_max clamp).", 2.0, min=1)
    turns_sigma: float = help_field("Multi-turn: log-normal sigma of the turn count (prompt share and persistence as "
                                    "for lengths); median_response is then the median tokens of one turn.", 0.6, min=0)
    tool_kinds: list[ToolKind] = help_field("Multi-turn: the tools called, each with a log-normal latency; a prompt's "
                                            "k-th call uses the same kind every epoch.", factory=list)
    tool_timeout_s: float = help_field("Multi-turn: a tool call ends (with a timeout message) after this many seconds.", 120.0, gt=0)

    def __post_init__(self) -> None:
        if self.kind not in WORKLOADS:
            raise ConfigError("workload.kind", self.kind, "one of " + ", ".join(WORKLOADS))
        if self.kind == "replay" and not self.replay_path:
            raise ConfigError("workload.replay_path", self.replay_path, "a timeline .jsonl or lengths .json path")
        for key in ("num_prompts", "num_epochs", "prompt_tokens", "min_response"):
            if getattr(self, key) < 1:
                raise ConfigError(f"workload.{key}", getattr(self, key), "an integer >= 1")
        for key in ("prompt_share", "persistence"):
            if not 0.0 <= getattr(self, key) <= 1.0:
                raise ConfigError(f"workload.{key}", getattr(self, key), "a float in [0, 1]")
        for key in ("unsolved_share_start", "unsolved_share_end", "mixed_share_start", "mixed_share_end", "pass_rate_jitter"):
            if not 0.0 <= getattr(self, key) <= 1.0:
                raise ConfigError(f"workload.{key}", getattr(self, key), "a float in [0, 1]")
        for when in ("start", "end"):
            if getattr(self, f"unsolved_share_{when}") + getattr(self, f"mixed_share_{when}") > 1.0:
                raise ConfigError(f"workload.mixed_share_{when}", getattr(self, f"mixed_share_{when}"),
                                  f"at most 1 - unsolved_share_{when}")
        if self.turns_max < 1:
            raise ConfigError("workload.turns_max", self.turns_max, "an integer >= 1 (1 = single-turn)")
        if self.turns_max > 1:
            if self.kind != "synthetic":
                raise ConfigError("workload.turns_max", self.turns_max, "1 with workload.kind=replay (trajectories are synthetic)")
            if not self.tool_kinds:
                raise ConfigError("workload.tool_kinds", self.tool_kinds, "at least one tool kind when turns_max > 1")
            if self.turns_median < 1 or self.turns_sigma < 0 or self.tool_timeout_s <= 0:
                raise ConfigError("workload.turns_median", (self.turns_median, self.turns_sigma, self.tool_timeout_s),
                                  "turns_median >= 1, turns_sigma >= 0, tool_timeout_s > 0")
        for i, tool in enumerate(self.tool_kinds):
            if tool.weight <= 0 or tool.median_s <= 0 or tool.sigma < 0 or tool.tokens < 1:
                raise ConfigError(f"workload.tool_kinds.{i}", tool, "weight > 0, median_s > 0, sigma >= 0, tokens >= 1")
        if self.median_response <= 0 or self.sigma < 0:
            raise ConfigError("workload.sigma", (self.median_response, self.sigma), "median_response > 0, sigma >= 0")


@dataclass
class SimConfig:
    name: str = help_field("Scenario name shown in tables and plots.", "sim")
    run_config: str = help_field("Run config whose rollout.* and scheduler.* settings the simulation uses.", "")
    run_overrides: list[str] = help_field("key=value overrides applied to the run config.", factory=list)
    cluster: ClusterCosts = help_field("GPUs and the costs outside rollout.", factory=ClusterCosts)
    engine: EngineCostModel = help_field("Cost model of one rollout engine.", factory=EngineCostModel)
    workload: WorkloadConfig = help_field("Response-length workload.", factory=WorkloadConfig)
    speculation: SpeculationConfig = help_field("HistoSpec model for `<policy>+histospec` variants.", factory=SpeculationConfig)
    reward: RewardCostConfig = help_field("Reward scoring cost and workers (scheduler/sim/reward_cost.py).",
                                          factory=RewardCostConfig)
    layout: LayoutCosts = help_field("Colocated or disaggregated step costs (scheduler/sim/layout_sim.py; '' = as before).",
                                     factory=LayoutCosts)
    calibrate_from: str = help_field(
        "A `train` run directory: measure engine and cluster costs from its timeline and metrics, replay its "
        "response lengths and use its config.yaml as the run config (scheduler/sim/calibrate.py; '' = off).", "")


def load_sim_config(path: str | Path, overrides: list[str] | None = None) -> tuple[SimConfig, RunConfig]:
    """The validated simulator config and the run config it points to (`run.`-prefixed overrides go there)."""
    path = Path(path)
    overrides = list(overrides or [])
    for item in overrides:
        if "=" not in item:
            raise ConfigError("<override>", item, "key=value, e.g. workload.persistence=0.5 or run.scheduler.policy=sync")
    sim = read_scenario(path, [o for o in overrides if not o.startswith("run.")])
    base = Path(sim.run_config) if sim.run_config else None
    if base is not None and not base.is_absolute() and not base.is_file():
        base = path.parent.parent / sim.run_config  # relative to the repository root
    run = in_scenario(load_config, path)(base, list(sim.run_overrides) + [o[len("run."):] for o in overrides
                                                                         if o.startswith("run.")])
    in_scenario(check_engines, path)(sim, run)
    return sim, run


def read_scenario(path: Path, overrides: list[str] | None = None) -> SimConfig:
    """The scenario of one YAML file and its overrides, checked like a run config (`schema.py`: every key known,
    every value of its type and range, then each section's `__post_init__`) and its layout and replay file
    checked (`check_layout`, `check_replay`); any problem is one ConfigError naming the key and the file."""
    if path.is_file():
        _refuse_run_config(path)
    sim = in_scenario(load_schema, path)(SimConfig, path, overrides, (
        "<sim config file>", "configs/sim_tiny_cpu.yaml", "cluster:, engine:, workload:, ...",
        "workload.persistence=0.5"))
    in_scenario(check_layout, path)(sim)
    in_scenario(check_replay, path)(sim.workload)
    return sim


def _refuse_run_config(path: Path) -> None:
    """A run config given where a scenario belongs (`simulate configs/tiny_cpu.yaml`, or as
    `scheduler.layout_cost_model`) is named as such, not as its first key the scenario schema lacks."""
    from omegaconf import OmegaConf

    try:
        top = set(OmegaConf.to_container(OmegaConf.load(path), resolve=False) or {})
    except Exception:  # noqa: BLE001 - not YAML, not a mapping: load_schema says so in its own line
        return
    scenario, run = {f.name for f in fields(SimConfig)}, {f.name for f in fields(RunConfig)}
    extra = top - scenario
    if extra and extra <= run:
        raise ConfigError("<sim config file>", str(path), f"a simulator scenario YAML such as configs/sim_tiny_cpu.yaml "
                          f"(keys {', '.join(sorted(scenario))}), not a run config (this file has the run config "
                          f"sections {', '.join(sorted(extra)[:3])}; a scenario names its run config in run_config)")


def in_scenario(check: Any, path: Path) -> Any:
    """`check` with its error's one line ending in the scenario file it concerns."""
    def wrapped(*args: Any) -> Any:
        try:
            return check(*args)
        except UserError as err:
            if str(path) in str(err):
                raise
            err.args = (f"{err} (scenario {path})",)
            raise err from None
    return wrapped


def check_engines(sim: SimConfig, run: RunConfig) -> None:
    """The run config's engine layouts must fit the scenario's engine GPUs (the planner would quietly clamp
    them otherwise), and a colocated trainer's TP x PP the scenario's GPUs."""
    c = sim.cluster
    engine_gpus = c.gpus - c.trainer_gpus
    room = min(engine_gpus, c.gpus_per_node)
    for key in ("tensor_parallel_size", "long_round_tensor_parallel_size"):
        tp = getattr(run.rollout, key)
        if tp > room:
            raise ConfigError(f"run.rollout.{key}", tp, f"at most {room}: the scenario's engines have {engine_gpus} "
                              f"GPUs (cluster.gpus - cluster.trainer_gpus), {c.gpus_per_node} per node")


def check_replay(workload: WorkloadConfig) -> None:
    """A replay workload's lengths file is read now, so a missing or malformed one is refused before any
    simulation (scheduler/sim/replay_lengths.py: `load_lengths`)."""
    if workload.kind == "replay":
        from scheduler.sim.replay_lengths import load_lengths

        load_lengths(workload.replay_path)
