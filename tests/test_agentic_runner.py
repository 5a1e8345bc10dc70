"""The tool runner: each failure (timeout, crash, a tool that kills its worker, a too-long answer, a malformed
call, an unknown tool, bad arguments, a state that is not JSON) gives its defined tool message and error kind,
the turn's other calls still run, every submit gets exactly one outcome, and the runner keeps working after;
per-trajectory state reaches stateful tools; close() leaves no process behind. Real spawned worker processes
and the real code sandbox on CPU; about 20 seconds."""

from __future__ import annotations

import time
from types import SimpleNamespace

import psutil
import pytest

from megatron_sortedrl.agentic.parsers import Parsed, ToolCall, parse_hermes
from megatron_sortedrl.agentic.runner import ToolOutcome, ToolRunner

TOOLS = ["calculator", "python", "kv_store"] + [f"agentic_support.{n}" for n in
                                                ("echo", "hang", "boom", "die", "spam", "bad_state", "counter")]
TIMEOUT_S = 3.0


def _runner(workers: int = 2, timeout_s: float = TIMEOUT_S) -> ToolRunner:
    return ToolRunner(SimpleNamespace(tools=TOOLS, timeout_s=timeout_s, max_output_chars=100, workers=workers))


@pytest.fixture(scope="module")
def runner():
    with _runner() as r:
        yield r


def _wait(runner: ToolRunner, n: int, limit_s: float = 60.0) -> dict[str, ToolOutcome]:
    """Exactly n outcomes (asserts no key comes twice), by key."""
    got: dict[str, ToolOutcome] = {}
    deadline = time.monotonic() + limit_s
    while len(got) < n and time.monotonic() < deadline:
        for out in runner.poll(timeout_s=0.5):
            assert out.key not in got, f"two outcomes for {out.key}"
            got[out.key] = out
    assert len(got) == n, f"{n - len(got)} outcomes missing after {limit_s} s"
    assert len(runner) == 0
    return got


def _turn(*calls: tuple[str, dict]) -> Parsed:
    return Parsed([ToolCall(name, args) for name, args in calls])


# (the failing call, its error kind, what its message says)
FAILURES = {
    "timeout": (("hang", {}), "timeout",
                f"Error: the tool hang ran past its time limit of {TIMEOUT_S:g} s and was stopped."),
    "crash": (("boom", {}), "crash", "Error: the tool boom failed: RuntimeError: the tool broke"),
    "exit": (("die", {}), "crash", "Error: the tool die stopped without answering (its process ended)."),
    "too_long": (("spam", {}), "too_long",
                 "x" * 100 + "\n[output cut: the tool answered 1000000 characters; only the first 100 are shown]"),
    "unknown": (("search", {"q": "x"}), "unknown_tool",
                "Error: there is no tool named 'search'; the tools are: calculator, python"),
    "bad_arguments": (("echo", {"txt": "hi"}), "bad_arguments",
                      "Error: bad arguments for echo: 'text' is a required property"),
    "bad_state": (("bad_state", {}), "crash",
                  "Error: the tool bad_state failed: it left the state in a form that is not JSON"),
    "refused": (("calculator", {"expression": "1/0"}), "bad_arguments", "Error: division by zero."),
}


@pytest.mark.parametrize("case", list(FAILURES))
def test_a_failing_call_gets_its_message_and_the_turn_goes_on(runner, case):
    (name, args), kind, message = FAILURES[case]
    before = dict(runner.counts)
    state = {"tools_kwargs": {"counter": {"create_kwargs": {"start": 10}}}}
    runner.submit(case, _turn(("counter", {}), (name, args), ("counter", {})), state)
    out = _wait(runner, 1)[case]
    assert out.errors == [kind]
    assert out.names == ["counter", name, "counter"]
    assert out.contents[0] == "11" and out.contents[2] == "12"  # the calls around it ran, in order
    assert out.contents[1].startswith(message), out.contents[1]
    assert out.state["n"] == 12  # the counter's state after both of its calls
    assert "touched" not in out.state and "handle" not in out.state  # the failed call's change undone
    assert runner.counts[kind] - before[kind] == 1 and runner.counts["calls"] - before["calls"] == 3
    # and the runner keeps working
    runner.submit("after", _turn(("calculator", {"expression": "6*7"})), {})
    assert _wait(runner, 1)["after"].contents == ["42"]


def test_a_malformed_turn_is_answered_at_once_with_the_parser_message(runner):
    parsed = parse_hermes('<tool_call>{"name": "calculator", "arguments": {"expression": "1+1"}')
    runner.submit("m", parsed, {"kept": 1})
    out = _wait(runner, 1)["m"]
    assert out.errors == ["malformed"] and out.contents == [parsed.error] and out.state == {"kept": 1}
    runner.submit("final", Parsed([]), {"kept": 2})  # a final answer: no calls, no errors
    out = _wait(runner, 1)["final"]
    assert out.contents == [] and out.errors == [] and out.state == {"kept": 2}


def test_state_reaches_a_stateful_environment_across_turns(runner):
    state = {"tools_kwargs": {"kv_store": {"entries": {"secret": "4711"}}}}
    runner.submit("t", _turn(("kv_store", {"op": "get", "key": "secret"}),
                             ("kv_store", {"op": "set", "key": "seen", "value": "yes"})), state)
    out = _wait(runner, 1)["t"]
    assert out.contents == ["4711", "ok"] and out.errors == []
    runner.submit("t", _turn(("kv_store", {"op": "keys"})), out.state)  # the next turn: create does not run again
    out = _wait(runner, 1)["t"]
    assert out.contents == ["secret, seen"] and out.state["_created"] == ["kv_store"]


def test_a_rows_own_tools_narrow_what_it_may_call(runner):
    runner.submit("r", _turn(("echo", {"text": "a"}), ("calculator", {"expression": "1"})), {}, tools=["echo"])
    out = _wait(runner, 1)["r"]
    assert out.contents == ["a", "Error: there is no tool named 'calculator'; the tools are: echo."]
    assert out.errors == ["unknown_tool"]
    assert [s["function"]["name"] for s in runner.schemas(["echo", "calculator"])] == ["echo", "calculator"]
    assert len(runner.schemas()) == len(TOOLS)


def test_python_tool_through_the_runner():
    with _runner(timeout_s=6.0) as runner:  # the program's limit is 4 s: room for sandbox start-up under load
        runner.submit("ok", _turn(("python", {"code": "print(sum(range(10)))"})), {})
        runner.submit("loop", _turn(("python", {"code": "while True:\n    pass"})), {})
        got = _wait(runner, 2)
    assert got["ok"].contents == ["45\n"] and got["ok"].errors == []
    assert got["loop"].errors == ["timeout"] and "ran past its time limit" in got["loop"].contents[0]


def test_every_submit_gets_one_outcome_and_submit_never_blocks():
    cases = [FAILURES[c][0] for c in FAILURES] + [("echo", {"text": "fine"})] * 6
    with _runner(workers=2, timeout_s=2.0) as r:
        t0 = time.monotonic()
        for i, call in enumerate(cases):
            r.submit(f"k{i}", _turn(call), {})
        r.submit("bad", parse_hermes("<tool_call>nope</tool_call>"), {})
        assert time.monotonic() - t0 < 0.5  # two hanging and one dying tool among them
        assert len(r) == len(cases) + 1
        got = _wait(r, len(cases) + 1)
        assert all(got[f"k{i}"].names == [call[0]] for i, call in enumerate(cases))
        assert [got[f"k{i}"].contents for i in range(len(cases) - 6, len(cases))] == [["fine"]] * 6
        assert r.counts["timeout"] == 1 and r.counts["crash"] == 3 and r.counts["malformed"] == 1


def _live(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _cmdline(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline())
    except psutil.NoSuchProcess:  # ended meanwhile
        return ""


def test_close_leaves_no_process_behind():
    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    r = _runner(workers=2, timeout_s=30.0)
    r.submit("a", _turn(("python", {"code": "import time\ntime.sleep(60)"})), {})
    r.submit("b", _turn(("hang", {})), {})
    r.poll(timeout_s=2.0)  # both running: a worker with its sandbox, a worker in a sleeping tool
    # multiprocessing's resource tracker is one per driver process, shared by every pool, and ends with it
    started = {p.pid for p in me.children(recursive=True) if "resource_tracker" not in _cmdline(p)} - before
    assert len(started) >= 3  # two workers and at least the sandboxed program
    r.close()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(_live(p) for p in started):
        time.sleep(0.1)
    alive = [p for p in started if _live(p)]
    assert alive == [], [(p, _cmdline(psutil.Process(p))) for p in alive]
