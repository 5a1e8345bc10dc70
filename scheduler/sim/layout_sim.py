"""The two layouts in the simulator, each with its step costs: colocated (every GPU generates, then the switch,
then every GPU trains) and disaggregated (engines on some GPUs, the trainer on the rest, weights over the network).

    layout: {kind: colocated, trainer_model_parallel: 2}          # in a configs/sim_*.yaml scenario
    python benchmarks/simulate_layouts.py                          # both layouts, both scenarios, 3 seeds

`layout.kind` empty (the default) keeps the simulator's model as it was: after the harvest, `train` (fixed cost
plus tokens) and `sync` (`cluster.weight_sync_s`), on every GPU; the committed simulation figures use it.

- **colocated** (`cluster.trainer_gpus` 0): the engines run on every GPU; after the harvest the step's
  transitions are phases of their own, timed by the planner's formulas (`megatron_sortedrl/plan/colocated.py`,
  `switch_seconds`): `sleep` (KV freed; weights to host at sleep level 1), `reload` (the trainer's state back
  from host), `train` (all GPUs), `offload` (the trainer's state to host), `wake` (weights and KV cache back)
  and `handoff` (the new weights over CUDA IPC). The trainer's state per GPU comes from the model's size
  (`trainer_state_bytes`: weights and fp32 gradients over the trainer's TP x PP, Adam's state over every GPU);
- **disaggregated** (`cluster.trainer_gpus` > 0): the engines get the other GPUs (fewer engines), the trainer
  trains at its share of `train_tokens_per_s` (stream training, `cluster.stream_training`, can start during the
  rollout), and the weights go over the network: the model's bytes over `network_gbs`, as the planner's
  `weight_sync_estimate` charges every engine GPU (`sync` phase). Nothing sleeps or offloads.

Both keep `cluster.train_fixed_s` (the optimizer step and log-prob passes' fixed part). The model's bytes are
`engine.weight_gib` (the scenario's engine weights).

Left out: overlapping the switch's copies with each other, the engines' memory after a colocated wake
(the scenario's KV capacity is used as is: the plan checks the KV the rollout phase leaves), and colocated
stream training (an engine that ran dry would have to sleep before its GPU trains).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megatron_sortedrl.schema import help_field
from megatron_sortedrl.errors import ConfigError

GIB = 2**30
KINDS = ("", "colocated", "disaggregated")
COLOCATED_PHASES = ("sleep", "reload", "train", "offload", "wake", "handoff")


@dataclass
class LayoutCosts:
    kind: str = help_field("'' (train + sync as before), colocated or disaggregated (cluster.trainer_gpus > 0).", "", choices=KINDS)
    trainer_model_parallel: int = help_field("Colocated: the trainer's TP x PP (its weights and gradients per GPU).", 8, min=1)  # type: ignore[assignment]
    sleep_level: int = help_field("Colocated: 1 keeps engine weights in host memory while asleep, 2 frees them.", 2, choices=(1, 2))  # type: ignore[assignment]
    offload_trainer: bool = help_field("Colocated: the trainer's state leaves the GPU during rollout.", True)
    offload_gbs: float = help_field("Colocated: host-device GB/s per GPU (plan.offload_gbs; 25 on GPU).", 25.0, gt=0)
    handoff_gbs: float = help_field("Colocated: GB/s an engine GPU receives the model over CUDA IPC (plan.handoff_gbs).", 100.0, gt=0)
    wake_s: float = help_field("Colocated: seconds to wake an engine beyond copying weights (plan/colocated.py).", 1.0, min=0)
    network_gbs: float = help_field("Disaggregated: GB/s every engine GPU receives the model at (plan.sync_bandwidth_gbs).", 20.0, gt=0)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ConfigError("layout.kind", self.kind, "'', colocated or disaggregated")
        if self.sleep_level not in (1, 2):
            raise ConfigError("layout.sleep_level", self.sleep_level, "1 or 2")
        if self.trainer_model_parallel < 1:
            raise ConfigError("layout.trainer_model_parallel", self.trainer_model_parallel, "an integer >= 1")
        for key in ("offload_gbs", "handoff_gbs", "network_gbs"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"layout.{key}", getattr(self, key), "a positive number of GB/s")
        if self.wake_s < 0:
            raise ConfigError("layout.wake_s", self.wake_s, "a number of seconds >= 0")


def step_costs(sim: Any, run: Any) -> dict[str, float]:
    """Seconds of each non-training phase of one step for the scenario `sim` (a SimConfig) and its run config."""
    from megatron_sortedrl.plan.colocated import switch_seconds, trainer_state_bytes

    lay, c, e = sim.layout, sim.cluster, sim.engine
    model_bytes = e.weight_gib * GIB
    if lay.kind == "colocated":
        tp = max(run.rollout.tensor_parallel_size, sim.engine.min_tp())  # short rounds: the most weights per GPU
        state = trainer_state_bytes(model_bytes / 2, 2, lay.trainer_model_parallel, c.gpus)  # bf16: 2 B/param
        return switch_seconds(trainer_state=state, engine_weights=model_bytes / tp, model_bytes=model_bytes,
                              sleep_level=lay.sleep_level, offload_trainer=lay.offload_trainer,
                              offload_gbs=lay.offload_gbs, handoff_gbs=lay.handoff_gbs, wake_s=lay.wake_s)
    if lay.kind == "disaggregated":
        return {"sync": model_bytes / (lay.network_gbs * 1e9)}
    return {"sync": c.weight_sync_s}


def check_layout(sim: Any) -> None:
    """A layout kind that contradicts `cluster.trainer_gpus`, or a trainer TP x PP larger than the trainer's GPUs,
    is refused (ConfigError, the key named)."""
    kind, trainer = sim.layout.kind, sim.cluster.trainer_gpus
    if kind == "colocated" and trainer:
        raise ConfigError("cluster.trainer_gpus", trainer, "0 with layout.kind=colocated (the trainer uses every GPU)")
    if kind == "disaggregated" and not trainer:
        raise ConfigError("cluster.trainer_gpus", trainer, "> 0 with layout.kind=disaggregated (GPUs of the trainer's own)")
    if kind == "colocated" and sim.layout.trainer_model_parallel > sim.cluster.gpus:
        raise ConfigError("layout.trainer_model_parallel", sim.layout.trainer_model_parallel,
                          f"at most cluster.gpus ({sim.cluster.gpus}) with layout.kind=colocated (the trainer's TP x PP "
                          "group lies on the scenario's GPUs)")


def step_phases(simulator: Any, train_s: float) -> None:
    """The phases after a harvest, on the simulator's clock: train then sync (legacy and disaggregated), or the
    colocated switch around the training."""
    sim = simulator.sim
    costs = step_costs(sim, simulator.run)
    if sim.layout.kind != "colocated":
        simulator.phase("train", train_s)
        simulator.phase("sync", costs["sync"])
        return
    for name in COLOCATED_PHASES:
        simulator.phase(name, train_s if name == "train" else costs[name])
