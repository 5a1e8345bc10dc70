"""Sandboxed code reward: hostile programs are contained and score 0 with their reason; correct ones pass.

Runs in the mode the machine allows (bubblewrap here, installed by tools/setup_env.sh) and in the forced
fallback mode, through the warm-start path the code reward uses (its boot script, stdin payload and
teardown); the cold path and a sandbox started ahead are checked at the end. Each case checks the effect did not happen (file absent, no connection accepted, no
process left) as well as the score. CPU, about 15 s.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid

import pytest

from megatron_sortedrl.rewards.code import RewardResult, parse_tests, score_program
from megatron_sortedrl.rewards.sandbox import Sandbox, _UID_RANGE, detect_mode

CALL_TESTS = {"mode": "call", "fn_name": "f", "inputs": [[1], [5], [-3]], "outputs": [5, 17, -7]}
GOOD = "def f(x):\n    x = x * 3\n    x = x + 2\n    return x\n"
MODES = ["auto", "fallback"]


def _score(program: str, mode: str, timeout_s: float = 3.0) -> RewardResult:
    return score_program(program, CALL_TESTS, timeout_s=timeout_s, mode=mode)


# This file's runs take uids of their own, outside the range any run uses: a training run or benchmark
# scoring on the same machine must not show up as a process left behind here.
TEST_UID_RANGE = (_UID_RANGE[1] + 10_000, _UID_RANGE[1] + 11_000)


@pytest.fixture(autouse=True)
def _own_uids(monkeypatch):
    import megatron_sortedrl.rewards.sandbox as sb

    monkeypatch.setattr(sb, "_UID_RANGE", TEST_UID_RANGE)


def _sandbox_processes() -> list[int]:
    lo, hi = TEST_UID_RANGE
    out = []
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                if lo <= os.stat(f"/proc/{p}").st_uid <= hi:
                    out.append(int(p))
            except OSError:
                pass
    return out


def test_active_mode_is_reported_in_one_line():
    box = Sandbox("auto")
    line = box.describe()
    assert "\n" not in line and line.startswith("code sandbox: ")
    assert ("bubblewrap" in line) == (box.mode == "bwrap")
    if box.mode == "fallback":
        assert "FALLBACK" in line and box.why


@pytest.mark.parametrize("mode", MODES)
def test_correct_program_passes(mode):
    res = _score(GOOD, mode)
    assert (res.score, res.reason) == (1.0, "") and 0 <= res.seconds < 1.0
    fenced = "Here it is:\n```python\n" + GOOD + "```\n"
    from megatron_sortedrl.rewards.code import extract_program

    assert _score(extract_program(fenced), mode).score == 1.0


@pytest.mark.parametrize("mode", MODES)
def test_wrong_answer_names_the_test(mode):
    res = _score("def f(x):\n    return x * 3\n", mode)
    assert res.score == 0.0 and res.reason == "wrong answer on test 1 of 3"


def test_stdio_tests_in_deepcoder_layout():
    tests = parse_tests(json.dumps([{"input": "2 3\n", "output": "5\n"}, {"input": "10 -4\n", "output": "6"}]))
    prog = "a, b = map(int, input().split())\nprint(a + b)\n"
    assert score_program(prog, tests).score == 1.0
    assert score_program("print(5)\n", tests).reason == "wrong answer on test 2 of 2"


@pytest.mark.parametrize("mode", MODES)
def test_write_outside_scratch_is_refused(mode, tmp_path):
    target = tmp_path / f"escaped-{uuid.uuid4().hex}"
    os.chmod(tmp_path, 0o777)  # even a world-writable directory outside scratch stays untouched
    res = _score(f"open({str(target)!r}, 'w').write('x')\n" + GOOD, mode)
    assert res.score == 0.0 and res.reason.startswith("error: ")
    assert not target.exists()


@pytest.mark.parametrize("mode", MODES)
def test_network_connection_is_refused(mode):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(4.0)
    port = server.getsockname()[1]
    accepted = []
    t = threading.Thread(target=lambda: accepted.append(_accept(server)), daemon=True)
    t.start()
    res = _score(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2).sendall(b'hi')\n" + GOOD, mode)
    t.join(6)
    server.close()
    assert res.score == 0.0 and res.reason.startswith("error: ")
    assert accepted == [None]


def _accept(server):
    try:
        conn, _ = server.accept()
        conn.close()
        return "connected"
    except OSError:
        return None


@pytest.mark.parametrize("mode", MODES)
def test_fork_bomb_is_bounded_and_cleaned_up(mode):
    t0 = time.monotonic()
    res = _score("import os\nwhile True:\n    os.fork()\n" + GOOD, mode, timeout_s=4.0)
    assert res.score == 0.0 and res.reason
    assert time.monotonic() - t0 < 15
    assert _sandbox_processes() == []


@pytest.mark.parametrize("mode", MODES)
def test_memory_hog_hits_the_memory_limit(mode):
    res = _score("x = bytearray(4 << 30)\n" + GOOD, mode)
    assert res.score == 0.0 and res.reason.startswith("memory")


@pytest.mark.parametrize("mode", MODES)
def test_endless_loop_times_out(mode):
    t0 = time.monotonic()
    res = _score("def f(x):\n    while True:\n        pass\n", mode, timeout_s=1.5)
    assert (res.score, res.reason) == (0.0, "timeout") and res.seconds >= 1.4
    # a loop that ignores the program's timer signal is cut by the sandbox's wall clock
    res = _score("import signal\nsignal.signal(signal.SIGALRM, signal.SIG_IGN)\n"
                 "def f(x):\n    while True:\n        pass\n", mode, timeout_s=1.0)
    assert (res.score, res.reason) == (0.0, "timeout")
    assert time.monotonic() - t0 < 20
    assert _sandbox_processes() == []


@pytest.mark.parametrize("mode", MODES)
def test_trainer_environment_is_not_visible(mode, monkeypatch):
    monkeypatch.setenv("TRAINER_SECRET_TOKEN", "s3cr3t")
    # Returning the secret would pass (the tests expect it), so a leak would show as a score of 1.
    tests = {"mode": "call", "fn_name": "f", "inputs": [[0]], "outputs": ["s3cr3t"]}
    prog = ("import os\ndef f(x):\n    return os.environ['TRAINER_SECRET_TOKEN']\n")
    res = score_program(prog, tests, timeout_s=3.0, mode=mode)
    assert res.score == 0.0 and "KeyError" in res.reason
    prog2 = ("def f(x):\n    import os\n    for p in os.listdir('/proc'):\n        try:\n"
             "            if b's3cr3t' in open(f'/proc/{p}/environ', 'rb').read(): return 's3cr3t'\n"
             "        except OSError: pass\n    return ''\n")
    assert score_program(prog2, tests, timeout_s=3.0, mode=mode).score == 0.0


@pytest.mark.parametrize("mode", MODES)
def test_background_process_is_killed_and_scores_zero(mode, tmp_path):
    prog = ("import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(30)\n    os._exit(0)\n" + GOOD)
    res = _score(prog, mode)
    assert res.score == 0.0 and "background process" in res.reason
    time.sleep(0.2)
    assert _sandbox_processes() == []


def test_bwrap_is_active_on_this_machine_when_installed():
    """The setup installs bubblewrap; where it is present and works, the reward must not run weaker."""
    import shutil

    mode, why = detect_mode("auto")
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap not installed here")
    assert mode == "bwrap", why


@pytest.mark.parametrize("mode", MODES)
def test_cold_path_contains_the_same_cases(mode, tmp_path):
    """warm=False (reward.warm_sandbox=false) starts each program's sandbox with its files in place."""
    target = tmp_path / f"escaped-{uuid.uuid4().hex}"
    os.chmod(tmp_path, 0o777)
    assert score_program(GOOD, CALL_TESTS, timeout_s=3.0, mode=mode, warm=False).score == 1.0
    res = score_program(f"open({str(target)!r}, 'w').write('x')\n" + GOOD, CALL_TESTS, 3.0, mode, warm=False)
    assert res.score == 0.0 and res.reason.startswith("error: ") and not target.exists()
    res = score_program("def f(x):\n    while True:\n        pass\n", CALL_TESTS, 1.0, mode, warm=False)
    assert (res.score, res.reason) == (0.0, "timeout")
    assert _sandbox_processes() == []


@pytest.mark.parametrize("mode", MODES)
def test_sandbox_started_ahead_is_used_once_and_killed_on_close(mode, tmp_path):
    box = Sandbox(mode, warm=True)
    try:
        box.prepare()  # what a reward worker does after sending a result back
        assert len(_sandbox_processes()) >= 1  # the interpreter waiting for its program
        hits = box.warm_hits
        target = tmp_path / f"escaped-{uuid.uuid4().hex}"
        os.chmod(tmp_path, 0o777)
        res = box.run({"main.py": f"open({str(target)!r}, 'w').write('x')\n"}, "main.py", timeout_s=3.0)
        assert box.warm_hits == hits + 1 and res.status == "error" and not target.exists()
        box.prepare()
        # a fresh sandbox: the file the last program wrote in its scratch directory is gone
        res = box.run({"a.py": "open('x', 'w').write('1')\n"}, "a.py", timeout_s=3.0)
        assert res.status == "ok"
        box.prepare()
        res = box.run({"b.py": "import os\nprint(os.path.exists('x'), sorted(os.environ))\n"}, "b.py", timeout_s=3.0)
        assert res.status == "ok" and res.stdout.split()[0] == "False" and "TRAINER" not in res.stdout
        assert box.warm_hits == hits + 3
    finally:
        box.close()
    time.sleep(0.2)
    assert _sandbox_processes() == []


def test_partial_credit_is_the_share_of_tests_passed_and_errors_still_score_zero():
    prog = "def f(x):\n    return 5 if x == 1 else 17 if x == 5 else 0\n"  # passes 2 of 3
    res = score_program(prog, CALL_TESTS, timeout_s=3.0, partial=True)
    assert res.score == pytest.approx(2 / 3) and res.reason == "wrong answer on test 3 of 3"
    assert score_program(prog, CALL_TESTS, timeout_s=3.0).score == 0.0  # off by default
    assert score_program(GOOD, CALL_TESTS, timeout_s=3.0, partial=True).score == 1.0
    crash = "def f(x):\n    if x == 5:\n        raise ValueError('no')\n    return 3 * x + 2\n"
    assert score_program(crash, CALL_TESTS, timeout_s=3.0, partial=True).score == 0.0
