"""Tool-call parsing (hermes format): rendered calls parse back to the same calls (hypothesis), arguments
given as a JSON string are read, and each kind of malformed call gives the defined tool message with no
calls. Pure Python, CPU, about a second."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_sortedrl.agentic.parsers import HERMES_STOP, Parsed, ToolCall, parse_hermes, parser_from, render_calls
from megatron_sortedrl.errors import ConfigError, UserError

_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(), inner, max_size=3), max_leaves=8)
_calls = st.lists(st.builds(ToolCall, name=st.text(min_size=1).filter(str.strip),
                            arguments=st.dictionaries(st.text(), _json, max_size=4)), max_size=4)
_free_text = st.text().filter(lambda t: "<tool_call>" not in t and "</tool_call>" not in t)


@settings(max_examples=300, deadline=None)
@given(calls=_calls, content=_free_text)
def test_render_then_parse_gives_the_same_calls(calls, content):
    parsed = parse_hermes(render_calls(calls, content))
    assert parsed.error == ""
    assert parsed.calls == calls


def test_tags_inside_arguments_survive_the_round_trip():
    calls = [ToolCall("python", {"code": "print('<tool_call>x</tool_call>')"})]
    assert parse_hermes(render_calls(calls)).calls == calls


def test_a_qwen_turn_with_two_calls_and_text_around_them():
    text = ('Let me compute both.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "2**64"}}\n'
            '</tool_call>\n<tool_call>\n{"name": "kv_store", "arguments": "{\\"op\\": \\"keys\\"}"}\n</tool_call>')
    assert parse_hermes(text) == Parsed([ToolCall("calculator", {"expression": "2**64"}),
                                         ToolCall("kv_store", {"op": "keys"})])
    assert text.endswith(HERMES_STOP)


def test_no_tag_is_a_final_answer_and_missing_arguments_are_empty():
    assert parse_hermes("The answer is 42.") == Parsed([], "")
    assert parse_hermes('<tool_call>{"name": "now"}</tool_call>').calls == [ToolCall("now", {})]


@pytest.mark.parametrize("text, says", [
    ('<tool_call>{"name": "calc", "arguments": {"x": 1}</tool_call>', "call 1 is not valid JSON"),
    ('<tool_call>{"arguments": {}}</tool_call>', 'call 1 has no "name"'),
    ('<tool_call>{"name": "", "arguments": {}}</tool_call>', 'call 1 has no "name"'),
    ('<tool_call>{"name": "calc", "arguments": [1, 2]}</tool_call>', '"arguments" that is a JSON list'),
    ('<tool_call>{"name": "calc", "arguments": "[1]"}</tool_call>', '"arguments" that is a JSON list'),
    ('<tool_call>{"name": "calc", "arguments": "{oops"}</tool_call>', "a string that is not JSON"),
    ('<tool_call>["calc"]</tool_call>', "a JSON list, not an object"),
    ('<tool_call>{"name": "a"}</tool_call>\n<tool_call>{"name": "calc", "arguments": {}',
     "call 2 has <tool_call> but no closing"),
    ('thinking</tool_call>', "a </tool_call> without its <tool_call>"),
    ('<tool_call>{"name": "a"}<tool_call>{"name": "b"}</tool_call>', "opens <tool_call> again"),
])
def test_malformed_calls_give_the_defined_message_and_no_calls(text, says):
    parsed = parse_hermes(text)
    assert parsed.calls == []
    assert parsed.error.startswith("Error: malformed tool call: ") and says in parsed.error
    assert '<tool_call>{"name": "<tool name>", "arguments": {...}}</tool_call>' in parsed.error  # how to fix it


def test_one_bad_call_makes_the_whole_turn_malformed():
    good = render_calls([ToolCall("echo", {"text": "hi"})])
    parsed = parse_hermes(good + '\n<tool_call>{"name": 3}</tool_call>')
    assert parsed.calls == [] and 'call 2 has no "name"' in parsed.error


def test_parser_from_builtin_dotted_path_and_bad_names():
    assert parser_from("hermes") is parse_hermes
    shout = parser_from("agentic_support.parse_shout")
    assert shout("CALL echo") == Parsed([ToolCall("echo", {})])
    for bad, says in (("nope", "one of hermes"), ("no_such_module_xyz.parse", "import failed"),
                      ("agentic_support.missing_fn", "has no 'missing_fn'")):
        with pytest.raises(ConfigError) as err:
            parser_from(bad)
        assert isinstance(err.value, UserError)  # the CLI prints it in one line and exits 2
        assert "tools.parser" in str(err.value) and says in str(err.value) and "\n" not in str(err.value)


def test_rendered_text_is_what_qwen_templates_write():
    text = render_calls([ToolCall("calculator", {"expression": "1+1"})], "Sure.")
    assert text == 'Sure.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "1+1"}}\n</tool_call>'
    assert json.loads(text.split("\n")[2])["name"] == "calculator"
