"""Runs a turn's tool calls in worker processes of their own, off the driver and the engines.

    runner = ToolRunner.from_config(cfg)          # tools.workers spawned processes; cfg.reward.sandbox for `python`
    runner.schemas()                              # the tools' OpenAI-style schemas, for the prompt
    runner.submit(sample_id, parse(turn_text), state)   # never blocks; state: the trajectory's dict
    for out in runner.poll(timeout_s=0.05):       # outcomes ready so far (waits at most timeout_s for one)
        out.key, out.contents, out.state, out.errors   # one tool message per call, in order
    runner.close()                                # no process left behind

Every submit gets exactly one `ToolOutcome`, whatever the tools do, and the runner goes on after every
failure. A call's failure becomes a defined tool message (`MESSAGES`) and one entry in `errors`, counted in
`runner.counts`:

    timeout       the call ran past tools.timeout_s: its worker is killed and replaced (the call's own
                  sandbox dies with it); the submission's later calls run on another worker
    crash         the tool raised, its `create` raised, it left a state that is not JSON, or it killed
                  its worker (os._exit, a segfault): the worker is replaced as for a timeout
    too_long      the answer passed tools.max_output_chars: cut there, and the message says so
    malformed     the parser's error (Parsed.error): one message for the turn, no tool runs
    unknown_tool  a name that is not a configured tool (or not one of the row's own tools)
    bad_arguments arguments that do not fit the tool's schema, or a ToolError the tool raised

A failed call changes nothing in the state (the worker reports the state after each call and restores it when
a call fails); later calls of the same turn still run. The tools run in the order the model wrote them,
each with the state the previous one left.

The worker processes are the reward pool's (`reward_pool.RewardWorker`: spawned, never forked; each dies with
the process that started it, so a SIGKILLed driver leaves none behind) with a main of their own. One
submission goes to one idle worker; the per-call timeout clock restarts at each call's result, as the
reward pool's does. Left out: tools on other nodes (Ray actors), batching several submissions per message
(a turn's calls are few and a round trip is small next to a tool's run time).
Tests: `python -m pytest tests/test_agentic_runner.py -q`.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import multiprocessing.connection
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from megatron_sortedrl.agentic.parsers import Parsed
from megatron_sortedrl.agentic.tools import ERROR_KINDS, ToolError, ToolSettings, create_kwargs, load_tools
from megatron_sortedrl.errors import ConfigError
from megatron_sortedrl.lifetime import die_with_parent
from megatron_sortedrl.reward_pool import RewardWorker, close_reward_worker, worker_messages

# The tool message of each failure; the model reads these, so they say what happened and what to do.
MESSAGES = {
    "timeout": "Error: the tool {name} ran past its time limit of {limit:g} s and was stopped.",
    "crash": "Error: the tool {name} failed: {what}",
    "died": "Error: the tool {name} stopped without answering (its process ended).",
    "too_long": "\n[output cut: the tool answered {n} characters; only the first {limit} are shown]",
    "unknown_tool": "Error: there is no tool named {name!r}; the tools are: {names}.",
    "bad_arguments": "Error: bad arguments for {name}: {what}",
    "bad_state": "Error: the tool {name} failed: it left the state in a form that is not JSON ({what}); "
                 "the call was undone.",
}


@dataclass
class ToolOutcome:
    key: str  # what submit() was given (the sample id)
    contents: list[str]  # one tool message content per call (one for a malformed call), in order
    state: dict  # the trajectory's state after the calls (JSON-able)
    seconds: float  # wall seconds from submit to this outcome: what the trajectory waited for its tools
    errors: list[str]  # one kind per failed call: timeout | crash | too_long | malformed | unknown_tool | bad_arguments
    queued_s: float = 0.0  # of `seconds`, the time spent waiting for a free worker
    names: list[str] = field(default_factory=list)  # the called tools' names, in order (empty: malformed)


@dataclass
class _Job:
    key: str
    calls: list[tuple[str, dict]]
    state: dict
    allowed: list[str] | None
    submitted: float
    started: float = 0.0  # when a worker first took it
    contents: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


# ---------------------------------------------------------------- in the worker

def _worker_main(spec: dict, conn: Any, parent: int | None = None) -> None:
    die_with_parent(parent)
    tools = load_tools(spec["tools"], spec["settings"])
    validators: dict[str, Any] = {}
    conn.send("ready")
    for msg in worker_messages(conn):
        start, calls, state, allowed = msg
        for i in range(start, len(calls)):
            t0 = time.monotonic()
            content, kind = run_call(tools, calls[i], state, allowed, spec["max_output_chars"], validators)
            conn.send((i, content, kind, state, time.monotonic() - t0))


def run_call(tools: dict[str, Any], call: tuple[str, dict], state: dict, allowed: list[str] | None,
             max_chars: int, validators: dict[str, Any] | None = None) -> tuple[str, str]:
    """(tool message, error kind or '') of one call; `state` is changed in place, and restored if the call fails."""
    name, args = call
    names = [n for n in tools if allowed is None or n in allowed]
    if name not in names:
        return MESSAGES["unknown_tool"].format(name=name, names=", ".join(names) or "(none)"), "unknown_tool"
    tool = tools[name]
    problem = _argument_problem(tool, args, validators if validators is not None else {})
    if problem:
        return MESSAGES["bad_arguments"].format(name=name, what=problem), "bad_arguments"
    try:
        snapshot = json.dumps(state)
    except (TypeError, ValueError) as exc:  # the caller's own state: nothing to undo to, so nothing runs
        return MESSAGES["bad_state"].format(name=name, what=f"given: {exc}"[:200]), "crash"
    try:
        created = state.get("_created", [])
        if hasattr(tool, "create") and name not in created:
            tool.create(state, **create_kwargs(state, name))
            state["_created"] = [*created, name]
        out = tool(args, state)
    except ToolError as exc:
        _restore(state, snapshot)
        return str(exc), exc.kind
    except Exception as exc:  # noqa: BLE001 - any failure of a tool is a tool message, never a lost trajectory
        _restore(state, snapshot)
        return MESSAGES["crash"].format(name=name, what=f"{type(exc).__name__}: {exc}"[:500]), "crash"
    try:
        json.dumps(state)  # a state that is not JSON could not travel with the trajectory (or its checkpoint)
    except (TypeError, ValueError) as exc:
        _restore(state, snapshot)
        return MESSAGES["bad_state"].format(name=name, what=str(exc)[:200]), "crash"
    text = out if isinstance(out, str) else _as_text(out)
    if len(text) > max_chars:
        return text[:max_chars] + MESSAGES["too_long"].format(n=len(text), limit=max_chars), "too_long"
    return text, ""


def _argument_problem(tool: Any, args: dict, validators: dict[str, Any]) -> str:
    from jsonschema import Draft202012Validator
    from jsonschema.exceptions import best_match

    if tool.name not in validators:
        validators[tool.name] = Draft202012Validator(tool.schema["function"]["parameters"])
    err = best_match(validators[tool.name].iter_errors(args))
    if err is None:
        return ""
    where = "/".join(str(p) for p in err.absolute_path)
    return f"{where + ': ' if where else ''}{err.message}"[:500]


def _restore(state: dict, snapshot: str) -> None:
    state.clear()
    state.update(json.loads(snapshot))


def _as_text(out: Any) -> str:
    try:
        return json.dumps(out, ensure_ascii=False)
    except (TypeError, ValueError):
        return str(out)


# ---------------------------------------------------------------- in the driver

class ToolRunner:
    def __init__(self, tools_cfg: Any, sandbox_cfg: Any = None) -> None:
        """tools_cfg: a ToolsConfig (or any object with tools, timeout_s, max_output_chars, workers);
        sandbox_cfg: the sandbox mode for `python` (auto | bwrap | fallback) or an object with `.sandbox`
        (the reward config)."""
        sandbox = getattr(sandbox_cfg, "sandbox", sandbox_cfg) or "auto"
        self.timeout_s = float(tools_cfg.timeout_s)
        self.settings = ToolSettings(timeout_s=self.timeout_s, sandbox=sandbox)
        self.tools = load_tools(list(tools_cfg.tools), self.settings)  # a bad tool fails here, in the driver
        self._spec = {"tools": list(tools_cfg.tools), "settings": self.settings,
                      "max_output_chars": int(tools_cfg.max_output_chars)}
        self._ctx = mp.get_context("spawn")
        self.workers = [self._new_worker() for _ in range(max(1, int(tools_cfg.workers)))]
        self.pending: deque[_Job] = deque()
        self.done: list[ToolOutcome] = []
        self.counts = {"submitted": 0, "calls": 0, **{k: 0 for k in ERROR_KINDS}}
        self._closed = False

    @classmethod
    def from_config(cls, cfg: Any) -> ToolRunner:
        """From the run config: cfg.tools, and cfg.reward.sandbox for the python tool."""
        return cls(cfg.tools, getattr(getattr(cfg, "reward", None), "sandbox", "auto"))

    def schemas(self, names: list[str] | None = None) -> list[dict]:
        """The OpenAI-style schemas of `names` (a row's own tools), or of every configured tool, in order."""
        if names is None:
            return [t.schema for t in self.tools.values()]
        missing = [n for n in names if n not in self.tools]
        if missing:
            raise ConfigError("tools.tools", list(self.tools), f"a list that holds the row's tools {missing}")
        return [self.tools[n].schema for n in names]

    def submit(self, key: str, parsed: Parsed, state: dict, tools: list[str] | None = None) -> None:
        """Queues the turn's calls (never blocks). `tools`: the row's own tool names (others are unknown)."""
        if self._closed:
            raise RuntimeError("ToolRunner.submit after close()")
        now = time.monotonic()
        self.counts["submitted"] += 1
        if parsed.error or not parsed.calls:  # malformed, or a final answer: nothing to run
            if parsed.error:
                self.counts["calls"] += 1
                self.counts["malformed"] += 1
            self.done.append(ToolOutcome(key, [parsed.error] if parsed.error else [], state, 0.0,
                                         ["malformed"] if parsed.error else []))
            return
        calls = [(c.name, c.arguments) for c in parsed.calls]
        self.counts["calls"] += len(calls)
        self.pending.append(_Job(key, calls, state, list(tools) if tools is not None else None, now))
        self._dispatch()

    def __len__(self) -> int:
        """Submitted, outcome not yet polled."""
        return len(self.pending) + sum(len(w.tasks) for w in self.workers) + len(self.done)

    def poll(self, timeout_s: float = 0.0) -> list[ToolOutcome]:
        """The outcomes finished since the last call; waits up to `timeout_s` for the first one."""
        deadline = time.monotonic() + timeout_s
        while True:
            self._collect()
            now = time.monotonic()
            if self.done or now >= deadline or not (self.pending or any(w.tasks for w in self.workers)):
                break
            # Woken by a result, a worker's death (its pipe reads EOF) or a worker coming up; or by the
            # nearest call deadline, to stop that call.
            wait = [w.conn for w in self.workers if w.tasks or not w.ready]
            nearest = min((w.started + self.timeout_s for w in self.workers if w.tasks), default=deadline)
            mp.connection.wait(wait, timeout=max(0.0, min(deadline, nearest + 0.01) - now))
        out, self.done = self.done, []
        return out

    def close(self) -> None:
        """Stops every worker (a running call is killed with its worker); outcomes not yet polled are dropped."""
        self._closed = True
        for w in self.workers:
            if w.tasks:  # its call is dropped anyway: no reason to wait for it
                w.kill()
            else:
                close_reward_worker(w)

    def __enter__(self) -> ToolRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------ machinery

    def _new_worker(self) -> RewardWorker:
        return RewardWorker(self._ctx, self._spec, target=_worker_main)

    def _dispatch(self) -> None:
        for w in self.workers:
            if not self.pending:
                return
            if w.tasks or not w.check_ready():
                continue
            job = self.pending.popleft()
            w.tasks.append(job)
            w.started = time.monotonic()
            job.started = job.started or w.started
            try:
                w.conn.send((len(job.contents), job.calls, job.state, job.allowed))
            except (OSError, BrokenPipeError):  # it died while idle: the job waits for its replacement
                w.tasks.clear()
                self.pending.appendleft(job)
                self._restart(w)

    def _collect(self) -> None:
        for w in list(self.workers):
            if not w.tasks:
                if not w.proc.is_alive():  # died while idle or starting: replaced before it is given work
                    self._restart(w)
                continue
            job = w.tasks[0]
            try:
                while w.conn.poll():
                    i, content, kind, state, _secs = w.conn.recv()
                    self._record(job, content, kind)
                    job.state = state
                    w.started = time.monotonic()
                    if len(job.contents) == len(job.calls):
                        w.tasks.clear()
                        self._finish(job)
                        break
            except (EOFError, OSError):  # the tool ended its worker (os._exit, a signal)
                self._fail_call(w, job, "died")
                continue
            if w.tasks and not w.proc.is_alive():
                self._fail_call(w, job, "died")
            elif w.tasks and time.monotonic() - w.started > self.timeout_s:
                self._fail_call(w, job, "timeout")
        self._dispatch()

    def _record(self, job: _Job, content: str, kind: str) -> None:
        job.contents.append(content)
        if kind:
            job.errors.append(kind)
            self.counts[kind] += 1

    def _fail_call(self, w: RewardWorker, job: _Job, why: str) -> None:
        """The call running on `w` answers with the defined message; its worker is replaced, and the job's
        later calls go back to the front of the queue with the state before this call."""
        name = job.calls[len(job.contents)][0]
        kind = "timeout" if why == "timeout" else "crash"
        self._record(job, MESSAGES[why].format(name=name, limit=self.timeout_s), kind)
        w.tasks.clear()
        self._restart(w)
        if len(job.contents) < len(job.calls):
            self.pending.appendleft(job)
        else:
            self._finish(job)

    def _finish(self, job: _Job) -> None:
        now = time.monotonic()
        self.done.append(ToolOutcome(job.key, job.contents, job.state, now - job.submitted, job.errors,
                                     queued_s=(job.started or now) - job.submitted, names=[c[0] for c in job.calls]))

    def _restart(self, w: RewardWorker) -> None:
        w.kill()
        self.workers[self.workers.index(w)] = self._new_worker()
