"""Every field of the run config answers bad input in one line naming its dotted path (megatron_sortedrl/schema.py).

    python -m pytest tests/test_config_schema.py -q        # about 20 s: in-process, one CLI subprocess

The cases are derived from the schema itself (every section and scalar field of `RunConfig`, nested ones
included), so a field added later is covered without a new test: for each field a wrong type, a value
outside its declared range (or choices), and a section where a scalar belongs; for each section a scalar.
Each goes through the command line's `main()` (`config <override>`) and must exit 2 with exactly one line
on stderr that names the dotted path. A hypothesis property test then throws generated values of the wrong
type or range at random fields through a YAML file. Left out: checks across fields (`__post_init__`), which
tests/test_config.py and docs/reliability.md cover.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schema_cases import bad_field, by_key, cases, names_key, nested, unbounded

from megatron_sortedrl.cli import main
from megatron_sortedrl.config import RunConfig, help_field, load_config
from megatron_sortedrl.errors import ConfigError
from megatron_sortedrl.schema import describe, leaf_fields, section_paths

REPO = Path(__file__).resolve().parent.parent
LEAVES = leaf_fields(RunConfig)
SECTIONS = section_paths(RunConfig)
CASES = cases(LEAVES, SECTIONS)
# The fields of the features added last: tool use, the cluster (colocation) and Mixture-of-Experts.
FEATURE_KEYS = ("tools.", "cluster.", "parallel.expert_", "model.tiny.num_experts", "model.tiny.moe_",
                "model.tiny.architecture", "rollout.return_routed_experts", "algorithm.routing_replay",
                "trainer.moe_")
FEATURE_LEAVES = [leaf for leaf in LEAVES if leaf[0].startswith(FEATURE_KEYS)]


def run_cli(argv: list[str]) -> tuple[int, list[str]]:
    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        try:
            rc = main(argv)
        except SystemExit as exc:
            rc = exc.code
    assert "Traceback" not in err.getvalue()
    return rc, err.getvalue().strip().splitlines()


def test_the_schema_is_covered():
    """Every leaf and section yields cases, and every numeric field declares its range: a new field without
    one fails here (add min/max/gt/lt to its help_field, or field metadata in scheduler/ and speculative/)."""
    assert len(LEAVES) > 150 and {k for k, _ in SECTIONS} >= {"model.tiny", "parallel.recompute", "sampling", "tools"}
    assert not unbounded(LEAVES), f"numeric fields without a declared range: {unbounded(LEAVES)}"
    assert {k for k, _, _ in CASES} >= {k for k, _, _ in LEAVES} | {k for k, _ in SECTIONS}
    keys = {k for k, _, _ in FEATURE_LEAVES}
    assert keys >= {"tools.tools", "tools.parser", "tools.max_turns", "tools.timeout_s", "cluster.colocate",
                    "cluster.engine_sleep_level", "cluster.offload_trainer", "parallel.expert_model_parallel_size",
                    "parallel.expert_tensor_parallel_size", "model.tiny.num_experts", "rollout.return_routed_experts",
                    "algorithm.routing_replay"}, keys


BY_KEY = by_key(CASES)


@pytest.mark.parametrize("key", sorted(BY_KEY))
def test_every_field_refuses_bad_input_in_one_line(key):
    """Each case through the loader; the first also through the command line (exit 2, one line on stderr)."""
    for i, (what, value) in enumerate(BY_KEY[key]):
        if i == 0:
            rc, lines = run_cli(["config", f"{key}={json.dumps(value)}"])
            assert rc == 2, f"{key}={value!r} ({what}) was accepted"
            assert len(lines) == 1 and lines[0].startswith("error: config error: "), (what, lines)
            message = lines[0]
        else:
            with pytest.raises(ConfigError, match="^config error: ") as info:
                load_config(None, [f"{key}={json.dumps(value)}"])
            message = str(info.value)
        assert "\n" not in message and (f"{key}=" in message or f"{key}[" in message), (what, value, message)


def test_valid_values_at_the_bounds_pass():
    """The bounds themselves are accepted (closed ends), so the ranges are not off by one."""
    for key, typ, f in LEAVES:
        meta = f.metadata
        for bound in ("min", "max"):
            if meta.get(bound) is not None:
                value = meta[bound]
                try:
                    load_config(None, [f"{key}={value}"])
                except ConfigError as err:  # a check across fields may still refuse it, not the range
                    assert describe(typ, meta) not in str(err), f"{key}={value} is its {bound} but was refused: {err}"


def _refused_in_a_yaml_file(key: str, value) -> None:
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "run.yaml"
        path.write_text(yaml.safe_dump(nested(key, value)))
        with pytest.raises(ConfigError) as info:
            load_config(path)
    assert names_key(str(info.value), key), (key, value, str(info.value))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(bad_field(LEAVES))
def test_property_bad_values_in_a_yaml_file(case):
    _refused_in_a_yaml_file(*case)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(bad_field(FEATURE_LEAVES))
def test_property_tools_cluster_and_moe_fields(case):
    """The same, drawn from the tools, cluster (colocation) and MoE fields only, so each gets many draws."""
    _refused_in_a_yaml_file(*case)


LAYOUT_KEYS = ("parallel.tensor_model_parallel_size", "parallel.pipeline_model_parallel_size",
               "rollout.tensor_parallel_size", "rollout.long_round_tensor_parallel_size", "rollout.num_workers")


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.tuples(st.sampled_from([1, 2, 4]), st.sampled_from([1, 2]), st.sampled_from([1, 2, 4, 8]),
                 st.sampled_from([1, 2, 4, 8]), st.integers(1, 8)))
def test_property_colocated_layouts_name_the_key_and_a_value_that_works(layout):
    """A colocated layout either loads, or its one line names the key that is wrong (one of the layout keys),
    never advises `at most 0`, and names an engine TP that does not divide the trainer's devices itself."""
    overrides = ["cluster.colocate=true"] + [f"{k}={v}" for k, v in zip(LAYOUT_KEYS, layout)]
    try:
        cfg = load_config(None, overrides)
    except ConfigError as err:
        message = str(err)
        assert err.key in LAYOUT_KEYS, message
        assert "at most 0" not in message and "\n" not in message, message
        tp, pp = layout[0], layout[1]
        if err.key.startswith("rollout.") and "tensor_parallel_size" in err.key and "heads" not in message:
            assert (tp * pp) % getattr(err, "value") != 0, message  # the TP named is the one that does not fit
        return
    world = cfg.parallel.world_size
    assert world % cfg.rollout.tensor_parallel_size == 0 and world % cfg.rollout.long_round_tensor_parallel_size == 0
    assert cfg.rollout.num_workers * cfg.rollout.tensor_parallel_size <= world


CHOICE_STRINGS = [(k, c) for k, typ, f in LEAVES if typ is str for c in f.metadata.get("choices") or () if c]


@pytest.mark.parametrize("key, choice", CHOICE_STRINGS)
def test_a_string_choice_typed_on_the_command_line_keeps_its_text(key, choice):
    """`key=choice` on the command line is that string, whatever YAML would read it as (`on` is not a
    boolean for rollout.return_routed_experts); a check across fields may still refuse it, naming it as text."""
    try:
        cfg = load_config(None, [f"{key}={choice}"])
    except ConfigError as err:
        assert err.key != key, str(err)
        return
    node = cfg
    for part in key.split("."):
        node = getattr(node, part)
    assert node == choice


def test_return_routed_experts_on_as_documented(tmp_path):
    """The documented value, on the command line and unquoted in a YAML file."""
    rc, lines = run_cli(["config", "rollout.return_routed_experts=on", "name=1e3"])
    assert rc == 0 and not lines
    assert load_config(None, ["rollout.return_routed_experts=on"]).rollout.return_routed_experts == "on"
    assert load_config(None, ["name=1e3"]).name == "1e3"
    path = tmp_path / "run.yaml"
    path.write_text("rollout:\n  return_routed_experts: off\n")
    assert load_config(path).rollout.return_routed_experts == "off"


def test_cli_subprocess_one_line_exit_2(tmp_path):
    """The installed entry point, as a new user runs it: the section given a scalar names its path."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "megatron_sortedrl", "config", "parallel.recompute=none"],
                          capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert "parallel.recompute='none'" in lines[0] and "parallel.recompute.granularity=none" in lines[0], lines[0]


@dataclass
class Inner:  # module level: the annotations are strings, resolved in this module's namespace
    size: int | None = help_field("A size or nothing.", None, min=1)


@dataclass
class Outer:
    inner: Inner = help_field("A section.", factory=Inner)
    ratio: float = help_field("A fraction.", 0.5, gt=0, lt=1)


def test_optional_and_nested_fields_of_any_schema():
    """The check is generic: a section declared anywhere (here a throwaway one) gets the same treatment,
    `X | None` included, so fields other sections add later need no code of their own."""
    from megatron_sortedrl.schema import build, defaults, merge, validate

    assert build(Outer, validate(Outer, merge(defaults(Outer), {"inner": {"size": None}}))).inner.size is None
    assert build(Outer, validate(Outer, merge(defaults(Outer), {"inner": {"size": "3"}}))).inner.size == 3
    for data, where in (({"inner": {"size": 0}}, "inner.size=0"), ({"inner": {"size": "abc"}}, "inner.size='abc'"),
                        ({"inner": 5}, "inner=5"), ({"ratio": {"a": 1}}, "ratio={'a': 1}"), ({"ratio": 1}, "ratio=1.0")):
        with pytest.raises(ConfigError, match=r"^config error: " + re.escape(where) + " is not allowed"):
            validate(Outer, merge(defaults(Outer), data))
