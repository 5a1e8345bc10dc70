"""Field validation derived from a dataclass schema: types from the annotations, ranges from field metadata.

    from megatron_sortedrl.schema import build, defaults, merge, validate
    data = merge(defaults(RunConfig), raw_dict)   # plain data over the defaults
    cfg = build(RunConfig, validate(RunConfig, data))   # checked and coerced, or one ConfigError

Every field of a config section is checked the same way, so a field added to any section is validated
without code of its own: a section (a dataclass) must be given a mapping of its own keys, a scalar field a
scalar of its annotated type (int, float, bool, str, list[...], dict[...]), and a number must lie in the
range its metadata declares (`min`, `max` inclusive; `gt`, `lt` exclusive), a string among its `choices`
(for a list, each item). The first problem raises a `ConfigError` whose one line names the dotted path,
the value and what is allowed. Coercion follows OmegaConf where it is unambiguous (an environment
variable's "4" for an int, 2 for a float, 7 for a str); anything else is refused rather than guessed.

A list of sections (`list[ToolKind]`) is checked item by item, each over its section's defaults.

`help_field` declares a field with its help and range; it lives here, beside what checks it, so a pure module
(the scheduling policies) can declare typed fields without importing the run config.

Left out: checks that relate several fields (max_difficulty >= min_difficulty, TP divides the heads):
those stay in each section's `__post_init__`, which runs after this pass.
"""

from __future__ import annotations

import copy
import math
import types
import typing
from dataclasses import MISSING, field, fields, is_dataclass
from functools import lru_cache
from typing import Any

from megatron_sortedrl.errors import ConfigError

# Field metadata keys that declare a range; `help_field(..., min=1)` writes them.
RANGE_KEYS = ("min", "max", "gt", "lt", "choices")


def help_field(text: str, default: Any = None, factory: Any = None, **checks: Any) -> Any:
    """A dataclass field with its one line of help (what `config --explain` prints) and its range, if any:
    `min`/`max` (inclusive), `gt`/`lt` (exclusive), `choices` (`validate` below checks them for
    every field when a config loads). Every config schema of the project declares its fields with it."""
    unknown = set(checks) - set(RANGE_KEYS)
    if unknown:
        raise TypeError(f"help_field: unknown check {sorted(unknown)}; use {', '.join(RANGE_KEYS)}")
    meta = {"help": text, **checks}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


_TRUE, _FALSE = ("true", "yes", "on"), ("false", "no", "off")


@lru_cache(maxsize=None)
def hints(cls: type) -> dict[str, Any]:
    """Resolved annotations of a dataclass (the schemas use `from __future__ import annotations`)."""
    return typing.get_type_hints(cls)


def default_of(f) -> Any:
    return f.default_factory() if f.default_factory is not MISSING else f.default


def validate(cls: type, raw: Any, path: str = "") -> dict[str, Any]:
    """`raw` checked against section `cls`; returns the coerced values (only the keys given)."""
    if not isinstance(raw, dict):
        raise _section_error(cls, raw, path)
    known = {f.name: f for f in fields(cls)}
    out: dict[str, Any] = {}
    for key, value in raw.items():
        dotted = f"{path}.{key}" if path else str(key)
        f = known.get(key)
        if f is None:
            raise ConfigError.unknown_key(dotted, ", ".join(known))
        typ = hints(cls)[key]
        if is_dataclass(typ):
            out[key] = validate(typ, value, dotted)
        else:
            out[key] = check_value(typ, value, dotted, f.metadata)
    return out


def check_value(typ: Any, value: Any, dotted: str, meta: typing.Mapping[str, Any] | None = None) -> Any:
    """One scalar field: its type, then its declared range; returns the coerced value."""
    meta = meta or {}
    origin = typing.get_origin(typ)
    if origin in (typing.Union, types.UnionType):  # `int | None`: null allowed, else the one other type
        args = [a for a in typing.get_args(typ) if a is not type(None)]
        if value is None and len(args) < len(typing.get_args(typ)):
            return None
        return check_value(args[0], value, dotted, meta) if len(args) == 1 else value
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(dotted, value, f"a list{_item_hint(meta)}, e.g. {dotted}=[a,b]")
        (item_t,) = typing.get_args(typ) or (Any,)
        if is_dataclass(item_t):  # a list of sections (a scenario's tool kinds): each item over its defaults,
            # named like a section (workload.tool_kinds.0.median_s), as the section's own checks name it
            return [validate(item_t, merge(defaults(item_t), v) if isinstance(v, dict) else v, f"{dotted}.{i}")
                    for i, v in enumerate(value)]
        return [check_value(item_t, v, f"{dotted}[{i}]", meta) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(dotted, value, "a mapping, e.g. {key: value}")
        return dict(value)
    if typ is Any:
        return value
    if isinstance(value, dict):
        raise ConfigError(dotted, value, f"{describe(typ, meta)}, not a section: {dotted} has no keys of its own")
    value = _coerce(typ, value, dotted, meta)
    _check_range(value, dotted, meta, typ)
    return value


def describe(typ: Any, meta: typing.Mapping[str, Any] | None = None) -> str:
    """What a field accepts, in words: 'a positive integer', 'a number in (0, 1]', 'one of a, b'."""
    meta = meta or {}
    if meta.get("choices"):
        return "one of " + ", ".join(map(str, meta["choices"]))
    noun = {int: "integer", float: "number", bool: "boolean (true or false)", str: "string"}.get(typ, str(typ))
    lo, hi, gt, lt = meta.get("min"), meta.get("max"), meta.get("gt"), meta.get("lt")
    if typ is int and lo == 1 and hi is None:
        return "a positive integer (>= 1)"
    if typ is float and gt == 0 and lt is None and hi is None:
        return "a positive number (> 0)"
    lower = f"[{lo}" if lo is not None else f"({gt}" if gt is not None else None
    upper = f"{hi}]" if hi is not None else f"{lt})" if lt is not None else None
    article = "an" if noun[0] in "aeiou" else "a"
    if lower and upper:
        return f"{article} {noun} in {lower}, {upper}"
    if lower:
        return f"{article} {noun} {'>=' if lo is not None else '>'} {lower[1:]}"
    if upper:
        return f"{article} {noun} {'<=' if hi is not None else '<'} {upper[:-1]}"
    return f"{article} {noun}"


def defaults(cls: type) -> dict[str, Any]:
    """The schema's defaults as plain data (sections as mappings, a fresh copy), without any validation."""
    return copy.deepcopy(_defaults(cls))


@lru_cache(maxsize=None)
def _defaults(cls: type) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in fields(cls):
        value = default_of(f)
        out[f.name] = _defaults(type(value)) if is_dataclass(value) else value
    return out


def merge(base: Any, update: Any) -> Any:
    """`update` over `base`, mappings merged key by key; anything else in `update` replaces (`validate` then
    tells a scalar given for a section, or a section given for a scalar, with its path)."""
    if isinstance(base, dict) and isinstance(update, dict):
        out = dict(base)
        for key, value in update.items():
            out[key] = merge(base[key], value) if key in base else value
        return out
    return update


def build(cls: type, data: dict[str, Any]) -> Any:
    """The dataclass tree of `validate`d plain data; each section's `__post_init__` runs, innermost first."""
    kwargs = {}
    for f in fields(cls):
        if f.name in data:
            typ = hints(cls)[f.name]
            item_t = (typing.get_args(typ) or (None,))[0] if typing.get_origin(typ) is list else None
            kwargs[f.name] = (build(typ, data[f.name]) if is_dataclass(typ) else
                              [build(item_t, d) for d in data[f.name]] if is_dataclass(item_t) else data[f.name])
    return cls(**kwargs)


def leaf_fields(cls: type, prefix: str = "") -> list[tuple[str, Any, Any]]:
    """(dotted key, annotated type, field) of every scalar field under `cls` (sections are descended)."""
    rows = []
    for f in fields(cls):
        typ = hints(cls)[f.name]
        if is_dataclass(typ):
            rows.extend(leaf_fields(typ, f"{prefix}{f.name}."))
        else:
            rows.append((prefix + f.name, typ, f))
    return rows


def section_paths(cls: type, prefix: str = "") -> list[tuple[str, type]]:
    """(dotted key, dataclass) of every section under `cls`."""
    rows = []
    for f in fields(cls):
        typ = hints(cls)[f.name]
        if is_dataclass(typ):
            rows.append((prefix + f.name, typ))
            rows.extend(section_paths(typ, f"{prefix}{f.name}."))
    return rows


# ------------------------------------------------------------------------------------------- internals


def _coerce(typ: Any, value: Any, dotted: str, meta: typing.Mapping[str, Any]) -> Any:
    want = describe(typ, meta)
    if value is None:
        if typ is str:
            return ""  # `key=` on the command line, or `key:` in YAML: the empty string
        raise ConfigError(dotted, value, f"{want}, not null")
    if isinstance(value, list):
        raise ConfigError(dotted, value, f"{want}, not a list")
    if typ is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
            return value.strip().lower() in _TRUE
        raise ConfigError(dotted, value, want)
    if typ is int:
        if isinstance(value, bool):
            raise ConfigError(dotted, value, want)
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(value.strip())
            except ValueError:
                pass
        raise ConfigError(dotted, value, want)
    if typ is float:
        if isinstance(value, bool):
            raise ConfigError(dotted, value, want)
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value.strip())
            except ValueError:
                pass
        raise ConfigError(dotted, value, want)
    if typ is str:
        if isinstance(value, str):
            return value
        if isinstance(value, bool):  # YAML reads an unquoted on/off/yes/no as a boolean: the choice so spelled
            spelled = [c for c in meta.get("choices") or () if str(c).lower() in (_TRUE if value else _FALSE)]
            if len(spelled) == 1:
                return spelled[0]
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)  # `name=2024`: YAML read a number where a name was meant
        raise ConfigError(dotted, value, want)
    return value


def _check_range(value: Any, dotted: str, meta: typing.Mapping[str, Any], typ: Any) -> None:
    choices = meta.get("choices")
    if choices and value not in choices:
        raise ConfigError(dotted, value, describe(typ, meta))
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return
    if math.isnan(value):  # NaN compares false with every bound and would pass them all
        raise ConfigError(dotted, value, describe(typ, meta))
    lo, hi, gt, lt = meta.get("min"), meta.get("max"), meta.get("gt"), meta.get("lt")
    if ((lo is not None and value < lo) or (hi is not None and value > hi) or (gt is not None and value <= gt)
            or (lt is not None and value >= lt)):
        raise ConfigError(dotted, value, describe(typ, meta))


def _item_hint(meta: typing.Mapping[str, Any]) -> str:
    return f" of {', '.join(map(str, meta['choices']))}" if meta.get("choices") else ""


def _section_error(cls: type, value: Any, path: str) -> ConfigError:
    names = [f.name for f in fields(cls)]
    hint = f"{path}.{names[0]}=..."
    for f in fields(cls):  # `parallel.recompute=none` most likely meant the sub-key that accepts `none`
        if not is_dataclass(hints(cls)[f.name]) and value in (f.metadata.get("choices") or ()):
            hint = f"{path}.{f.name}={value}"
            break
    where = path or "<config>"
    return ConfigError(where, value, f"a section with keys {', '.join(names)}, not a single value (set one key, "
                                     f"e.g. {hint})")
