"""Tools: the calculator against Python's own arithmetic (hypothesis) and its bounds, the python tool on the
code sandbox (stdout comes back, a traceback comes back, a loop that never ends times out), the kv_store
environment, loading tools by name and dotted path, and the pre-run check of tools.* (one line naming the key).
CPU; the sandbox cases start real sandboxes (a few seconds)."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_sortedrl import preflight
from megatron_sortedrl.agentic.tools import (MAX_BITS, Calculator, KeyValueStore, PythonTool, ToolError, ToolSettings,
                                             calculate, format_number, load_tool, load_tools)
from megatron_sortedrl.errors import ConfigError, UserError

# Expressions whose every intermediate stays far below MAX_BITS (|literal| <= 10**30, exponents <= 3, depth
# <= 4: at most about 100 * 3**4 bits), so the calculator must agree with Python on every one.
_num = (st.integers(-10**30, 10**30).map(lambda n: f"({n})")
        | st.floats(-1e6, 1e6, allow_nan=False).map(lambda f: f"({f!r})"))
_ops = st.sampled_from(["+", "-", "*", "/", "//", "%"])


def _expr(depth: int):
    if depth == 0:
        return _num
    sub = _expr(depth - 1)
    return st.one_of(
        sub,
        st.tuples(sub, _ops, sub).map(lambda t: f"({t[0]} {t[1]} {t[2]})"),
        st.tuples(sub, st.integers(-2, 3)).map(lambda t: f"({t[0]}) ** {t[1]}"),
        sub.map(lambda e: f"-({e})"),
        st.tuples(sub, sub).map(lambda t: f"max({t[0]}, abs({t[1]}))"))


@settings(max_examples=400, deadline=None)
@given(expr=_expr(4))
def test_calculator_agrees_with_python(expr):
    try:
        want = eval(expr, {"__builtins__": {}, "abs": abs, "max": max})  # noqa: S307 - the reference
    except (ZeroDivisionError, OverflowError):
        with pytest.raises(ToolError):
            calculate(expr)
        return
    if isinstance(want, complex):
        with pytest.raises(ToolError, match="complex"):
            calculate(expr)
        return
    got = Calculator()({"expression": expr}, {})
    assert got == format_number(want)


def test_calculator_big_integers_are_exact():
    a, b = 123456789012345678901234567890, 987654321098765432109876543210
    assert Calculator()({"expression": f"{a} * {b} + 7 ** 200"}, {}) == str(a * b + 7 ** 200)


@pytest.mark.parametrize("expr, says", [
    ("10 ** 10 ** 9", f"more than {MAX_BITS} bits"),
    ("2 ** 20000", f"more than {MAX_BITS} bits"),
    ("(10 ** 3000) * (10 ** 3000)", f"more than {MAX_BITS} bits"),
    ("1 / 0", "division by zero"),
    ("(-8) ** 0.5", "complex"),
    ("__import__('os').system('true')", "is not allowed"),
    ("x + 1", "Name is not allowed"),
    ("'a' * 3", "'a' is not allowed"),
    ("2 <<  10000", "BinOp is not allowed"),
    ("1 +", "not an arithmetic expression"),
    ("1" * 3000, "at most 2000"),
])
def test_calculator_refuses_quickly_with_a_message(expr, says):
    t0 = time.monotonic()
    with pytest.raises(ToolError, match=says.replace("(", r"\(").replace("*", r"\*")) as err:
        calculate(expr)
    assert time.monotonic() - t0 < 1.0
    assert str(err.value).startswith("Error: ") and err.value.kind == "bad_arguments"


def test_python_tool_on_the_sandbox():
    tool = PythonTool(ToolSettings(timeout_s=20.0))  # generous: sandbox start-up on a loaded machine counts
    assert tool({"code": "import math\nprint(math.factorial(20))"}, {}) == "2432902008176640000\n"
    out = tool({"code": "print('before')\n1/0"}, {})
    assert out.startswith("before\n") and "ZeroDivisionError: division by zero" in out
    assert tool({"code": "x = 1"}, {}) == "(the program printed nothing)"
    tool, t0 = PythonTool(ToolSettings(timeout_s=3.0)), time.monotonic()
    with pytest.raises(ToolError, match="ran past its time limit of 1.5 s") as err:
        tool({"code": "print('spinning', flush=True)\nwhile True:\n    pass"}, {})
    assert err.value.kind == "timeout" and "spinning" in str(err.value)
    assert time.monotonic() - t0 < 10


def test_kv_store_is_seeded_from_the_row_and_changes_the_trajectory_state():
    kv, state = KeyValueStore(), {}
    kv.create(state, entries={"capital": "Paris", "year": 1999})
    assert kv({"op": "get", "key": "capital"}, state) == "Paris"
    assert kv({"op": "get", "key": "year"}, state) == "1999"
    assert kv({"op": "set", "key": "note", "value": "x"}, state) == "ok"
    assert kv({"op": "keys"}, state) == "capital, note, year"
    assert kv({"op": "delete", "key": "capital"}, state) == "Paris"
    assert kv({"op": "get", "key": "capital"}, state) == "no such key: capital"
    assert state == {"kv": {"year": "1999", "note": "x"}}
    with pytest.raises(ToolError, match="needs a \"value\""):
        kv({"op": "set", "key": "k"}, state)


def test_tools_load_by_builtin_name_function_and_class():
    tools = load_tools(["calculator", "agentic_support.counter", "agentic_support.Greeter"])
    assert list(tools) == ["calculator", "counter", "greet"]
    assert tools["greet"]({"who": "you"}, {}) == "hello you"
    assert tools["greet"].schema["type"] == "function"  # a bare schema is wrapped the OpenAI way
    assert tools["counter"].schema["function"]["parameters"]["type"] == "object"
    state = {}
    tools["counter"].create(state, start=5)
    assert tools["counter"]({}, state) == "6"


@pytest.mark.parametrize("tools, parser, key, says", [
    (["calculater"], "hermes", "tools.tools", "a built-in tool (calculator, python, kv_store)"),
    (["no_such_pkg_xyz.tool"], "hermes", "tools.tools", "import failed"),
    (["agentic_support.nothing_here"], "hermes", "tools.tools", "has no 'nothing_here'"),
    (["agentic_support.no_schema"], "hermes", "tools.tools", "no `schema` attribute"),
    (["calculator", "calculator"], "hermes", "tools.tools", "appears twice"),
    (["calculator"], "hermes2", "tools.parser", "one of hermes"),
    (["calculator"], "no_such_pkg_xyz.parse", "tools.parser", "import failed"),
    # Signatures as the runner calls them, and a parser's return, checked before the run, not at its first tool turn.
    (["agentic_support.no_state"], "hermes", "tools.tools",
     "a tool function (or __call__) taking (arguments, state); it takes (arguments)"),
    (["agentic_support.CreateWithoutState"], "hermes", "tools.tools", "a tool whose create takes (state); it takes ()"),
    (["agentic_support.BadSchema"], "hermes", "tools.tools", "\"parameters\" of bad_schema is not a JSON schema ("),
    (["calculator"], "agentic_support.parse_with_tools", "tools.parser",
     "a function taking (text); it takes (text, tools)"),
    (["calculator"], "agentic_support.parse_to_list", "tools.parser", "on an empty turn it returned list, not a Parsed"),
])
def test_preflight_names_the_bad_key_in_one_line(tools, parser, key, says):
    cfg = SimpleNamespace(tools=SimpleNamespace(tools=tools, parser=parser, timeout_s=5.0),
                          reward=SimpleNamespace(sandbox="auto"))
    with pytest.raises(ConfigError) as err:
        preflight.check_tools(cfg)
    msg = str(err.value)
    assert isinstance(err.value, UserError)  # the CLI prints it and exits 2
    assert msg.startswith(f"config error: {key}=") and says in msg and "\n" not in msg


def test_preflight_passes_good_tools():
    cfg = SimpleNamespace(tools=SimpleNamespace(tools=["calculator", "python", "kv_store", "agentic_support.echo"],
                                                parser="agentic_support.parse_shout", timeout_s=5.0),
                          reward=SimpleNamespace(sandbox="auto"))
    preflight.check_tools(cfg)
    assert load_tool("python", ToolSettings(timeout_s=10)).limit_s == 8.0
