"""The driver's layout planner (scheduler/layout_driver.py): the planner named in the config, its engine model
from a simulator YAML, the layout switch its model asks for, and one-line refusals.

Hardware: CPU only, no engines (the switch itself is `RolloutPool.set_layout`, called by the driver's
compose_round when a round's layout differs). Run: .venv/bin/python -m pytest tests/test_layout_driver.py -q
"""

from __future__ import annotations

import pytest

from megatron_sortedrl.config import load_config
from megatron_sortedrl.errors import ConfigError
from scheduler.layout import CostModelPlanner, FixedPlanner
from scheduler.layout_driver import driver_planner

# Two cores where each engine runs at most 8 sequences: many short requests go faster on two TP=1 engines
# (twice the running sequences), a few long ones on one TP=2 engine (each step reads half the weights per core).
ENGINE_YAML = """
name: two cores
cluster: {gpus: 2, gpus_per_node: 2, relayout_s: 0.5}
engine: {hbm_gbs: 2.0, gpu_mem_gib: 4.0, mem_utilization: 0.5, weight_gib: 0.02, kv_bytes_per_token: 4096.0,
         step_overhead_s: 0.002, tp_comm_s: 0.002, per_seq_s: 0.001, prefill_tokens_per_s: 20000.0, max_num_seqs: 8}
"""


def _cfg(tmp_path, planner, model=True):
    path = tmp_path / "engine.yaml"
    path.write_text(ENGINE_YAML)
    overrides = ["rollout.num_workers=2", "rollout.tensor_parallel_size=1", "rollout.long_round_tensor_parallel_size=1",
                 f"scheduler.layout_planner={planner}"] + ([f"scheduler.layout_cost_model={path}"] if model else [])
    return load_config("configs/tiny_cpu.yaml", overrides)


def test_fixed_is_what_the_driver_always_used(tmp_path):
    planner = driver_planner(_cfg(tmp_path, "fixed", model=False))
    assert type(planner) is FixedPlanner
    assert (planner.plan("short", [50.0] * 8, 20).tp, planner.plan("short", [50.0] * 8, 20).num_engines) == (1, 2)


def test_cost_model_switches_layout_when_its_model_says_so(tmp_path):
    planner = driver_planner(_cfg(tmp_path, "cost_model"))
    assert isinstance(planner, CostModelPlanner) and planner.gpus == 2
    short = planner.plan("short", [40.0] * 64, 20)  # many short requests: two TP=1 engines
    assert (short.tp, short.num_engines) == (1, 2)
    long = planner.plan("long", [4000.0, 3000.0], 20)  # two long ones: one TP=2 engine decodes them faster
    assert (long.tp, long.num_engines) == (2, 1)
    # The choice is the model's: the estimate it minimised is smaller than the alternative's, switch included.
    m = planner.model
    assert m.estimate_round_s(2, 1, [4000.0, 3000.0], 20) + planner.relayout_s < m.estimate_round_s(1, 2, [4000.0, 3000.0], 20)
    back = planner.plan("short", [40.0] * 64, 20)
    assert (back.tp, back.num_engines) == (1, 2)


@pytest.mark.parametrize("planner, model, message", [
    ("cost_model", False, "scheduler.layout_cost_model='' is not allowed; expected a simulator YAML"),
    ("preemption", True, "scheduler.layout_planner='preemption' is not allowed; expected fixed or cost_model"),
])
def test_refuses_what_it_cannot_honour_in_one_line(tmp_path, planner, model, message):
    with pytest.raises(ConfigError) as err:
        driver_planner(_cfg(tmp_path, planner, model))
    assert message in str(err.value) and "\n" not in str(err.value)
