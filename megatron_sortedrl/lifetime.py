"""Process lifetime: every process a run starts ends when the process that started the run ends, even by SIGKILL.

    from megatron_sortedrl import lifetime
    guard = lifetime.guard()        # in the driver, before Ray, engines or reward workers start
    ...                             # everything started from here on belongs to the run
    guard.close(end_rest=True)      # normal end, after the run has closed what it started

    lifetime.die_with_parent()      # first thing in a child we spawn ourselves (reward worker, sandbox)

How, and why three mechanisms:
* A token in the environment. `guard()` appends a fresh id to `MSRL_RUN_TOKENS` in `os.environ`; every process
  started afterwards inherits it, whatever its parent, session or process group: the local Ray's GCS, raylet,
  agents and workers, the engine actors' vLLM engine-core and worker processes, reward workers, multiprocessing's
  resource trackers. A process's initial environment stays readable in `/proc/<pid>/environ` after its parent
  is gone, so the run's processes can be found even once they are re-parented to init.
* A watchdog: a small process in a session of its own (SIGKILL of the guarded process's group does not reach
  it) that waits on a pidfd of the guarded process and records that process's descendants every 0.5 s (the
  token alone misses some: Ray's agents overwrite their environment when they set their process title). When
  the guarded process ends without `close()`, the watchdog sends SIGTERM to every process carrying the token
  or recorded (with their descendants; a recorded pid counts only with its recorded start time), SIGKILL to
  those left after `grace_s`, and repeats until none is left (a raylet may start a worker while it is being
  killed).
  multiprocessing's resource trackers are left to end on their own once every process that used them is gone,
  so that they can unlink the shared memory those left behind; they are killed only if they do not. The
  watchdog carries no token itself and exits after its sweep.
* `die_with_parent()` (Linux `PR_SET_PDEATHSIG`) in the children we spawn ourselves: they die at once with their
  parent, without waiting for a watchdog. The signal fires when the parent *thread* that started the child
  exits, so only children started from a thread that lives as long as the pool (the main thread) may use it.

An engine actor killed by `ray.kill` (a hung engine, a relayout) already takes its vLLM engine-core process
with it (seen on CPU with the uni and mp executors, also with Ray's `kill_child_processes_on_worker_exit`
off), so engine actors are not guarded separately. What Ray does not end is itself: a SIGKILLed driver takes
the local raylet with it, and Ray's dashboard and runtime-env agents outlive both, re-parented to init. Any
process may guard itself (`guard()` nests: the inner guard's processes carry both tokens).

Left out: processes that clear their environment (the code sandbox: bubblewrap's `--die-with-parent`, or
`die_with_parent()` in the fallback), processes on other nodes of an attached Ray cluster (Ray ends a dead
driver's actors there), and systems other than Linux (no
`/proc`, no pidfd: `guard()` returns a guard that does nothing).

Tests: `python -m pytest tests/test_lifetime.py -q` (the SIGKILLs of a real run are marked slow).
"""

from __future__ import annotations

import ctypes
import functools
import os
import selectors
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass

TOKENS_VAR = "MSRL_RUN_TOKENS"
PR_SET_PDEATHSIG = 1
_TRACKER = "resource_tracker"  # multiprocessing's resource tracker (in its command line)


@functools.lru_cache(maxsize=1)
def libc() -> ctypes.CDLL | None:
    """The C library with `prctl`, or None off Linux. Load it before a fork whose child calls
    `die_with_parent` (a `preexec_fn`): loading a library between fork and exec can deadlock."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        lib = ctypes.CDLL(None, use_errno=True)
        return lib if hasattr(lib, "prctl") else None
    except OSError:
        return None


def die_with_parent(expected_parent: int | None = None, sig: int = signal.SIGKILL) -> None:
    """Asks the kernel to send `sig` to this process when its parent (thread) dies (Linux; elsewhere nothing).

    `expected_parent`: the parent's pid as the parent knew it; if the parent has died before this call the
    process has already been re-parented, so it kills itself at once instead of waiting for a signal that will
    never come. Called in a child after any change of user id (which clears the setting)."""
    lib = libc()
    if lib is None:
        return
    lib.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    if expected_parent is not None and os.getppid() != expected_parent:
        os.kill(os.getpid(), sig)


@dataclass
class Guard:
    """The handle `guard()` returns; `close()` disarms the watchdog and restores the environment."""

    token: str = ""
    watchdog: subprocess.Popen | None = None

    @property
    def watchdog_pid(self) -> int:
        return self.watchdog.pid if self.watchdog is not None else -1

    def close(self, end_rest: bool = False) -> None:
        """Disarms the watchdog and restores the environment; `end_rest=True` first ends whatever still carries
        the token (what a normal shutdown missed)."""
        if self.watchdog is None:
            return
        if end_rest:
            sweep(self.token, trackers=False)
        try:
            self.watchdog.stdin.write(b"close\n")
            self.watchdog.stdin.close()
        except OSError:  # it died; nothing left to disarm
            pass
        try:
            self.watchdog.wait(10)
        except subprocess.TimeoutExpired:
            self.watchdog.kill()
            self.watchdog.wait()
        self.watchdog = None
        rest = [t for t in os.environ.get(TOKENS_VAR, "").split(":") if t and t != self.token]
        if rest:
            os.environ[TOKENS_VAR] = ":".join(rest)
        else:
            os.environ.pop(TOKENS_VAR, None)


def guard(grace_s: float = 3.0) -> Guard:
    """Marks everything this process starts from now on, and starts the watchdog that ends it all when this
    process ends without `close()`. Returns a `Guard` that does nothing where Linux's pidfd is missing."""
    if not sys.platform.startswith("linux") or not hasattr(os, "pidfd_open"):
        return Guard()
    try:
        pidfd = os.pidfd_open(os.getpid())
    except OSError:  # a kernel before 5.3
        return Guard()
    token = uuid.uuid4().hex[:16]
    previous = os.environ.get(TOKENS_VAR)
    # The watchdog itself carries no token: a sweep (its own or an outer one) must not end it before it is done.
    env = {k: v for k, v in os.environ.items() if k != TOKENS_VAR}
    try:
        # This file as a script, isolated (-I): the standard library is all it needs, wherever the package is.
        watchdog = subprocess.Popen([sys.executable, "-I", os.path.abspath(__file__), str(pidfd), str(os.getpid()),
                                     token, str(grace_s)], stdin=subprocess.PIPE, pass_fds=[pidfd], env=env,
                                    start_new_session=True, stdout=subprocess.DEVNULL)
    finally:
        os.close(pidfd)
    os.environ[TOKENS_VAR] = f"{previous}:{token}" if previous else token
    return Guard(token, watchdog)


# ------------------------------------------------------------------------------------------ finding the run


def processes_with_token(token: str, var: str = TOKENS_VAR) -> list[int]:
    """Pids of the live processes (but this one) whose initial environment carries `token` in `var` (a
    colon-separated list)."""
    out = []
    me, key = os.getpid(), var.encode() + b"="
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == me:
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                environ = f.read()
        except OSError:  # gone, or not ours to read
            continue
        for item in environ.split(b"\0"):
            if item.startswith(key) and token.encode() in item[len(key):].split(b":"):
                out.append(int(name))
                break
    return out


def _stat(pid: int | str) -> tuple[int, int] | None:
    """(parent pid, start time in clock ticks) of a live process, from /proc/<pid>/stat; None if gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()  # the name before it may hold spaces and parentheses
    except (OSError, IndexError):
        return None
    return (int(fields[1]), int(fields[19])) if fields[0] != b"Z" else None


def descendants(*roots: int) -> dict[int, int]:
    """{pid: start time} of every live descendant of the `roots` (one pass over /proc)."""
    children: dict[int, list[int]] = {}
    starts: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if name.isdigit() and (st := _stat(name)) is not None:
            children.setdefault(st[0], []).append(int(name))
            starts[int(name)] = st[1]
    out: dict[int, int] = {}
    todo = list(roots)
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in out:
                out[child] = starts[child]
                todo.append(child)
    return out


def _is_tracker(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return _TRACKER.encode() in f.read()
    except OSError:
        return False


def _signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _targets(token: str, known: dict[int, int]) -> list[int]:
    """The token's carriers, the `known` processes ({pid: start time}) still alive as themselves (a reused pid
    has another start time), and the live descendants of all of them."""
    found = set(processes_with_token(token))
    found.update(pid for pid, start in known.items() if (st := _stat(pid)) is not None and st[1] == start)
    found.update(descendants(*found))
    found.discard(os.getpid())
    return sorted(found)


def sweep(token: str, grace_s: float = 3.0, limit_s: float = 60.0, trackers: bool = True,
          known: dict[int, int] | None = None) -> int:
    """Ends every process carrying `token` and every process in `known` ({pid: start time}, the descendants
    the watchdog saw), with their descendants: SIGTERM, SIGKILL after `grace_s`, again until none is left (or
    `limit_s` passed). Resource trackers get until the rest is gone plus `grace_s` to end on their own;
    `trackers=False` leaves them alone (a live process's own tracker ends with it). Returns how many distinct
    processes were found."""
    seen: set[int] = set()
    end = time.monotonic() + limit_s
    term_sent: dict[int, float] = {}
    idle_rounds = 0
    while time.monotonic() < end:
        found = _targets(token, known or {})
        others = [p for p in found if not _is_tracker(p)]
        trackers_left = [p for p in found if p not in others] if trackers else []
        found = others + trackers_left
        now = time.monotonic()
        fresh = [p for p in others if p not in term_sent]
        _signal_all(fresh, signal.SIGTERM)
        term_sent.update((p, now) for p in fresh)
        _signal_all([p for p in others if now - term_sent[p] > grace_s], signal.SIGKILL)
        if not others:  # trackers end once their clients are gone; kill them only if they do not
            for p in trackers_left:
                term_sent.setdefault(p, now)
            _signal_all([p for p in trackers_left if now - term_sent[p] > grace_s], signal.SIGKILL)
        seen.update(found)
        idle_rounds = idle_rounds + 1 if not found else 0
        if idle_rounds >= 2:
            break
        time.sleep(0.1)
    return len(seen)


def _watch(pidfd: int, pid: int, token: str, grace_s: float, poll_s: float = 0.5) -> int:
    """The watchdog: waits for the guarded process `pid` to end (pidfd readable) or for `close` on stdin;
    meanwhile records its descendants every `poll_s`, for those whose environment cannot be read later (Ray's
    agents rewrite theirs when they set their process title)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C in the terminal is for the run, not for us
    sel = selectors.DefaultSelector()
    sel.register(pidfd, selectors.EVENT_READ, "exited")
    sel.register(sys.stdin.fileno(), selectors.EVENT_READ, "stdin")
    known: dict[int, int] = {}
    while True:
        known.update(descendants(pid))
        for key, _ in sel.select(poll_s):
            if key.data == "stdin":
                line = os.read(sys.stdin.fileno(), 64)
                if line.startswith(b"close"):
                    return 0
                if line:
                    continue
                sel.unregister(sys.stdin.fileno())  # EOF without close: the guarded process is ending
                continue
            known.pop(os.getpid(), None)
            n = sweep(token, grace_s, known=known)
            if n:
                print(f"lifetime: the run's process ended without closing; ended {n} of its processes",
                      file=sys.stderr, flush=True)
            return 0


if __name__ == "__main__":
    sys.exit(_watch(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], float(sys.argv[4])))
