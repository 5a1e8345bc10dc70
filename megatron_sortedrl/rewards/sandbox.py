"""Runs an untrusted Python program (a model's answer to a code task) isolated, and says why it failed.

    from megatron_sortedrl.rewards.sandbox import Sandbox
    box = Sandbox()                                   # picks bubblewrap when it works here, else the fallback
    print(box.describe())                             # the one line a run prints: which isolation is active
    res = box.run({"main.py": "print(1)"}, "main.py", timeout_s=5)
    res.status, res.reason, res.stdout                # "ok" | "timeout" | "memory" | "killed" | "error" | ...

Two modes, the stronger one picked when it works (probed once per process by running `true` in it):

* `bwrap` (Debian's `bubblewrap`, installed by `tools/setup_env.sh`): the program runs in new user, PID,
  network, IPC and UTS namespaces (no network at all, it sees only its own processes), with the whole file
  system mounted read-only, `/tmp`, `/home`, `/root`, `/run`, `/var/tmp` and `/dev/shm` hidden behind
  empty read-only mounts, and only its scratch directory writable; an empty environment; all capabilities
  dropped; a new session; it dies with its parent.
* `fallback` (when bubblewrap is missing or user namespaces are blocked): a fresh session and process
  group, no inherited descriptors, an empty environment, the scratch directory as working directory, the
  same rlimits, death with its parent (`PR_SET_PDEATHSIG`), and an in-process audit hook that refuses
  sockets, subprocesses and writes outside the scratch directory. Weaker: an audit hook is not a security boundary (ctypes can get past it) and the file
  system is not remounted, so this mode keeps honest mistakes contained, not a determined attacker.

In both modes, when we run as root, the program runs under a uid of its own (never one of a real user's),
so the kernel counts its processes (RLIMIT_NPROC bounds a fork bomb), it cannot touch files of root, and
after the run every process of that uid is killed: nothing it started survives. Limits: CPU seconds
(RLIMIT_CPU), address space (RLIMIT_AS: a memory hog gets MemoryError), processes (RLIMIT_NPROC), file size
(RLIMIT_FSIZE, which also caps its output: stdout goes to a file), open files; plus a wall-clock timeout
after which its whole process group (and, in bwrap, its PID namespace) is killed.

The program's interpreter is the system's `python3` (`/usr/bin/python3`) rather than the project's
virtual environment, which a dropped uid may not be allowed to read; programs get the standard library.

Warm start (`Sandbox(warm=True)`, what the code reward uses): starting bubblewrap and an interpreter costs
0.1 s on an idle machine and up to a second or two on a loaded one, per program, and that cost used to sit
on the reward critical path of the last samples of a round. A warm sandbox starts the *next* run's
sandboxed interpreter as soon as a run ends (its own scratch directory, uid, namespaces and rlimits, all
fresh), where it waits on stdin; `run` then only sends it the files and its limits, and the interpreter
writes them into its scratch directory, lowers its CPU limit and runs the entry in place. Each run still
gets a sandbox of its own, never reused; only its start-up moves off the critical path. A waiting
sandbox that died meanwhile is replaced by a cold start. `close()` (also at exit) kills the waiting one.

Written here because the isolation tools in the distribution (bubblewrap) do the namespaces but not the
rlimits, uid and clean-up around them. Left out: seccomp filters and cgroup limits (bwrap supports both;
they would need a policy file and a writable cgroup tree, which these machines do not give us).
Tests: `python -m pytest tests/test_sandbox.py -q`.
"""

from __future__ import annotations

import json
import os
import random
import resource
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from megatron_sortedrl import lifetime

SANDBOX_PYTHON_CANDIDATES = ("/usr/bin/python3", "/usr/local/bin/python3")
_HIDDEN = ("/tmp", "/var/tmp", "/dev/shm", "/home", "/root", "/run")
_UID_RANGE = (200_000, 260_000)  # far above real users' uids; one per run, so no two runs share a count


@dataclass
class Limits:
    cpu_s: int = 10  # CPU seconds (RLIMIT_CPU; the wall-clock timeout usually fires first)
    memory_mb: int = 512  # address space (RLIMIT_AS)
    processes: int = 16  # processes of the sandbox uid (RLIMIT_NPROC); bwrap itself needs 2
    file_mb: int = 8  # largest file written, stdout included (RLIMIT_FSIZE)
    open_files: int = 64


@dataclass
class SandboxResult:
    status: str  # ok | timeout | memory | cpu | output_limit | killed | error
    returncode: int | None
    stdout: str
    stderr: str
    seconds: float
    leftover_processes: int = 0  # processes of the run's uid still alive after the program exited (killed)
    extra: dict = field(default_factory=dict)

    @property
    def reason(self) -> str:
        """One line saying why the run did not end normally ('' when it did)."""
        if self.status == "ok":
            return ""
        tail = self.stderr.strip().splitlines()[-1:] if self.stderr.strip() else []
        return self.status + (f": {tail[0][:200]}" if tail and self.status in ("error", "memory") else "")


def _probe_bwrap() -> str:
    """'' when bubblewrap runs a program here; else why not (missing, or namespaces blocked)."""
    exe = shutil.which("bwrap")
    if exe is None:
        return "bubblewrap is not installed (apt-get install bubblewrap)"
    try:
        p = subprocess.run([exe, "--ro-bind", "/", "/", "--unshare-all", "--die-with-parent", "true"],
                           capture_output=True, text=True, timeout=20, preexec_fn=_as_uid(_pick_uid()) if _root() else None)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"bubblewrap failed to start ({exc})"
    if p.returncode != 0:
        return f"bubblewrap cannot create namespaces here ({p.stderr.strip()[:160]})"
    return ""


_MODE_CACHE: dict[str, str] = {}


def detect_mode(requested: str = "auto") -> tuple[str, str]:
    """(mode, why): 'bwrap' or 'fallback'. requested='fallback' forces the weaker mode; 'bwrap' requires it."""
    if requested == "fallback":
        return "fallback", "requested"
    if "why" not in _MODE_CACHE:
        _MODE_CACHE["why"] = _probe_bwrap()
    why = _MODE_CACHE["why"]
    if why and requested == "bwrap":
        from megatron_sortedrl.errors import ConfigError

        raise ConfigError("reward.sandbox", "bwrap", f"auto or fallback here: {why}")
    return ("fallback", why) if why else ("bwrap", "")


def _root() -> bool:
    return os.geteuid() == 0


def _pick_uid() -> int:
    return random.SystemRandom().randint(*_UID_RANGE)


def _as_uid(uid: int):
    def drop() -> None:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
    return drop


def _python() -> str:
    for cand in SANDBOX_PYTHON_CANDIDATES:
        if os.access(cand, os.X_OK):
            return cand
    import sys

    return sys.executable


# Installed in the fallback mode before the program runs: refuses what the namespaces would have taken away.
_FALLBACK_GUARD = r'''
import sys, os
_SCRATCH = os.path.realpath(os.getcwd())
def _guard(event, args):
    if event in ("socket.connect", "socket.bind", "socket.sendto", "socket.getaddrinfo") or \
       event in ("subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "pty.spawn"):
        raise PermissionError(f"sandbox: {event} is not allowed")
    if event == "open" and len(args) > 1 and isinstance(args[1], str) and any(c in args[1] for c in "wax+"):
        path = args[0]
        if isinstance(path, (str, bytes)):
            path = os.path.realpath(os.fsdecode(path))
            if not (path == _SCRATCH or path.startswith(_SCRATCH + os.sep)):
                raise PermissionError(f"sandbox: writing {path} is outside the scratch directory")
sys.addaudithook(_guard)
del _guard
'''


# The warm sandbox's interpreter runs this first and waits: one JSON line on stdin brings the files, the
# entry, the CPU limit and the program's stdin; it writes the files into its scratch directory (its cwd),
# lowers RLIMIT_CPU to what this run allows (a process may always lower its own limit) and runs the entry
# in place, so interpreter and sandbox start-up were paid before the program existed.
_WARM_BOOT = r"""
import io, json, os, resource, sys
_p = json.loads(sys.stdin.readline() or "null")
if _p is None:
    os._exit(0)
for _n, _t in _p["files"].items():
    with open(_n, "w") as _f:
        _f.write(_t)
_u = resource.getrusage(resource.RUSAGE_SELF)
_c = min(resource.getrlimit(resource.RLIMIT_CPU)[1], int(_u.ru_utime + _u.ru_stime) + _p["cpu_s"])
resource.setrlimit(resource.RLIMIT_CPU, (_c, _c))
sys.stdin = io.StringIO(_p["stdin"])
_e = _p["entry"]
del _p, _n, _t, _f, _u, _c
exec(compile(open(_e).read(), _e, "exec"), {"__name__": "__main__", "__file__": _e})
"""


@dataclass
class _Waiting:
    """A pre-started sandbox waiting for its program (see "Warm start" in the module docstring)."""

    proc: subprocess.Popen
    scratch: Path
    uid: int | None
    out: object
    err: object


class Sandbox:
    def __init__(self, mode: str = "auto", limits: Limits | None = None, python: str | None = None,
                 warm: bool = False) -> None:
        if mode not in ("auto", "bwrap", "fallback"):
            raise ValueError(f"sandbox mode must be auto, bwrap or fallback, got {mode!r}")
        self.mode, self.why = detect_mode(mode)
        self.limits = limits or Limits()
        self.python = python or _python()
        self.warm = warm
        self._waiting: _Waiting | None = None
        self.warm_hits = 0  # runs that found their sandbox already started
        if warm:
            import atexit

            atexit.register(self.close)

    def describe(self) -> str:
        if self.mode == "bwrap":
            return ("code sandbox: bubblewrap (read-only root, no network, own PID namespace, own uid, rlimits, "
                    "empty environment)")
        return (f"code sandbox: FALLBACK (rlimits, own uid when root, new session, no fds, empty environment, "
                f"audit hook; no namespaces) because {self.why or 'requested'}")

    def _preexec(self, uid: int | None, timeout_s: float):
        lim = self.limits
        parent = os.getpid()
        lifetime.libc()  # loaded here: no dlopen between fork and exec

        def setup() -> None:
            os.setsid()  # its own session and process group: killed as a whole
            cpu = max(1, min(lim.cpu_s, int(timeout_s) + 1))
            for res, val in ((resource.RLIMIT_CPU, cpu), (resource.RLIMIT_AS, lim.memory_mb << 20),
                             (resource.RLIMIT_FSIZE, lim.file_mb << 20), (resource.RLIMIT_NOFILE, lim.open_files),
                             (resource.RLIMIT_CORE, 0)):
                resource.setrlimit(res, (val, val))
            if uid is not None:
                resource.setrlimit(resource.RLIMIT_NPROC, (lim.processes, lim.processes))
                _as_uid(uid)()
            # After the uid change, which clears it: the program dies with the process that started it.
            lifetime.die_with_parent(parent)
        return setup

    def run(self, files: dict[str, str], entry: str, timeout_s: float = 5.0, stdin: str = "") -> SandboxResult:
        """Writes `files` into a fresh scratch directory, runs `python entry` there, returns what happened."""
        if self.warm:
            return self._run_warm(files, entry, timeout_s, stdin)
        uid = _pick_uid() if _root() else None
        _become_subreaper()
        scratch = Path(tempfile.mkdtemp(prefix="msrl-sandbox-"))
        try:
            return self._run(scratch, files, entry, timeout_s, stdin, uid)
        finally:
            if uid is not None:
                _kill_uid(uid)
            shutil.rmtree(scratch, ignore_errors=True)

    # ------------------------------------------------------------------ warm start

    def _start_waiting(self) -> _Waiting:
        """Starts a sandboxed interpreter that waits on stdin for its program (not yet limited in wall time)."""
        uid = _pick_uid() if _root() else None
        _become_subreaper()
        scratch = Path(tempfile.mkdtemp(prefix="msrl-sandbox-"))
        work = scratch / "work"
        work.mkdir()
        (work / "_boot.py").write_text((_FALLBACK_GUARD if self.mode == "fallback" else "") + _WARM_BOOT)
        if uid is not None:
            for p in (scratch, work, work / "_boot.py"):
                os.chown(p, uid, uid)
        argv = [self.python, "-I", "-S", "-B", "_boot.py"]
        if self.mode == "bwrap":
            argv = self._bwrap_argv(work) + argv
        # Open for the waiting sandbox's whole life, not a block: closed in _drop_waiting.
        out, err = open(scratch / "stdout", "wb"), open(scratch / "stderr", "wb")  # noqa: SIM115
        # The CPU limit here is the largest; the boot lowers it to the run's own once it knows it.
        proc = subprocess.Popen(argv, cwd=work, env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
                                stdin=subprocess.PIPE, stdout=out, stderr=err, close_fds=True,
                                preexec_fn=self._preexec(uid, float(self.limits.cpu_s)))  # noqa: PLW1509 (as in _run)
        return _Waiting(proc, scratch, uid, out, err)

    def _drop_waiting(self, w: _Waiting) -> None:
        _killpg(w.proc.pid)
        try:
            w.proc.kill()
        except OSError:
            pass
        w.proc.wait()
        if w.uid is not None:
            _kill_uid(w.uid)
        w.out.close()
        w.err.close()
        shutil.rmtree(w.scratch, ignore_errors=True)

    def prepare(self) -> None:
        """Starts the next run's sandbox: what a worker does while it waits for its next sample (the reward
        pool calls it after sending a result back)."""
        if self._waiting is None:
            try:
                self._waiting = self._start_waiting()
            except OSError:
                self._waiting = None

    def close(self) -> None:
        """Kills the sandbox waiting for the next program, if any."""
        w, self._waiting = self._waiting, None
        if w is not None:
            self._drop_waiting(w)

    def _run_warm(self, files: dict[str, str], entry: str, timeout_s: float, stdin: str) -> SandboxResult:
        w, self._waiting = self._waiting, None
        if w is not None and w.proc.poll() is None:
            self.warm_hits += 1
        else:  # none started ahead (first run, no prepare) or it died meanwhile: start one now, cold
            if w is not None:
                self._drop_waiting(w)
            try:
                w = self._start_waiting()
            except OSError as exc:
                return SandboxResult("error", None, "", f"could not start the sandbox: {exc}", 0.0)
        try:
            return self._finish_waiting(w, files, entry, timeout_s, stdin)
        finally:
            # Torn down now: nothing the program started outlives its result. The next sandbox starts in
            # prepare(), after the result has gone back.
            self._drop_waiting(w)

    def _finish_waiting(self, w: _Waiting, files: dict[str, str], entry: str, timeout_s: float,
                        stdin: str) -> SandboxResult:
        cpu = max(1, min(self.limits.cpu_s, int(timeout_s) + 1))
        payload = json.dumps({"files": files, "entry": entry, "cpu_s": cpu, "stdin": stdin}) + "\n"
        t0 = time.monotonic()
        status = "ok"
        try:
            w.proc.communicate(payload.encode(), timeout=timeout_s)
        except subprocess.TimeoutExpired:
            status = "timeout"
            _killpg(w.proc.pid)
            w.proc.wait()
        except OSError:  # it died while we sent (a broken pipe): what it wrote says why
            w.proc.wait()
        seconds = time.monotonic() - t0
        w.out.flush()
        w.err.flush()
        return self._result(w.proc, status, seconds, w.uid, w.scratch / "stdout", w.scratch / "stderr", timeout_s)

    # ------------------------------------------------------------------ cold start

    def _run(self, scratch: Path, files: dict[str, str], entry: str, timeout_s: float, stdin: str,
             uid: int | None) -> SandboxResult:
        work = scratch / "work"
        work.mkdir()
        for name, text in files.items():
            (work / name).write_text(text)
        out_path, err_path = scratch / "stdout", scratch / "stderr"
        if uid is not None:
            for p in (scratch, work, *work.iterdir()):
                os.chown(p, uid, uid)
        argv = [self.python, "-I", "-S", "-B"]
        if self.mode == "fallback":
            (work / "_guard.py").write_text(_FALLBACK_GUARD + f"\nexec(compile(open({entry!r}).read(), {entry!r}, 'exec'))\n")
            argv += ["_guard.py"]
        else:
            argv += [entry]
            argv = self._bwrap_argv(work) + argv
        t0 = time.monotonic()
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            try:
                proc = subprocess.Popen(argv, cwd=work, env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
                                        stdin=subprocess.PIPE, stdout=out, stderr=err, close_fds=True,
                                        preexec_fn=self._preexec(uid, timeout_s))
            except OSError as exc:
                return SandboxResult("error", None, "", f"could not start the sandbox: {exc}", 0.0)
            status = "ok"
            try:
                proc.communicate(stdin.encode(), timeout=timeout_s)
            except subprocess.TimeoutExpired:
                status = "timeout"
                _killpg(proc.pid)
                proc.wait()
        seconds = time.monotonic() - t0
        return self._result(proc, status, seconds, uid, out_path, err_path, timeout_s)

    def _result(self, proc: subprocess.Popen, status: str, seconds: float, uid: int | None, out_path: Path,
                err_path: Path, timeout_s: float) -> SandboxResult:
        leftover = _kill_uid(uid) if uid is not None else 0
        if self.mode == "bwrap":  # its namespace is being torn down now: what is found is dying, not left over
            leftover = 0
        _killpg(proc.pid)  # whatever stayed in its process group (uid-less runs)
        rc = proc.returncode
        stdout = _tail(out_path)
        stderr = _tail(err_path, 4096)
        if status == "ok" and rc != 0:
            if rc == -signal.SIGXCPU or rc == -signal.SIGKILL and seconds < timeout_s and "CPU" in stderr:
                status = "cpu"
            elif rc == -signal.SIGXFSZ:
                status = "output_limit"
            elif rc < 0:
                status = "killed"
            elif "MemoryError" in stderr:
                status = "memory"
            else:
                status = "error"
        return SandboxResult(status, rc, stdout, stderr, seconds, leftover)

    def _bwrap_argv(self, work: Path) -> list[str]:
        argv = ["bwrap", "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc"]
        for hidden in _HIDDEN:
            if os.path.isdir(hidden):
                argv += ["--tmpfs", hidden]
        argv += ["--bind", str(work), str(work)]
        for hidden in _HIDDEN:
            if os.path.isdir(hidden):
                argv += ["--remount-ro", hidden]
        return argv + ["--unshare-all", "--die-with-parent", "--new-session", "--cap-drop", "ALL",
                       "--clearenv", "--setenv", "PATH", "/usr/bin:/bin", "--chdir", str(work)]


def _killpg(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _become_subreaper() -> None:
    """Orphans of a sandboxed run (bwrap's namespace init, a daemonised child) become our children, so we
    can reap them: in containers whose pid 1 does not reap, they would otherwise stay zombies forever."""
    global _SUBREAPER
    if _SUBREAPER:
        return
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        pass
    _SUBREAPER = True


_SUBREAPER = False


def _kill_uid(uid: int) -> int:
    """SIGKILLs every live process whose uid is `uid` (the run's own) and reaps those that are ours;
    returns how many were alive."""
    killed = 0
    seen: set[int] = set()
    for _ in range(50):  # a process may fork while we kill: repeat until none is left
        live = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                if os.stat(f"/proc/{entry}").st_uid != uid:
                    continue
                with open(f"/proc/{entry}/stat") as f:
                    state = f.read().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            pid = int(entry)
            if state in "ZX":
                _reap(pid)
            else:
                live.append(pid)
        if not live:
            return killed
        for pid in live:
            try:
                os.kill(pid, signal.SIGKILL)
                if pid not in seen:
                    seen.add(pid)
                    killed += 1
            except OSError:
                pass
        time.sleep(0.005)
    return killed


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def _tail(path: Path, limit: int = 1 << 20) -> str:
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        size = f.tell()
        f.seek(max(0, size - limit))
        return f.read().decode("utf-8", "replace")
