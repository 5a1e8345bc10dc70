"""The driver's layout planner (scheduler/sim/layout_driver.py): the planner named in the config, its engine model
from a simulator YAML, the layout switch its model asks for, and one-line refusals.

Hardware: CPU only, no engines (the switch itself is `RolloutPool.set_layout`, called by the driver's
compose_round when a round's layout differs). Run: .venv/bin/python -m pytest tests/test_layout_driver.py -q
"""

from __future__ import annotations

import pytest

from megatron_sortedrl.config import load_config
from megatron_sortedrl.errors import ConfigError
from scheduler.layout import CostModelPlanner, FixedPlanner
from scheduler.sim.layout_driver import driver_planner

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


# ------------------------------------------------------------------------------ the demo's engine model
# configs/elastic_cpu.yaml with configs/sim_elastic_cpu.yaml: tail batching's short rounds run 3 prompts x 5
# responses (15 sequences), its long rounds 2 prompts x 4 (8 sequences); prompts of the arithmetic task are
# about 40 tokens.
SHORT_N, LONG_N, PROMPT = 15, 8, 40.0


@pytest.fixture(scope="module")
def demo_planner():
    return driver_planner(load_config("configs/elastic_cpu.yaml", []))


def _gain(planner, n: int, length: float, to_tp: int) -> float:
    """Seconds the model saves on a round of `n` sequences of `length` tokens by running it at `to_tp` rather
    than at the other of the demo's two layouts (TP=1: two engines, TP=2: one)."""
    m, other = planner.model, 3 - to_tp
    return (m.estimate_round_s(other, 2 // other, [length] * n, PROMPT)
            - m.estimate_round_s(to_tp, 2 // to_tp, [length] * n, PROMPT))


def _break_even(planner, n: int, to_tp: int, max_len: int) -> int:
    """Smallest whole length at which switching to `to_tp` saves more than the switch costs, by the model's
    own round times (bisection: the saving grows with the length); max_len + 1 when none does."""
    lo, hi = 1, max_len + 1
    while lo < hi:
        mid = (lo + hi) // 2
        if _gain(planner, n, mid, to_tp) > planner.relayout_s:
            hi = mid
        else:
            lo = mid + 1
    return lo


def _decide(planner, start_tp: int, n: int, length: float) -> int:
    planner.current = planner.layout(start_tp)
    return planner.plan("short", [length] * n, PROMPT).tp


def test_demo_model_is_the_run_config_engines(demo_planner):
    p = demo_planner
    assert (p.gpus, p.candidates(), p.relayout_s) == (2, [1, 2], 1.0)
    assert p.model.max_num_seqs == load_config("configs/elastic_cpu.yaml", []).rollout.max_num_seqs  # same engines


# Long rounds (8 sequences) switch to one TP=2 engine, short rounds (15) back to two TP=1 engines, each exactly
# past the break-even of the model's own round times; from the target layout neither ever switches away:
# one TP=2 engine is faster for a long round at any length, and 15 sequences need more than one engine's
# 8 slots.
@pytest.mark.parametrize("n, from_tp, to_tp", [(LONG_N, 1, 2), (SHORT_N, 2, 1)], ids=["long-to-tp2", "short-to-tp1"])
def test_demo_model_switches_exactly_past_the_break_even(demo_planner, n, from_tp, to_tp):
    p = demo_planner
    max_len = 192
    even = _break_even(p, n, to_tp=to_tp, max_len=max_len)
    # The demo needs a break-even its rounds can reach: well inside max_response_length.
    assert 10 <= even <= max_len // 2, even
    for length in range(1, max_len + 1):
        assert _decide(p, from_tp, n, length) == (to_tp if length >= even else from_tp), length
    assert all(_gain(p, n, length, to_tp=to_tp) > 0 for length in (1, 10, 100, 192))
    assert all(_decide(p, to_tp, n, length) == to_tp for length in range(1, max_len + 1))


def test_a_round_without_predictions_keeps_the_layout(demo_planner):
    """Before any length is recorded every prediction is 0 ("none"): the planner has nothing to choose by."""
    p = demo_planner
    p.current = None
    assert p.plan("short", [0.0] * SHORT_N, PROMPT).tp == 1  # the first round: the fixed short-round layout
    p.current = p.layout(2)
    assert p.plan("short", [0.0] * SHORT_N, PROMPT).tp == 2  # later: stays where it is
