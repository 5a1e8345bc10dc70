"""Every field of a simulator scenario answers bad input in one line naming its dotted path and the scenario file
(scheduler/sim/sim_config.py loads scenarios through megatron_sortedrl/schema.py, as run configs load).

    python -m pytest tests/test_scenario_schema.py -q        # about 20 s: in-process, no simulation runs

The cases come from the scenario schema (`SimConfig`: cluster, engine, workload and its tool kinds, speculation,
reward, layout), as tests/test_config_schema.py derives the run config's: a wrong type, a value outside the
declared range, a section for a scalar and a scalar for a section, each as a `key=value` override of
configs/sim_tiny_cpu.yaml (the first of each key through `simulate` on the command line: exit 2, one line),
then a hypothesis property with values drawn at random in a scenario YAML file. Also: the layouts a scenario's
GPUs cannot hold and a replay lengths file of the wrong structure. Left out: simulations themselves
(tests/test_simulator.py).
"""

from __future__ import annotations

import contextlib
import io
import json
import tempfile
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from schema_cases import bad_field, by_key, cases, names_key, nested, unbounded

from megatron_sortedrl.cli import main
from megatron_sortedrl.errors import ConfigError, UserError
from megatron_sortedrl.schema import leaf_fields, section_paths
from scheduler.sim.sim_config import SimConfig, load_sim_config, read_scenario

REPO = Path(__file__).resolve().parent.parent
SCENARIO = REPO / "configs" / "sim_tiny_cpu.yaml"
LEAVES = leaf_fields(SimConfig)
SECTIONS = section_paths(SimConfig)
BY_KEY = by_key(cases(LEAVES, SECTIONS))


def test_the_scenario_schema_is_covered():
    assert {k for k, _ in SECTIONS} >= {"cluster", "engine", "workload", "speculation", "reward", "layout"}
    assert not unbounded(LEAVES), f"numeric scenario fields without a declared range: {unbounded(LEAVES)}"
    assert set(BY_KEY) >= {k for k, _, _ in LEAVES} | {k for k, _ in SECTIONS}


def simulate_cli(argv: list[str], tmp: Path) -> tuple[int, list[str]]:
    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        try:
            rc = main(["simulate", str(SCENARIO), "--policies", "sync", "--out", str(tmp), *argv])
        except SystemExit as exc:
            rc = exc.code
    assert "Traceback" not in err.getvalue()
    return rc, err.getvalue().strip().splitlines()


@pytest.mark.parametrize("key", sorted(BY_KEY))
def test_every_scenario_field_refuses_bad_input_in_one_line(key, tmp_path):
    for i, (what, value) in enumerate(BY_KEY[key]):
        override = f"{key}={json.dumps(value)}"
        if i == 0:
            rc, lines = simulate_cli([override], tmp_path)
            assert rc == 2, f"{override} ({what}) was accepted"
            assert len(lines) == 1 and lines[0].startswith("error: config error: "), (what, lines)
            message = lines[0]
        else:
            with pytest.raises(ConfigError, match="^config error: ") as info:
                load_sim_config(SCENARIO, [override])
            message = str(info.value)
        assert names_key(message, key) and f"(scenario {SCENARIO})" in message, (what, value, message)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(bad_field(LEAVES))
def test_property_bad_values_in_a_scenario_file(case):
    key, value = case
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "scenario.yaml"
        path.write_text(yaml.safe_dump(nested(key, value)))
        with pytest.raises(ConfigError) as info:
            read_scenario(path)
    message = str(info.value)
    assert names_key(message, key) and str(path) in message, (key, value, message)


@pytest.mark.parametrize("overrides, text", [
    (["layout.kind=colocated", "layout.trainer_model_parallel=4"],
     "layout.trainer_model_parallel=4 is not allowed; expected at most cluster.gpus (2)"),
    (["cluster.trainer_gpus=1", "run.rollout.tensor_parallel_size=2"],
     "run.rollout.tensor_parallel_size=2 is not allowed; expected at most 1"),
    (["cluster.trainer_gpus=1", "run.rollout.long_round_tensor_parallel_size=2"],
     "run.rollout.long_round_tensor_parallel_size=2 is not allowed; expected at most 1"),
    (["layout.kind=disaggregated"], "cluster.trainer_gpus=0 is not allowed; expected > 0 with layout.kind=disaggregated"),
])
def test_layouts_the_scenario_cannot_hold_are_refused(overrides, text):
    with pytest.raises(ConfigError) as info:
        load_sim_config(SCENARIO, overrides)
    assert text in str(info.value) and f"(scenario {SCENARIO})" in str(info.value), str(info.value)


@pytest.mark.parametrize("content, text", [
    ({"p0": {"0": [12, "x"]}}, "at $.p0['0'][1]: 'x' is not of type 'integer'"),
    ({"p0": [12, 30]}, "at $.p0: [12, 30] is not of type 'object'"),
    ({"p0": {"first": [12]}}, "at $.p0: 'first' does not match"),
    ([[12, 30]], "at $: [[12, 30]] is not of type 'object'"),
    ({"p0": {"0": []}}, "at $.p0['0']: [] should be non-empty"),
    ({}, "at $: {} should be non-empty"),
])
def test_a_replay_file_of_the_wrong_structure_is_one_line(tmp_path, content, text):
    lengths = tmp_path / "lengths.json"
    lengths.write_text(json.dumps(content))
    with pytest.raises(UserError) as info:
        load_sim_config(SCENARIO, ["workload.kind=replay", f"workload.replay_path={lengths}"])
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"workload.replay_path: {lengths}") and text in message, message


def test_a_run_config_in_place_of_a_scenario_is_named(tmp_path):
    rc, lines = simulate_cli([], tmp_path)  # the scenario itself loads and simulates
    assert rc == 0, lines
    with pytest.raises(ConfigError, match="not a run config") as info:
        read_scenario(REPO / "configs" / "tiny_cpu.yaml")
    assert "seed" not in str(info.value).split(";")[0], str(info.value)
