"""Tools that misbehave on purpose, for the tool runner's tests (loaded by dotted path in its worker
processes: `agentic_support.hang`; tests/ is on sys.path under pytest, and spawned workers inherit it)."""

from __future__ import annotations

import os
import time

from megatron_sortedrl.agentic.tools import function_schema


def _tool(name: str, properties: dict | None = None, required: list[str] | None = None):
    def wrap(fn):
        fn.schema = function_schema(name, f"test tool {name}", properties or {}, required or [])
        return fn
    return wrap


@_tool("echo", {"text": {"type": "string"}}, ["text"])
def echo(arguments: dict, state: dict) -> str:
    return arguments["text"]


@_tool("hang")
def hang(arguments: dict, state: dict) -> str:
    time.sleep(600)
    return "never"


@_tool("boom")
def boom(arguments: dict, state: dict) -> str:
    state["touched"] = True  # undone: a failed call changes nothing
    raise RuntimeError("the tool broke")


@_tool("die")
def die(arguments: dict, state: dict) -> str:
    os._exit(3)


@_tool("spam")
def spam(arguments: dict, state: dict) -> str:
    return "x" * 1_000_000


@_tool("bad_state")
def bad_state(arguments: dict, state: dict) -> str:
    state["handle"] = object()
    return "ok"


@_tool("counter")
def counter(arguments: dict, state: dict) -> str:
    """A stateful environment: counts calls per trajectory from a start the data row gives."""
    state["n"] = state["n"] + 1
    return str(state["n"])


def _counter_create(state: dict, start: int = 0) -> None:
    state["n"] = start


counter.create = _counter_create


class Greeter:
    """A tool written as a class (instantiated without arguments by the loader)."""

    name = "greet"
    schema = {"name": "greet", "description": "greets", "parameters": {
        "type": "object", "properties": {"who": {"type": "string"}}, "required": ["who"]}}

    def __call__(self, arguments: dict, state: dict) -> str:
        return f"hello {arguments['who']}"


def no_schema(arguments: dict, state: dict) -> str:
    return ""


def parse_shout(text: str):
    """A user parser: a turn `CALL name` calls `name` with no arguments."""
    from megatron_sortedrl.agentic.parsers import Parsed, ToolCall

    return Parsed([ToolCall(text.split()[1], {})]) if text.startswith("CALL ") else Parsed([])


# Extension points with the wrong signature or return (preflight refuses each in one line).
@_tool("no_state")
def no_state(arguments: dict) -> str:
    return ""


class CreateWithoutState:
    name = "create_without_state"
    schema = {"name": "create_without_state", "parameters": {"type": "object", "properties": {}}}

    def create(self) -> None:
        pass

    def __call__(self, arguments: dict, state: dict) -> str:
        return ""


class BadSchema:
    name = "bad_schema"
    schema = {"name": "bad_schema", "parameters": {"type": "object", "properties": {"x": {"type": "strng"}}}}

    def __call__(self, arguments: dict, state: dict) -> str:
        return ""


def parse_with_tools(text: str, tools: list):
    return parse_shout(text)


def parse_to_list(text: str):
    return []
