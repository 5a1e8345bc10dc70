"""The tool interface, the built-in tools, and loading tools by name or dotted path.

    from megatron_sortedrl.agentic.tools import load_tools, ToolSettings
    tools = load_tools(["calculator", "python", "my_pkg.tools.search"], ToolSettings(timeout_s=10))
    tools["calculator"]({"expression": "12345678901234567890 * 98765"}, state={})   # -> "1219318..."

A tool is an object with
    name: str                                   # what the model calls it
    schema: dict                                # OpenAI-style {"type": "function", "function": {"name",
                                                #   "description", "parameters": <JSON schema>}} for the prompt
    __call__(arguments: dict, state: dict) -> str
    create(state: dict, **kwargs) -> None       # optional: sets up the trajectory's state from the data row
`arguments` are the call's (already checked against `schema`'s parameters by the runner); `state` is the
trajectory's own dict, JSON-able, shared by its tools and kept across its turns: a tool reads and changes it
(a stateful environment). `create` runs once per trajectory, in the tool's worker, before that tool's first
call, with the row's keyword arguments for it: `state["tools_kwargs"][name]` (verl's per-row `tools_kwargs`
layout, `{"create_kwargs": {...}}`, or the keyword dict itself). A tool raising `ToolError(message, kind)`
answers with `message` and counts the call as failed with `kind`; any other exception is a crash.

User tools by dotted path: a function with a `schema` attribute (and optionally a `create` attribute), a
class (instantiated without arguments), or an instance. Built-ins (`BUILTINS`): `calculator` (arithmetic on
big integers and floats, bounded), `python` (runs the code on the code reward's sandbox, `rewards/sandbox.py`,
and answers with its output), `kv_store` (a per-trajectory key-value store seeded from the row: the example of
a stateful environment whose facts the model can only read through the tool).

The calculator is written here with Python's `ast` and a whitelist of nodes: `simpleeval` is not in our
environment and bounds only exponents, not the size of every intermediate big integer.
Left out: verl's `execute_kwargs` and `release` hooks; async tools (a call is a plain function call in a
worker process). Tests: `python -m pytest tests/test_agentic_tools.py -q`.
"""

from __future__ import annotations

import ast
import inspect
import operator
from dataclasses import dataclass
from typing import Any, Callable

from megatron_sortedrl.errors import ConfigError, check_signature, exception_line, import_dotted

# The kinds a failed call is counted as (ToolOutcome.errors); bad_arguments: the arguments do not fit the
# tool's schema, or the tool refused them with a ToolError.
ERROR_KINDS = ("timeout", "crash", "too_long", "malformed", "unknown_tool", "bad_arguments")


class ToolError(Exception):
    """Raised by a tool to answer with `message` as a failed call of `kind` (one of ERROR_KINDS)."""

    def __init__(self, message: str, kind: str = "bad_arguments") -> None:
        super().__init__(message)
        self.kind = kind if kind in ERROR_KINDS else "crash"


@dataclass
class ToolSettings:
    """What the built-ins take from the run config (tools.timeout_s, reward.sandbox)."""

    timeout_s: float = 10.0  # one call's limit; the python tool stops its program a little before it
    sandbox: str = "auto"  # auto | bwrap | fallback (rewards/sandbox.py)


def function_schema(name: str, description: str, properties: dict, required: list[str]) -> dict:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": properties, "required": required, "additionalProperties": False}}}


# ---------------------------------------------------------------- calculator

MAX_BITS = 13_000  # about 3,900 digits: below Python's 4,300-digit int-to-text limit, and quick to compute
MAX_EXPRESSION_CHARS = 2_000
_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_FUNCTIONS: dict[str, Callable[..., Any]] = {"abs": abs, "min": min, "max": max}


def calculate(expression: str) -> int | float:
    """The value of an arithmetic expression (+ - * / // % ** and parentheses on ints and floats, abs, min,
    max), exactly as Python computes it; ToolError when it is not one, or when any intermediate integer would
    pass MAX_BITS (checked before a power is computed, so 10**10**9 is refused at once)."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ToolError(f"Error: the expression is {len(expression)} characters long; at most "
                        f"{MAX_EXPRESSION_CHARS} are allowed.")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError) as exc:
        why = exc.msg if isinstance(exc, SyntaxError) else exc
        raise ToolError(f"Error: not an arithmetic expression ({why}).") from None
    try:
        value = _eval(tree.body)
    except ZeroDivisionError:
        raise ToolError("Error: division by zero.") from None
    except OverflowError:
        raise ToolError("Error: the result is too large for a floating-point number.") from None
    if isinstance(value, complex):
        raise ToolError("Error: the result is a complex number (a fractional power of a negative number).")
    return value


def _check_size(value: Any) -> Any:
    if isinstance(value, int) and value.bit_length() > MAX_BITS:
        raise ToolError(f"Error: an intermediate result has more than {MAX_BITS} bits; the calculator stops there.")
    return value


def _eval(node: ast.AST) -> Any:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _check_size(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and isinstance(left, int) and isinstance(right, int) and right > 0:
            # |left| ** right has more than (bits(left) - 1) * right bits: refuse before computing it.
            if (abs(left).bit_length() - 1) * right >= MAX_BITS:
                _check_size(1 << MAX_BITS)
        return _check_size(_BINARY[type(node.op)](left, right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCTIONS
            and not node.keywords and node.args):
        return _check_size(_FUNCTIONS[node.func.id](*[_eval(a) for a in node.args]))
    what = type(node).__name__ if not isinstance(node, ast.Constant) else repr(node.value)
    raise ToolError(f"Error: {what} is not allowed; use numbers, + - * / // % **, parentheses, abs, min, max.")


def format_number(value: int | float) -> str:
    return str(value) if isinstance(value, int) else repr(value)


class Calculator:
    name = "calculator"
    schema = function_schema(
        "calculator", "Evaluates an arithmetic expression exactly (integers of any size up to about 3,900 digits, "
        "floats): + - * / // % ** parentheses abs min max.",
        {"expression": {"type": "string", "description": "e.g. (123456789 * 987654321) // 7"}}, ["expression"])

    def __call__(self, arguments: dict, state: dict) -> str:
        return format_number(calculate(arguments["expression"]))


# ---------------------------------------------------------------- python on the sandbox

class PythonTool:
    """Runs the model's code in a fresh sandbox (rewards/sandbox.py) and answers with what it printed; an
    exception in the code is an answer too (its traceback), so the model can fix it. The program is stopped
    a little before the call's own limit (sandbox start-up counts against it), and then answers with a timeout."""

    name = "python"
    schema = function_schema(
        "python", "Runs a Python 3 program (standard library only, no network, no files outside its own directory) "
        "and returns what it printed. Print the values you need.",
        {"code": {"type": "string", "description": "the whole program"}}, ["code"])
    STDERR_LINES = 20  # of a failing program's stderr, the last lines (the traceback's end)

    def __init__(self, settings: ToolSettings | None = None) -> None:
        self.settings = settings or ToolSettings()
        self.limit_s = max(0.5 * self.settings.timeout_s, self.settings.timeout_s - 2.0)
        self._box = None  # made at the first call, in the worker: probing bubblewrap starts a process

    def __call__(self, arguments: dict, state: dict) -> str:
        if self._box is None:
            from megatron_sortedrl.rewards.sandbox import Sandbox

            self._box = Sandbox(mode=self.settings.sandbox)
        res = self._box.run({"main.py": arguments["code"]}, "main.py", timeout_s=self.limit_s)
        if res.status == "timeout":
            raise ToolError(f"Error: the program ran past its time limit of {self.limit_s:g} s and was stopped."
                            + (f" It printed before that:\n{res.stdout}" if res.stdout else ""), "timeout")
        out = res.stdout
        if res.status != "ok":
            tail = "\n".join(res.stderr.rstrip().splitlines()[-self.STDERR_LINES:])
            sep = "\n" if out and not out.endswith("\n") else ""
            out += sep + (tail or f"Error: the program ended: {res.status}")
        return out if out else "(the program printed nothing)"


# ---------------------------------------------------------------- a stateful environment

class KeyValueStore:
    """A per-trajectory key-value store: `create` seeds it from the row (`{"entries": {...}}`), so a row can hold
    facts that only this tool reveals; `get`, `set`, `delete` and `keys` read and change the trajectory's copy
    (`state["kv"]`), which later turns and the reward function see."""

    name = "kv_store"
    schema = function_schema(
        "kv_store", "A key-value store: get a key's value, set it, delete it, or list the keys.",
        {"op": {"type": "string", "enum": ["get", "set", "delete", "keys"]},
         "key": {"type": "string"}, "value": {"type": "string"}}, ["op"])

    def create(self, state: dict, entries: dict | None = None) -> None:
        state["kv"] = {str(k): str(v) for k, v in (entries or {}).items()}

    def __call__(self, arguments: dict, state: dict) -> str:
        kv = state.setdefault("kv", {})
        op, key = arguments["op"], arguments.get("key")
        if op == "keys":
            return ", ".join(sorted(kv)) or "(empty)"
        if key is None:
            raise ToolError(f"Error: kv_store op {op} needs a \"key\".")
        if op == "set":
            if "value" not in arguments:
                raise ToolError("Error: kv_store op set needs a \"value\".")
            kv[key] = arguments["value"]
            return "ok"
        if key not in kv:
            return f"no such key: {key}"
        return kv.pop(key) if op == "delete" else kv[key]


# ---------------------------------------------------------------- loading

BUILTINS: dict[str, Callable[[ToolSettings], Any]] = {
    "calculator": lambda s: Calculator(),
    "python": PythonTool,
    "kv_store": lambda s: KeyValueStore(),
}


class FunctionTool:
    """A plain function `fn(arguments, state) -> str` with a `schema` attribute (and optional `create`)."""

    def __init__(self, fn: Callable[[dict, dict], str]) -> None:
        self.fn, self.schema = fn, fn.schema  # type: ignore[attr-defined]
        self.name = self.schema.get("function", self.schema).get("name") or fn.__name__
        create = getattr(fn, "create", None)
        if create is not None:
            self.create = create

    def __call__(self, arguments: dict, state: dict) -> str:
        return self.fn(arguments, state)


def load_tool(ref: str, settings: ToolSettings | None = None, key: str = "tools.tools") -> Any:
    """A built-in name or a dotted path to a tool; a bad one is a ConfigError naming `key`."""
    settings = settings or ToolSettings()
    if ref in BUILTINS:
        return BUILTINS[ref](settings)
    allowed = (f"a built-in tool ({', '.join(BUILTINS)}) or a dotted path module.attr to a function with a "
               "`schema` attribute, a tool class or a tool instance")
    obj = import_dotted(key, ref, allowed)
    try:
        tool = obj() if inspect.isclass(obj) else FunctionTool(obj) if inspect.isfunction(obj) else obj
    except AttributeError:
        raise ConfigError(key, ref, f"{allowed} (the function has no `schema` attribute)") from None
    except Exception as exc:  # noqa: BLE001 - a user class whose constructor fails: one line, not a traceback
        raise ConfigError(key, ref, f"{allowed} (creating it failed: {exception_line(exc)})") from None
    tool = _checked(tool, ref, key, allowed)
    # As the runner calls them: tool(arguments, state) per call, tool.create(state, **row kwargs) per trajectory.
    call = tool.fn if isinstance(tool, FunctionTool) else tool
    check_signature(call, key, ref, "arguments, state", "a tool function (or __call__) taking")
    if callable(getattr(tool, "create", None)):
        check_signature(tool.create, key, ref, "state", "a tool whose create takes")
    return tool


def _checked(tool: Any, ref: str, key: str, allowed: str) -> Any:
    schema = getattr(tool, "schema", None)
    if not isinstance(getattr(tool, "name", None), str) or not callable(tool) or not isinstance(schema, dict):
        raise ConfigError(key, ref, f"{allowed} (it needs a `name`, a `schema` dict and to be callable)")
    if "function" not in schema:  # a bare {"name", "description", "parameters"}: wrapped the OpenAI way
        tool.schema = schema = {"type": "function", "function": schema}
    try:
        name = schema_name(schema)
    except ValueError as exc:
        raise ConfigError(key, ref, f"a tool with an OpenAI-style schema ({exc})") from None
    if name != tool.name:
        raise ConfigError(key, ref, f"a tool whose schema names it as its `name` ({tool.name!r}, schema: {name!r})")
    schema["function"].setdefault("parameters", {"type": "object", "properties": {}})
    return tool


def schema_name(schema: dict) -> str:
    """The function name of a tool schema, OpenAI-style `{"type": "function", "function": {"name", "description",
    "parameters"}}` or the bare inner object; ValueError saying what is wrong with its shape (a tool's own schema,
    and a data row's `tools` entry, data/loaders.py)."""
    from jsonschema import Draft202012Validator, SchemaError

    fn = schema.get("function", schema)
    if not isinstance(fn, dict):
        raise ValueError(f"\"function\" is a {type(fn).__name__}, expected an object with \"name\" and \"parameters\"")
    if "function" in schema and schema.get("type", "function") != "function":
        raise ValueError(f"\"type\" is {schema.get('type')!r}, expected \"function\"")
    name = fn.get("name")
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"\"name\" is {name!r}, expected the tool's name (a non-empty string)")
    if not isinstance(fn.get("description", ""), str):
        raise ValueError(f"\"description\" of {name} is a {type(fn['description']).__name__}, expected a string")
    params = fn.get("parameters", {"type": "object"})
    if not isinstance(params, dict) or params.get("type", "object") != "object":
        raise ValueError(f"\"parameters\" of {name} is {params!r:.60}, expected a JSON schema of type object (the "
                         "call's arguments)")
    try:
        Draft202012Validator.check_schema(params)
    except SchemaError as exc:
        raise ValueError(f"\"parameters\" of {name} is not a JSON schema ({exc.message:.120})") from None
    return name


def load_tools(refs: list[str], settings: ToolSettings | None = None) -> dict[str, Any]:
    """{tool name: tool} for the configured refs, in order; two tools with one name are a config error."""
    tools: dict[str, Any] = {}
    for ref in refs:
        tool = load_tool(ref, settings)
        if tool.name in tools:
            raise ConfigError("tools.tools", refs, f"tools with distinct names ({tool.name!r} appears twice)")
        tools[tool.name] = tool
    return tools


def check_tools(tools_cfg: Any, sandbox: str = "auto") -> None:
    """Before a run (preflight): every tool loads and the parser exists, else a ConfigError naming the key."""
    from megatron_sortedrl.agentic.parsers import parser_from

    parser_from(tools_cfg.parser)
    load_tools(list(tools_cfg.tools), ToolSettings(float(tools_cfg.timeout_s), sandbox))


def create_kwargs(state: dict, name: str) -> dict:
    """The row's keyword arguments for tool `name`'s `create` (verl's `create_kwargs` or the dict itself)."""
    kw = (state.get("tools_kwargs") or {}).get(name) or {}
    return dict(kw.get("create_kwargs", kw)) if isinstance(kw, dict) else {}
