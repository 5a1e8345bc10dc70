"""Reading tool calls out of an assistant turn, and writing them back (the same format).

    from megatron_sortedrl.agentic.parsers import parser_from, render_calls, ToolCall
    parse = parser_from("hermes")                 # or "my_pkg.parsers.parse" (a function: str -> Parsed)
    parsed = parse(turn_text)
    parsed.calls                                  # [ToolCall(name, arguments), ...] in the order written
    parsed.error                                  # a malformed call: the tool message that says what was wrong
    render_calls([ToolCall("calculator", {"expression": "2+2"})])   # the text a model would have written

The hermes format is what Qwen2/2.5/3 and Hermes chat templates emit and render: each call is
`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, several per turn allowed, free text around
them ignored. "arguments" may be an object or a JSON string of one (some models emit that); a missing
"arguments" is `{}` (a tool without parameters). A turn is all or nothing: one malformed call (bad JSON, no
name, arguments that are not an object, an unclosed or unopened tag) makes the whole turn
`Parsed(calls=[], error=...)`, whose text the runner sends back as the tool message, so the model sees what
it got wrong instead of a silently dropped call. No tag at all: a final answer (`Parsed([], "")`).

A turn generated with `HERMES_STOP` as a stop string ends at the first call's closing tag, so it holds one
call; the engine must then keep the stop string in the text (vLLM: `include_stop_str_in_output=True`), or
the call reads as an unclosed tag. Several calls per turn need the turn to end at the end-of-turn token.

Written here (a regex and `json`): the hermes parsers of vLLM and the chat libraries are tied to their own
request objects and streaming state. Left out: other formats (Llama-3 JSON, Mistral `[TOOL_CALLS]`); a
dotted path to your own parser covers them. Tests: `python -m pytest tests/test_agentic_parsers.py -q`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Callable

from megatron_sortedrl.errors import ConfigError, check_signature, exception_line, import_dotted

HERMES_STOP = "</tool_call>"  # stop string that ends a turn that called a tool
_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_TAG = re.compile(r"<tool_call>|</tool_call>")
_FORMAT_HINT = 'Write each call as <tool_call>{"name": "<tool name>", "arguments": {...}}</tool_call>.'


@dataclass
class ToolCall:
    name: str  # the tool's name, as the model wrote it (the runner checks it exists)
    arguments: dict = field(default_factory=dict)  # JSON object of the call's arguments


@dataclass
class Parsed:
    calls: list[ToolCall]  # empty with error "": the turn is a final answer
    error: str = ""  # a malformed call: the defined tool message text for it


def _malformed(what: str) -> Parsed:
    return Parsed(calls=[], error=f"Error: malformed tool call: {what}. {_FORMAT_HINT}")


def parse_hermes(text: str) -> Parsed:
    """The calls of one assistant turn in the hermes format (see the module docstring)."""
    bodies: list[str] = []
    opened = -1  # offset after the open tag of the call being read, -1 outside a call
    for m in _TAG.finditer(text):
        if m.group() == _OPEN:
            if opened >= 0:
                return _malformed(f"call {len(bodies) + 1} opens <tool_call> again before its </tool_call>")
            opened = m.end()
        else:
            if opened < 0:
                return _malformed(f"a </tool_call> without its <tool_call> (after {len(bodies)} calls)")
            bodies.append(text[opened:m.start()])
            opened = -1
    if opened >= 0:
        return _malformed(f"call {len(bodies) + 1} has <tool_call> but no closing </tool_call>")
    calls = []
    for i, body in enumerate(bodies, 1):
        call = _call_from_json(body, i)
        if isinstance(call, Parsed):
            return call
        calls.append(call)
    return Parsed(calls=calls)


def _call_from_json(body: str, i: int) -> ToolCall | Parsed:
    try:
        obj = json.loads(body)
    except ValueError as exc:
        return _malformed(f"call {i} is not valid JSON ({exc})")
    if not isinstance(obj, dict):
        return _malformed(f"call {i} is a JSON {type(obj).__name__}, not an object with \"name\" and \"arguments\"")
    name = obj.get("name")
    if not isinstance(name, str) or not name.strip():
        return _malformed(f"call {i} has no \"name\" (a non-empty string naming the tool)")
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string of an object
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError as exc:
            return _malformed(f"call {i} ({name}) has \"arguments\" as a string that is not JSON ({exc})")
    if not isinstance(args, dict):
        return _malformed(f"call {i} ({name}) has \"arguments\" that is a JSON {type(args).__name__}, not an object")
    return ToolCall(name=name, arguments=args)


def render_calls(calls: list[ToolCall], content: str = "") -> str:
    """The text of an assistant turn with `content` and then `calls`, as Qwen's chat template renders them
    (for tests and warm-start data): parse_hermes(render_calls(calls)).calls == calls."""
    parts = [content] if content else []
    for c in calls:
        body = json.dumps({"name": c.name, "arguments": c.arguments}, ensure_ascii=False)
        # A tag inside a JSON string would end the call early: written as the equivalent \u003c escape.
        body = body.replace(_OPEN, "\\u003ctool_call>").replace(_CLOSE, "\\u003c/tool_call>")
        parts.append(f"{_OPEN}\n{body}\n{_CLOSE}")
    return "\n".join(parts)


PARSERS: dict[str, Callable[[str], Parsed]] = {"hermes": parse_hermes}


def parser_from(name: str) -> Callable[[str], Parsed]:
    """'hermes' or a dotted path `package.module.function` to a function `(text: str) -> Parsed`; anything
    else is a config error naming tools.parser."""
    if name in PARSERS:
        return PARSERS[name]
    allowed = f"one of {', '.join(PARSERS)} or a dotted path to a function (text) -> Parsed"
    fn = import_dotted("tools.parser", name, allowed)
    if not callable(fn):
        raise ConfigError("tools.parser", name, f"{allowed} ('{name}' is not a function)")
    check_signature(fn, "tools.parser", name, "text")
    # One call on an empty turn (a final answer without calls), so a parser that fails or returns something
    # other than a Parsed is refused now, not at the first tool turn of a run.
    try:
        probe = fn("")
    except Exception as exc:  # noqa: BLE001 - the user's parser failing: one line, not a traceback
        raise ConfigError("tools.parser", name, f"{allowed} (calling it on an empty turn failed: "
                                                f"{exception_line(exc)})") from None
    if not (isinstance(getattr(probe, "calls", None), list) and isinstance(getattr(probe, "error", None), str)):
        raise ConfigError("tools.parser", name, f"{allowed} (on an empty turn it returned {type(probe).__name__}, "
                                                "not a Parsed with a `calls` list and an `error` string)")
    return fn
