"""Code reward: run the response's program in the sandbox against the prompt's hidden tests.

    data.task=code                      # picks this reward (megatron_sortedrl.rewards.code.reward)
    data.task=file data.reward_fn=megatron_sortedrl.rewards.code.reward    # verl / DeepCoder files

The ground truth is JSON, in one of the layouts public code-RL data uses:

* call-based (ours, APPS/TACO `fn_name`): `{"fn_name": "f", "inputs": [[arg, ...], ...], "outputs": [y, ...]}`;
  the program must define `fn_name`; each test calls it with the arguments and compares the result.
* standard input/output (DeepCoder, verl `reward_model.ground_truth`): `[{"input": "...", "output": "..."}]`
  or `{"inputs": ["..."], "outputs": ["..."]}` without `fn_name`; the program reads stdin, and its stdout
  must equal the expected output up to surrounding whitespace on each line.

The program is the last fenced ```python block of the response when there is one, else the whole
response. All tests run in one sandboxed process (`rewards/sandbox.py`); the expected outputs never enter
the sandbox (the program returns its outputs and they are compared here), so a program cannot print its
way to a pass. Reward 1.0 when every test passes, else 0.0 (with `reward.code_partial_credit`: the share
of tests passed, for a program that ran them all), with the reason in `RewardResult.reason` (first
failing test, error, timeout, memory, a process left behind, ...). A program that leaves a
process running scores 0 even when its answers are right.

The program's limit is `sample.meta["reward_timeout_s"]` when the reward stage set one (timeouts from
history, see `reward_stage.py`), else `DEFAULT_TIMEOUT_S`. It counts from the start of the program's code
(an interval timer in the runner), so interpreter and sandbox start-up do not eat it; the sandbox's
wall-clock limit, `STARTUP_ALLOWANCE_S` later, catches a program that blocks the timer's signal. The
result's `seconds` is the program's own run time, which the timeout history learns from. Each worker
process keeps one sandbox started ahead for its next program (`reward.warm_sandbox`, on by default; see
"Warm start" in `sandbox.py`), so sandbox start-up is paid between samples, not after one arrives.
Tests: `python -m pytest tests/test_sandbox.py tests/test_code_task.py -q`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from megatron_sortedrl.rewards.sandbox import Limits, Sandbox

DEFAULT_TIMEOUT_S = 5.0
STARTUP_ALLOWANCE_S = 2.0  # sandbox and interpreter start-up on a busy machine, on top of the program's limit
_FENCE = re.compile(r"```(?:python|py)?\s*\n(.*?)```", re.S)
_MARK = "@@RESULTS@@"

# Runs inside the sandbox. Reads tests.json (inputs only), runs them, prints one JSON line after the mark.
_RUNNER = r'''
import io, json, os, signal, sys, time
_ME = os.getpid()
_t = json.load(open("tests.json"))
_out, _err = [], ""
_src = open("solution.py").read()
class _Deadline(BaseException):
    pass
def _alarm(*_):
    raise _Deadline()
def _exc():
    e = sys.exc_info()[1]
    if isinstance(e, _Deadline):
        return "timeout"
    return "MemoryError" if isinstance(e, MemoryError) else f"{type(e).__name__}: {e}"[:300]
# The program's own limit, from the start of its code: interpreter and sandbox start-up do not count, so
# a limit learned from the program's run time is not eaten by them (the sandbox's wall clock is the backstop).
signal.signal(signal.SIGALRM, _alarm)
signal.setitimer(signal.ITIMER_REAL, _t["limit_s"])
_t0 = time.perf_counter()
if _t["mode"] == "call":
    _g = {"__name__": "solution"}
    try:
        exec(compile(_src, "solution.py", "exec"), _g)
        _fn = _g[_t["fn_name"]]
    except BaseException:
        _err = _exc()
    if not _err:
        for _args in _t["inputs"]:
            try:
                _out.append(_fn(*_args))
            except BaseException:
                _err = _exc(); break
else:
    _real_in, _real_out = sys.stdin, sys.stdout
    for _inp in _t["inputs"]:
        sys.stdin, sys.stdout = io.StringIO(_inp), io.StringIO()
        try:
            exec(compile(_src, "solution.py", "exec"), {"__name__": "__main__"})
        except SystemExit:
            pass
        except BaseException:
            _err = _exc()
        _got = sys.stdout.getvalue()
        sys.stdin, sys.stdout = _real_in, _real_out
        if _err:
            break
        _out.append(_got)
if os.getpid() != _ME:  # a forked copy of the program: never reports
    os._exit(1)
_secs = time.perf_counter() - _t0
signal.setitimer(signal.ITIMER_REAL, 0)
_others = 0
try:
    for _p in os.listdir("/proc"):
        if _p.isdigit() and int(_p) not in (1, _ME, os.getppid()) and os.stat("/proc/" + _p).st_uid == os.getuid():
            _others += 1
except OSError:
    pass
try:
    _line = json.dumps({"outputs": _out, "error": _err, "others": _others, "seconds": _secs}, default=repr)
except BaseException:
    _line = json.dumps({"outputs": [], "error": "outputs are not JSON-serialisable", "others": _others,
                        "seconds": _secs})
sys.stdout.write("\n" + "@@RESULTS@@" + _line + "\n")
sys.stdout.flush()
'''


@dataclass
class RewardResult:
    """What a reward may return instead of a bare float: the score and why (shown in logs and failures)."""

    score: float
    reason: str = ""
    seconds: float = 0.0  # the program's own run time (tests only, no start-up): what history timeouts learn

    def __float__(self) -> float:
        return float(self.score)


_BOXES: dict[tuple[str, bool], Sandbox] = {}


def sandbox(mode: str = "auto", warm: bool = True) -> Sandbox:
    """One sandbox per process, mode and warmth (the bwrap probe runs once). Warm by default: the next
    program's sandbox starts while this worker waits for its next sample (`Sandbox(warm=True)`)."""
    if (mode, warm) not in _BOXES:
        _BOXES[(mode, warm)] = Sandbox(mode, Limits(), warm=warm)
    return _BOXES[(mode, warm)]


def extract_program(text: str) -> str:
    blocks = _FENCE.findall(text)
    return blocks[-1] if blocks else text


def parse_tests(ground_truth: str) -> dict:
    """Normalises the layouts above to {"mode": "call"|"stdio", "fn_name", "inputs", "outputs"}."""
    gt = json.loads(ground_truth) if isinstance(ground_truth, str) else ground_truth
    if isinstance(gt, str):  # verl files sometimes hold the JSON twice encoded
        gt = json.loads(gt)
    if isinstance(gt, list):
        return {"mode": "stdio", "fn_name": "", "inputs": [str(t["input"]) for t in gt],
                "outputs": [str(t["output"]) for t in gt]}
    if not isinstance(gt, dict) or "inputs" not in gt or "outputs" not in gt:
        raise ValueError("code ground truth must be a list of {input, output} or an object with inputs and outputs")
    if len(gt["inputs"]) != len(gt["outputs"]):
        raise ValueError(f"code ground truth has {len(gt['inputs'])} inputs but {len(gt['outputs'])} outputs")
    if gt.get("fn_name"):
        return {"mode": "call", "fn_name": gt["fn_name"], "inputs": gt["inputs"], "outputs": gt["outputs"]}
    return {"mode": "stdio", "fn_name": "", "inputs": [str(x) for x in gt["inputs"]],
            "outputs": [str(x) for x in gt["outputs"]]}


def _same_text(got: str, want: str) -> bool:
    norm = lambda s: [line.rstrip() for line in s.strip().splitlines()]  # noqa: E731
    return norm(got) == norm(want)


def score_program(program: str, tests: dict, timeout_s: float = DEFAULT_TIMEOUT_S, mode: str = "auto",
                  warm: bool = True, partial: bool = False) -> RewardResult:
    box = sandbox(mode, warm)
    runner_tests = {k: tests[k] for k in ("mode", "fn_name", "inputs")}
    runner_tests["limit_s"] = timeout_s
    res = box.run({"solution.py": program, "runner.py": _RUNNER, "tests.json": json.dumps(runner_tests)},
                  "runner.py", timeout_s=timeout_s + STARTUP_ALLOWANCE_S)
    head, _, line = res.stdout.rpartition(_MARK)
    if res.status != "ok" or not line.strip():
        return RewardResult(0.0, res.reason or "no result from the program (it exited or closed stdout early)")
    try:
        report = json.loads(line.strip().splitlines()[0])
    except (json.JSONDecodeError, IndexError):
        return RewardResult(0.0, "the program corrupted the result line")
    secs = float(report.get("seconds", 0.0))
    if report.get("error"):
        err = report["error"]
        if err == "timeout":
            return RewardResult(0.0, "timeout", secs)
        return RewardResult(0.0, "memory: MemoryError" if err == "MemoryError" else f"error: {err}", secs)
    if report.get("others") or res.leftover_processes:
        n = max(report.get("others", 0), res.leftover_processes)
        return RewardResult(0.0, f"left {n} background process(es) running (killed)")
    outputs, want = report.get("outputs", []), tests["outputs"]
    if len(outputs) != len(want):
        return RewardResult(0.0, f"ran {len(outputs)} of {len(want)} tests")
    ok = [_same_text(got, exp) if tests["mode"] == "stdio" else got == exp for got, exp in zip(outputs, want)]
    if not all(ok):
        first = ok.index(False)
        # Partial credit: the share of tests passed, for a program that ran them all (errors still score 0).
        score = sum(ok) / len(ok) if partial else 0.0
        return RewardResult(score, f"wrong answer on test {first + 1} of {len(want)}", secs)
    return RewardResult(1.0, "", secs)


def prepare_next() -> None:
    """Between two samples: tears down the last program's sandboxes and starts the next ones (warm start)."""
    for box in _BOXES.values():
        if box.warm:
            box.prepare()


def reward(sample, ground_truth: str) -> RewardResult:
    """All hidden tests pass: 1.0; else 0.0 with the reason."""
    try:
        tests = parse_tests(ground_truth)
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"bad code ground truth for {sample.prompt_id}: {exc}") from None
    timeout = float(sample.meta.get("reward_timeout_s") or DEFAULT_TIMEOUT_S)
    mode = sample.meta.get("sandbox_mode", "auto")
    warm = bool(sample.meta.get("sandbox_warm", True))
    partial = bool(sample.meta.get("code_partial_credit", False))
    return score_program(extract_program(sample.response_text), tests, timeout, mode, warm, partial)


reward.after_call = prepare_next  # the reward pool calls it after each result has gone back
