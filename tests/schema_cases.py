"""Bad values derived from a config schema, shared by tests/test_config_schema.py (the run config) and
tests/test_scenario_schema.py (the simulator's scenarios): for each scalar field a wrong type, a value just
outside its declared range (or choices) and a section where a scalar belongs; for each section a scalar; and
a hypothesis strategy that draws such values at random. Nothing here runs a test by itself."""

from __future__ import annotations

import types
import typing

from hypothesis import strategies as st

# Typed as `key=value` overrides: a string field keeps any scalar as text (`name=true` is the name "true"), so its
# wrong types are a list and a section; a boolean in a YAML file is drawn by `bad_field`.
WRONG_TYPE = {"int": ["abc", 1.5, [1], True], "float": ["abc", [0.5], False, "nan"], "bool": ["maybe", 3, [True]],
              "str": [[1]], "list": ["x", 3], "dict": ["x", 3, [1]]}


def kind(typ) -> str:
    """int, float, bool, str, list or dict (`X | None` counts as X); "other" for anything else."""
    args = [a for a in typing.get_args(typ) if a is not type(None)]
    if typing.get_origin(typ) in (typing.Union, types.UnionType) and len(args) == 1:
        return kind(args[0])
    name = {list: "list", dict: "dict"}.get(typing.get_origin(typ)) or getattr(typ, "__name__", str(typ))
    return name if name in WRONG_TYPE else "other"


def out_of_range(typ, meta) -> list:
    """Values just outside the declared range: the boundary of an open bound, one past a closed one."""
    values: list = []
    choices = meta.get("choices")
    if choices:
        values.append(["not_a_choice"] if kind(typ) == "list" else "not_a_choice")
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


def cases(leaves, sections) -> list[tuple[str, str, object]]:
    """(dotted key, what is wrong, value) for every leaf and section of a schema."""
    rows = []
    for key, typ, f in leaves:
        rows += [(key, "wrong type", v) for v in WRONG_TYPE.get(kind(typ), [])]
        rows += [(key, "out of range", v) for v in out_of_range(typ, f.metadata)]
        if kind(typ) != "dict":
            rows.append((key, "section for a scalar", {"zz": 1}))
    for key, _ in sections:
        rows += [(key, "scalar for a section", v) for v in ("none", 3)]
    return rows


def unbounded(leaves) -> list[str]:
    """Numeric fields that declare no range (every one should)."""
    return [k for k, typ, f in leaves if typ in (int, float) and not any(
        f.metadata.get(r) is not None for r in ("min", "max", "gt", "lt", "choices"))]


def by_key(rows) -> dict[str, list[tuple[str, object]]]:
    out: dict[str, list[tuple[str, object]]] = {}
    for key, what, value in rows:
        out.setdefault(key, []).append((what, value))
    return out


BOOL_WORDS = ("true", "false", "yes", "no", "on", "off")
_junk_text = st.text(alphabet=st.characters(codec="ascii", categories=["L"]), min_size=1, max_size=8).filter(
    lambda s: s.lower() not in (*BOOL_WORDS, "null", "inf", "infinity"))


def bad_field(leaves):
    """A strategy: (key, value) with a numeric field of `leaves` outside its range, or any field of the wrong type."""
    numeric = [(k, t, f) for k, t, f in leaves if t in (int, float) and any(
        f.metadata.get(r) is not None for r in ("min", "max", "gt", "lt"))]
    typed = [leaf for leaf in leaves if kind(leaf[1]) != "other"]

    @st.composite
    def draw_case(draw):
        if numeric and draw(st.booleans()):
            key, typ, f = draw(st.sampled_from(numeric))
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
        key, typ, f = draw(st.sampled_from(typed))
        # YAML's unquoted on/off is a boolean, which a string field whose choices include on/off takes as that choice
        spells_bool = any(str(c).lower() in BOOL_WORDS for c in f.metadata.get("choices") or ())
        wrong = {"int": st.one_of(_junk_text, st.floats(allow_nan=False, allow_infinity=False).filter(
                     lambda x: not float(x).is_integer())),
                 "float": _junk_text, "bool": st.one_of(_junk_text, st.integers()),
                 "str": st.lists(st.integers(), min_size=1) if spells_bool else
                        st.one_of(st.booleans(), st.lists(st.integers(), min_size=1)),
                 "list": st.one_of(_junk_text, st.integers()), "dict": st.one_of(_junk_text, st.integers())}[kind(typ)]
        return key, draw(wrong)

    return draw_case()


def nested(key: str, value) -> dict:
    """{"a": {"b": value}} for key "a.b": what a YAML file setting that key holds."""
    node: dict = {}
    root = node
    parts = key.split(".")
    for part in parts[:-1]:
        node[part] = {}
        node = node[part]
    node[parts[-1]] = value
    return root


def names_key(message: str, key: str) -> bool:
    """The one line names the dotted key with its value (`key=...`, or `key[i]=...` for a list item)."""
    return "\n" not in message and (f"{key}=" in message or f"{key}[" in message)
