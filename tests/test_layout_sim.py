"""The two layouts in the simulator (scheduler/sim/layout_sim.py): a colocated step is sleep, reload, train, offload,
wake and handoff on the timeline, each as long as the planner's formula says; a disaggregated step trains and
syncs the model's bytes over the network; the default keeps the old train + sync; contradictions are refused.

Hardware: CPU only. Run: .venv/bin/python -m pytest tests/test_layout_sim.py -q
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from megatron_sortedrl.errors import ConfigError
from megatron_sortedrl.plan.colocated import switch_seconds
from scheduler.sim.layout_sim import COLOCATED_PHASES, step_costs
from scheduler.sim.sim_config import load_sim_config
from scheduler.sim.simulator import simulate

GIB = 2**30
SMALL = ["workload.num_prompts=16", "workload.num_epochs=2", "workload.sigma=1.4", "run.scheduler.rollout_batch_size=4",
         "run.scheduler.update_batch_size=8", "run.scheduler.group_size=8"]


def _phases(result) -> list[tuple[int, str, float]]:
    """(step, phase, seconds) of every phase after a rollout, in timeline order."""
    starts, out = {}, []
    for e in result.events:
        if e.kind == "phase" and e.event == "start":
            starts[(e.step, e.phase)] = e.t
        elif e.kind == "phase" and e.event == "end" and e.phase != "rollout":
            out.append((e.step, e.phase, e.t - starts[(e.step, e.phase)]))
    return out


def test_colocated_step_is_the_switch_around_training_with_the_planners_seconds():
    sim, run = load_sim_config("configs/sim_qwen7b_8gpu.yaml", SMALL)
    costs = step_costs(sim, run)
    # By hand: 7.62e9 params (14.2 GiB bf16), trainer TP=2 on 8 GPUs: 6 B / 2 + 12 B / 8 = 4.5 B per param per GPU.
    params = 14.2 * GIB / 2
    assert costs["reload"] == pytest.approx(4.5 * params / 25e9) == costs["offload"]
    assert costs["handoff"] == pytest.approx(14.2 * GIB / 100e9)
    assert costs["sleep"] == 0.0 and costs["wake"] == 1.0  # level 2: nothing copied
    result = simulate(sim, run, "twotier")
    phases = _phases(result)
    steps = sorted({s for s, _, _ in phases})
    assert steps and len(phases) == len(COLOCATED_PHASES) * len(steps)
    for step in steps:
        mine = [(name, sec) for s, name, sec in phases if s == step]
        assert [name for name, _ in mine] == list(COLOCATED_PHASES)
        for name, sec in mine:
            if name != "train":
                assert sec == pytest.approx(costs[name], abs=1e-9)
    # Sleep level 1 moves the engine's weights (TP=1: the whole model per GPU) both ways over PCIe.
    level1 = replace(sim, layout=replace(sim.layout, sleep_level=1))
    c1 = step_costs(level1, run)
    assert c1["sleep"] == pytest.approx(14.2 * GIB / 25e9) and c1["wake"] == pytest.approx(1.0 + c1["sleep"])
    assert simulate(level1, run, "twotier", record=False).total_s > result.total_s


def test_disaggregated_step_syncs_the_model_over_the_network_and_the_default_is_unchanged():
    sim, run = load_sim_config("configs/sim_qwen7b_8gpu.yaml", SMALL + [
        "layout.kind=disaggregated", "cluster.trainer_gpus=4"])
    assert step_costs(sim, run) == {"sync": pytest.approx(14.2 * GIB / 20e9)}
    result = simulate(sim, run, "sync")
    assert all(r["engines"] * r["tp"] == 4 for r in result.rounds)  # half of the node generates
    assert {name for _, name, _ in _phases(result)} == {"train", "sync"}
    # The default (no layout.kind): train then cluster.weight_sync_s, as the committed figures were made.
    legacy, run = load_sim_config("configs/sim_qwen7b_8gpu.yaml", SMALL + ["layout.kind=''"])
    phases = _phases(simulate(legacy, run, "sync"))
    assert [p for _, p, _ in phases][:2] == ["train", "sync"]
    assert all(sec == legacy.cluster.weight_sync_s for _, p, sec in phases if p == "sync")


def test_colocated_switch_seconds_are_the_planners_function():
    """The simulator calls the planner's switch_seconds; a broken copy would differ from this by-hand call."""
    sim, run = load_sim_config("configs/sim_qwen32b_128gpu.yaml", ["layout.kind=colocated",
                                                                    "layout.trainer_model_parallel=16"])
    model = 61.0 * GIB
    state = model / 2 * 6 / 16 + model / 2 * 12 / 128
    want = switch_seconds(trainer_state=state, engine_weights=model / 4, model_bytes=model, sleep_level=2,
                          offload_trainer=True, offload_gbs=25.0, handoff_gbs=100.0)
    assert step_costs(sim, run) == pytest.approx(want)


@pytest.mark.parametrize("over, key", [
    (["layout.kind=colocated", "cluster.trainer_gpus=4"], "cluster.trainer_gpus"),
    (["layout.kind=disaggregated"], "cluster.trainer_gpus"),
    (["layout.kind=hybrid"], "layout.kind"),
    (["layout.sleep_level=3"], "layout.sleep_level"),
    (["layout.kind=disaggregated", "cluster.trainer_gpus=5"], "cluster.trainer_gpus"),  # one node: at most half
])
def test_contradictory_layouts_are_refused(over, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_sim_config("configs/sim_qwen7b_8gpu.yaml", over)
