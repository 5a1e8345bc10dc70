"""A stand-in for the tool side of trajectories (megatron_sortedrl/agentic/parsers.py and runner.py), kept in
tests only: it follows the written interface exactly (ToolCall, Parsed, a hermes parser, ToolOutcome and an
in-process ToolRunner with a calculator), so the trajectory code and its tests run before the real tools exist.

Left out: worker processes, timeouts and sandboxing (the real runner's); here a call runs at `submit`, and
`poll` returns the outcomes in submission order.
"""

from __future__ import annotations

import ast
import json
import operator
import re
import time
from dataclasses import dataclass, field

HERMES_STOP = "</tool_call>"


@dataclass
class ToolCall:
    name: str
    arguments: dict


@dataclass
class Parsed:
    calls: list[ToolCall]
    error: str = ""


def hermes(text: str) -> Parsed:
    blocks = re.findall(r"<tool_call>(.*?)</tool_call>", text, re.S)
    calls = []
    for b in blocks:
        try:
            obj = json.loads(b)
            calls.append(ToolCall(str(obj["name"]), dict(obj.get("arguments") or {})))
        except (ValueError, KeyError, TypeError) as exc:
            return Parsed([], f"malformed tool call: {exc}")
    return Parsed(calls)


_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def calculator(arguments: dict, state: dict) -> str:
    def ev(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        raise ValueError("unsupported expression")

    state["calls"] = state.get("calls", 0) + 1
    return str(ev(ast.parse(str(arguments.get("expr", "")), mode="eval").body))


@dataclass
class ToolOutcome:
    key: str
    contents: list[str]
    state: dict
    seconds: float
    errors: list[str] = field(default_factory=list)


class ToolRunner:
    def __init__(self, tools: dict | None = None) -> None:
        self.tools = tools or {"calculator": calculator}
        self.done: list[ToolOutcome] = []
        self.submitted: list[str] = []

    def schemas(self, names=None) -> list[dict]:
        return [{"type": "function", "function": {"name": n, "description": "evaluates + - * on integers",
                 "parameters": {"type": "object", "properties": {"expr": {"type": "string"}}}}}
                for n in self.tools if names is None or n in names]

    def submit(self, key: str, parsed: Parsed, state: dict) -> None:
        t0, state = time.monotonic(), json.loads(json.dumps(state))
        contents, errors = [], []
        if parsed.error:
            contents, errors = [parsed.error], ["malformed"]
        for call in parsed.calls:
            fn = self.tools.get(call.name)
            if fn is None:
                contents.append(f"error: unknown tool {call.name}")
                errors.append("unknown_tool")
                continue
            try:
                contents.append(fn(call.arguments, state))
            except Exception as exc:
                contents.append(f"error: {exc}")
                errors.append("crash")
        self.submitted.append(key)
        self.done.append(ToolOutcome(key, contents, state, time.monotonic() - t0, errors))

    def poll(self, timeout_s: float = 0.0) -> list[ToolOutcome]:
        out, self.done = self.done, []
        return out

    def __len__(self) -> int:
        return len(self.done)

    def close(self) -> None:
        self.done = []
