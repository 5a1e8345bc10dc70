"""The layout planner of a real run: `scheduler.layout_planner` honoured by the driver, or refused in one line.

    from scheduler.sim.layout_driver import driver_planner
    planner = driver_planner(cfg)        # the driver's `_setup`; the policy asks it for each round's layout
    python -m megatron_sortedrl train configs/elastic_cpu.yaml     # cost_model with configs/sim_elastic_cpu.yaml

- `fixed`: `rollout.tensor_parallel_size` for sync and short rounds, `long_round_tensor_parallel_size` for
  long rounds (what the driver always did).
- `cost_model`: the planner of `scheduler/layout.py` with the engine cost model of the simulator YAML named by
  `scheduler.layout_cost_model` (its `engine:` section, and `cluster.relayout_s` as the price of a switch):
  per round it takes the TP whose estimated round time, from the round's predicted lengths, is smallest.
  The driver's `compose_round` rebuilds the engines (`RolloutPool.set_layout`, via
  `megatron_sortedrl/relayout.py`) when the chosen layout differs: a `relayout` phase on the run timeline,
  the layout per step in the metrics and the run report (demo: `configs/elastic_cpu.yaml`). Calibrate the YAML from a run of the same
  engines (`scheduler/sim/calibrate.py`) so its choice means something on them.
- `preemption` is refused: it reacts to KV-cache preemption counts, which the real engines do not report to
  the driver yet.

The GPUs the planner may lay out are the run's rollout devices, `rollout.num_workers x
rollout.tensor_parallel_size`, all on one node. Left out: multi-node rollout layouts in `train`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from megatron_sortedrl.errors import ConfigError, UserError
from scheduler.layout import FixedPlanner, make_planner


def check_planner(cfg: Any) -> None:
    """Raises a one-line ConfigError for a planner setting a real run cannot honour (called by preflight)."""
    s = cfg.scheduler
    if s.layout_planner == "preemption":
        raise ConfigError("scheduler.layout_planner", s.layout_planner,
                          "fixed or cost_model in `train` (the engines do not report KV preemptions to the driver yet)")
    if s.layout_planner != "cost_model":
        return
    allowed = "a simulator YAML whose engine: section models these engines (e.g. configs/sim_tiny_cpu.yaml)"
    if not (s.layout_cost_model and Path(s.layout_cost_model).is_file()):
        raise ConfigError("scheduler.layout_cost_model", s.layout_cost_model, allowed)
    from scheduler.sim.sim_config import read_scenario

    try:
        read_scenario(Path(s.layout_cost_model))
    except UserError as err:  # a run config, a typo'd key: named here, before Ray, not when the driver plans
        if isinstance(err, ConfigError) and err.key == "<sim config file>":
            raise ConfigError("scheduler.layout_cost_model", s.layout_cost_model, err.allowed) from None
        raise ConfigError("scheduler.layout_cost_model", s.layout_cost_model,
                          f"{allowed}; in that file: {str(err).removeprefix('config error: ')}") from None


def driver_planner(cfg: Any) -> FixedPlanner:
    """The planner named by `cfg.scheduler.layout_planner` over the run's rollout devices."""
    check_planner(cfg)
    gpus = cfg.rollout.num_workers * cfg.rollout.tensor_parallel_size
    kw: dict[str, Any] = {}
    if cfg.scheduler.layout_planner == "cost_model":
        from scheduler.sim.sim_config import load_sim_config

        sim, _ = load_sim_config(cfg.scheduler.layout_cost_model)
        kw = {"model": sim.engine, "relayout_s": sim.cluster.relayout_s}
    return make_planner(cfg.scheduler.layout_planner, gpus=gpus, gpus_per_node=gpus,
                        tp_short=cfg.rollout.tensor_parallel_size, tp_long=cfg.rollout.long_round_tensor_parallel_size,
                        **kw)
