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
import types
import typing
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_sortedrl.cli import main
from megatron_sortedrl.config import RunConfig, help_field, load_config
from megatron_sortedrl.errors import ConfigError
from megatron_sortedrl.schema import RANGE_KEYS, describe, leaf_fields, section_paths

REPO = Path(__file__).resolve().parent.parent
LEAVES = leaf_fields(RunConfig)
SECTIONS = section_paths(RunConfig)


def _kind(typ) -> str:
    """int, float, bool, str, list or dict (`X | None` counts as X); "other" for anything else."""
    args = [a for a in typing.get_args(typ) if a is not type(None)]
    if typing.get_origin(typ) in (typing.Union, types.UnionType) and len(args) == 1:
        return _kind(args[0])
    kind = {list: "list", dict: "dict"}.get(typing.get_origin(typ)) or getattr(typ, "__name__", str(typ))
    return kind if kind in WRONG_TYPE else "other"


WRONG_TYPE = {"int": ["abc", 1.5, [1], True], "float": ["abc", [0.5], False, "nan"], "bool": ["maybe", 3, [True]],
              "str": [[1], True], "list": ["x", 3], "dict": ["x", 3, [1]]}


def out_of_range(typ, meta) -> list:
    """Values just outside the declared range: the boundary of an open bound, one past a closed one."""
    values: list = []
    choices = meta.get("choices")
    if choices:
        values.append(["not_a_choice"] if _kind(typ) == "list" else "not_a_choice")
    step = 1 if typ is int else 0.5
    if meta.get("min") is not None:
        values.append(meta["min"] - step)
    if meta.get("max") is not None:
        values.append(meta["max"] + step)
    if meta.get("gt") is not None:
        values.append(meta["gt"])
    if meta.get("lt") is not None:
        values.append(meta["lt"])
    return values


def cases() -> list[tuple[str, str, object]]:
    rows = []
    for key, typ, f in LEAVES:
        rows += [(key, "wrong type", v) for v in WRONG_TYPE.get(_kind(typ), [])]
        rows += [(key, "out of range", v) for v in out_of_range(typ, f.metadata)]
        if _kind(typ) != "dict":
            rows.append((key, "section for a scalar", {"zz": 1}))
    for key, _ in SECTIONS:
        rows += [(key, "scalar for a section", v) for v in ("none", 3)]
    return rows


CASES = cases()


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
    assert len(LEAVES) > 150 and {k for k, _ in SECTIONS} >= {"model.tiny", "parallel.recompute", "sampling"}
    unbounded = [k for k, typ, f in LEAVES if typ in (int, float) and not any(f.metadata.get(r) is not None
                                                                               for r in RANGE_KEYS)]
    assert not unbounded, f"numeric fields without a declared range: {unbounded}"
    assert {k for k, _, _ in CASES} >= {k for k, _, _ in LEAVES} | {k for k, _ in SECTIONS}


BY_KEY: dict[str, list[tuple[str, object]]] = {}
for _key, _what, _value in CASES:
    BY_KEY.setdefault(_key, []).append((_what, _value))


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


_NUMERIC_LEAVES = [(k, t, f) for k, t, f in LEAVES if t in (int, float)]
_junk_text = st.text(alphabet=st.characters(codec="ascii", categories=["L"]), min_size=1, max_size=8).filter(
    lambda s: s.lower() not in ("true", "false", "yes", "no", "on", "off", "null", "inf", "infinity"))


@st.composite
def bad_field(draw):
    """A numeric field with a value outside its range, or any field with a value of the wrong type."""
    if draw(st.booleans()):
        key, typ, f = draw(st.sampled_from(_NUMERIC_LEAVES))
        m = f.metadata
        below = m.get("min") if m.get("min") is not None else m.get("gt")
        above = m.get("max") if m.get("max") is not None else m.get("lt")
        options = []
        if below is not None:
            lo = below - 1 if m.get("min") is not None else below
            options.append(st.integers(max_value=int(lo)) if typ is int else
                           st.floats(max_value=lo, allow_nan=False, allow_infinity=False,
                                     exclude_max=m.get("min") is not None))
        if above is not None:
            hi = above + 1 if m.get("max") is not None else above
            options.append(st.integers(min_value=int(hi)) if typ is int else
                           st.floats(min_value=hi, allow_nan=False, allow_infinity=False,
                                     exclude_min=m.get("max") is not None))
        return key, draw(st.one_of(options))
    key, typ, f = draw(st.sampled_from([leaf for leaf in LEAVES if _kind(leaf[1]) != "other"]))
    kind = _kind(typ)
    wrong = {"int": st.one_of(_junk_text, st.floats(allow_nan=False, allow_infinity=False).filter(
                 lambda x: not float(x).is_integer())),
             "float": _junk_text, "bool": st.one_of(_junk_text, st.integers()),
             "str": st.one_of(st.booleans(), st.lists(st.integers(), min_size=1)),
             "list": st.one_of(_junk_text, st.integers()), "dict": st.one_of(_junk_text, st.integers())}[kind]
    return key, draw(wrong)


def _nested(key: str, value) -> dict:
    node: dict = {}
    root = node
    parts = key.split(".")
    for part in parts[:-1]:
        node[part] = {}
        node = node[part]
    node[parts[-1]] = value
    return root


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(bad_field())
def test_property_bad_values_in_a_yaml_file(case):
    key, value = case
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "run.yaml"
        path.write_text(yaml.safe_dump(_nested(key, value)))
        with pytest.raises(ConfigError) as info:
            load_config(path)
    message = str(info.value)
    assert "\n" not in message and (f"{key}=" in message or f"{key}[" in message), (key, value, message)


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
