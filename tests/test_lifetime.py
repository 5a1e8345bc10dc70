"""No orphans: every process a run starts ends when its driver ends, including after SIGKILL.

A real `train` run (tiny model, local Ray, a vLLM engine with its engine-core process, a spawned reward
worker and multiprocessing's resource tracker) is started in a session of its own. As soon as all of those
are up, every descendant of the driver is recorded (pid and start time, with psutil), then the driver alone,
or its whole process group, is SIGKILLed; within a few seconds none of the recorded processes may be alive.
The unit tests check the pieces (`megatron_sortedrl/lifetime.py`) on plain Python children.

    python -m pytest tests/test_lifetime.py -q        # about 2 minutes on 2 cores (the two kills are slow)
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from megatron_sortedrl import lifetime


def _alive(procs: list[psutil.Process]) -> list[psutil.Process]:
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


def _processes(pids: list[int]) -> list[psutil.Process]:
    out = []
    for pid in pids:
        try:
            out.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass
    return out


def _describe(procs: list[psutil.Process]) -> str:
    lines = []
    for p in procs:
        try:
            lines.append(f"{p.pid} ppid={p.ppid()} {' '.join(p.cmdline())[:150]}")
        except psutil.Error:
            lines.append(f"{p.pid} (gone)")
    return "\n".join(lines)


def _wait_gone(procs: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    end = time.monotonic() + timeout
    left = _alive(procs)
    while left and time.monotonic() < end:
        time.sleep(0.1)
        left = _alive(left)
    return left


def _kill_all(procs: list[psutil.Process]) -> None:
    for p in _alive(procs):
        try:
            p.kill()
        except psutil.Error:
            pass


# ------------------------------------------------------------------------------------------ the pieces

_SLEEPER = "import time; time.sleep(120)"


def _watched_parent(script: str) -> subprocess.Popen:
    """A Python parent that runs `script` (which starts children) and then sleeps; its own session."""
    return subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                            start_new_session=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})


def test_guard_kills_token_carriers_after_sigkill_of_the_parent():
    # The parent guards itself, then starts a child in a new session (out of its process group) which starts a
    # grandchild, and a child with an empty environment (no token: found through the tree the watchdog
    # records, as Ray's agents are once their process title has overwritten their environment): after SIGKILL of
    # the parent, the watchdog must end all three, though none is in its group.
    script = f"""
import subprocess, sys
from megatron_sortedrl import lifetime
lifetime.guard()
c = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; "
                      "subprocess.Popen([sys.executable, '-c', {_SLEEPER!r}]); time.sleep(120)"], start_new_session=True)
bare = subprocess.Popen([sys.executable, "-c", {_SLEEPER!r}], start_new_session=True, env={{}})
print(c.pid, bare.pid, flush=True)
import time; time.sleep(120)
"""
    proc = _watched_parent(script)
    try:
        child_pid, bare_pid = map(int, proc.stdout.readline().split())
        child = psutil.Process(child_pid)
        end = time.monotonic() + 20
        while len(child.children()) < 1 and time.monotonic() < end:
            time.sleep(0.05)
        family = [child, *child.children(), psutil.Process(bare_pid)]
        assert len(family) == 3
        assert lifetime.TOKENS_VAR.encode() not in open(f"/proc/{bare_pid}/environ", "rb").read()
        time.sleep(1.5)  # the watchdog records the tree every 0.5 s
        watchdogs = [p for p in psutil.Process(proc.pid).children() if "lifetime.py" in " ".join(p.cmdline())]
        assert len(watchdogs) == 1 and watchdogs[0].pid != child.pid
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        left = _wait_gone(family + watchdogs, 10)
        assert not left, _describe(left)
    finally:
        os.killpg(proc.pid, signal.SIGKILL) if proc.poll() is None else None
        _kill_all(family if "family" in locals() else [])


def test_guard_close_keeps_children_and_ends_the_watchdog():
    script = f"""
import subprocess, sys
from megatron_sortedrl import lifetime
g = lifetime.guard()
c = subprocess.Popen([sys.executable, "-c", {_SLEEPER!r}])
print(c.pid, g.watchdog_pid, flush=True)
g.close()
import os; print(os.environ.get(lifetime.TOKENS_VAR, "unset"), flush=True)
import time; time.sleep(120)
"""
    proc = _watched_parent(script)
    try:
        child_pid, wd_pid = map(int, proc.stdout.readline().split())
        assert proc.stdout.readline().strip() == "unset"  # the environment is as before the guard
        child = psutil.Process(child_pid)
        end = time.monotonic() + 5
        while _alive(_processes([wd_pid])):
            assert time.monotonic() < end, "the watchdog did not end at close"
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)  # after close, ending the process is no longer the guard's business
        proc.wait(10)
        time.sleep(1.0)
        assert _alive([child]), "close() must disarm the guard"
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        _kill_all([psutil.Process(child_pid)] if "child_pid" in locals() else [])


def test_die_with_parent_ends_a_child_when_its_parent_dies():
    script = f"""
import subprocess, sys
c = subprocess.Popen([sys.executable, "-c", "from megatron_sortedrl import lifetime; import os; "
                      "lifetime.die_with_parent(os.getppid()); " + {_SLEEPER!r}], start_new_session=True)
print(c.pid, flush=True)
import time; time.sleep(120)
"""
    proc = _watched_parent(script)
    child = psutil.Process(int(proc.stdout.readline()))
    try:
        time.sleep(1.0)  # past the prctl call
        assert _alive([child])
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        assert not _wait_gone([child], 5), "PR_SET_PDEATHSIG did not end the child"
    finally:
        _kill_all([child])


def test_die_with_parent_when_the_parent_is_already_gone():
    # The race prctl cannot close by itself: the parent died before the call. Expected parent 1 never matches.
    proc = subprocess.run([sys.executable, "-c", "from megatron_sortedrl import lifetime; "
                           "lifetime.die_with_parent(expected_parent=1); print('survived')"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == -signal.SIGKILL and "survived" not in proc.stdout


def test_reward_workers_die_with_the_pool_process(tmp_path):
    # No guard here: a reward worker busy in a slow reward function (a sandboxed program, a judge) must end at
    # once when the pool's process is SIGKILLed; an idle one ends anyway, on the closed pipe.
    (tmp_path / "msrl_slow_reward.py").write_text("import time\ndef reward(sample, ground_truth):\n"
                                                  "    time.sleep(120)\n    return 1.0\n")
    script = f"""
import sys; sys.path.insert(0, {str(tmp_path)!r})
from megatron_sortedrl.reward_pool import RewardPool
from megatron_sortedrl.sample import Sample
if __name__ == "__main__":
    pool = RewardPool("msrl_slow_reward.reward", num_workers=1)
    print(pool.workers[0].proc.pid, flush=True)
    pool.submit(Sample(prompt_id="p", index=0, prompt_tokens=[1], response_tokens=[2]))
    while not pool.workers[0].tasks:
        pool.poll()
    print("busy", flush=True)
    import time; time.sleep(120)
"""
    proc = _watched_parent(script)
    worker = psutil.Process(int(proc.stdout.readline()))
    try:
        assert proc.stdout.readline().strip() == "busy"
        time.sleep(0.5)
        family = psutil.Process(proc.pid).children(recursive=True)
        assert worker in family
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        left = _wait_gone(family, 10)
        assert not left, _describe(left)
    finally:
        _kill_all([worker])


def test_token_scan_finds_only_carriers():
    mine = lifetime.processes_with_token("no-such-token-" + os.urandom(4).hex())
    assert mine == []


# ------------------------------------------------------------------------------------------ a real run


def _run_overrides(model_dir: Path, run_dir: Path) -> list[str]:
    return [f"model.path={model_dir}", f"logging.run_dir={run_dir}", "trainer.total_steps=1000",
            "data.num_train_prompts=16", "data.num_eval_prompts=4", "trainer.warmup_sft_steps=1000",
            "rollout.max_response_length=48", "logging.tensorboard=false", "scheduler.rollout_batch_size=4",
            "scheduler.update_batch_size=8", "scheduler.group_size=8", "data.reward_workers=1"]


def _is_engine_core(p: psutil.Process) -> bool:
    try:
        return "EngineCore" in p.name() or "EngineCore" in " ".join(p.cmdline())
    except psutil.Error:
        return False


def _is_spawned(p: psutil.Process, what: str) -> bool:
    try:
        return what in " ".join(p.cmdline())
    except psutil.Error:
        return False


@pytest.mark.slow
@pytest.mark.parametrize("target", ["driver", "group"])
def test_sigkill_of_the_driver_leaves_no_process_of_the_run(tiny_model_dir, tmp_path, target):
    log = tmp_path / "log.txt"
    # A session of its own, as a batch system starts the run; the warm-up is long so that the kill lands in it,
    # with Ray, the trainer, the engine and the reward pool all up.
    proc = subprocess.Popen([sys.executable, "-m", "megatron_sortedrl", "train", "configs/tiny_cpu.yaml",
                             *_run_overrides(tiny_model_dir, tmp_path / "run")],
                            stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    family: list[psutil.Process] = []
    try:
        driver = psutil.Process(proc.pid)
        end = time.monotonic() + 300
        while time.monotonic() < end:
            assert proc.poll() is None, log.read_text()[-3000:]
            family = driver.children(recursive=True)
            if (any(_is_engine_core(p) for p in family) and any(_is_spawned(p, "spawn_main") for p in family)
                    and any(_is_spawned(p, "resource_tracker") for p in family)
                    and "warm-up" in log.read_text()):
                break
            time.sleep(0.5)
        else:
            raise AssertionError(f"the run did not come up in time:\n{log.read_text()[-3000:]}")
        time.sleep(1.0)
        family = driver.children(recursive=True)  # everything up to this moment
        assert len(family) >= 6, _describe(family)  # gcs, raylet, trainer and engine actors, engine core, reward
        if target == "driver":
            os.kill(proc.pid, signal.SIGKILL)
        else:
            os.killpg(proc.pid, signal.SIGKILL)
        t_kill = time.monotonic()
        proc.wait(30)
        left = _wait_gone(family, 15)
        assert not left, f"still alive after SIGKILL of the {target}:\n{_describe(left)}\n{log.read_text()[-2000:]}"
        print(f"{len(family)} processes of the run gone {time.monotonic() - t_kill:.1f} s after SIGKILL of the {target}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
        _kill_all(family)


# ------------------------------------------------------------------------------------------ the suite's own check


def test_the_suite_reports_and_ends_a_process_a_test_left_behind(tmp_path):
    # An inner session with this suite's conftest, whose one test leaves a process in a session of its own
    # (as a SIGKILLed run leaves its children): the session must name it, kill it, and fail (or only warn).
    pidfile = tmp_path / "pid"
    (tmp_path / "test_leak.py").write_text(
        "import subprocess, sys\n"
        "def test_leak():\n"
        f"    p = subprocess.Popen([sys.executable, '-c', {_SLEEPER!r}], start_new_session=True)\n"
        f"    open({str(pidfile)!r}, 'w').write(str(p.pid))\n")
    tests_dir = Path(__file__).resolve().parent
    env = {**os.environ, "MSRL_LEFTOVERS_GRACE_S": "1", "MSRL_LEFTOVERS": "fail",
           "PYTHONPATH": os.pathsep.join([str(tests_dir), *sys.path])}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "conftest", "-q", "-p", "no:cacheprovider",
                           "-p", "no:hypothesispytest",
                           "--rootdir", str(tmp_path), str(tmp_path / "test_leak.py")],
                          capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    leaked = int(pidfile.read_text())
    try:
        assert "1 process(es) started by the tests outlived them" in proc.stdout, proc.stdout[-2000:]
        assert f"pid {leaked} " in proc.stdout
        assert proc.returncode == 1, proc.stdout[-2000:]
        assert not _wait_gone(_processes([leaked]), 5), "the leftover was not killed"
    finally:
        _kill_all(_processes([leaked]))
