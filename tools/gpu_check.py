"""`make gpu-check`: everything of the GPU path that one NVIDIA GPU can run, in one command under its own budget.

    python tools/gpu_check.py --fetch-wheels          # beforehand, where a package index is reachable (Python 3.12)
    python tools/gpu_check.py --cpu-smoke --out-dir /tmp/rehearsal   # rehearsal on a CPU: same steps, same budget
    make gpu-check                                    # on the GPU machine (wheels/ carried with the checkout)
    python tools/gpu_check.py --update-doc <returned>/gpu_check.json  # here, after: docs/gpu.md's section

Made for the machine it first runs on: one GPU, an image with PyTorch (CUDA), transformers, triton, nvidia-ml-py
and pytest (`IMAGE`), no package index, no vLLM, Ray, megatron-core or Transformer Engine, one command of at most
10 minutes and about 15 in all with the machine's start, and only a few files brought back. So the check:
1. makes missing dependencies importable from carried wheels: `--fetch-wheels` fills `wheels/` (~27 MB, git-ignored:
   carry it with the checkout) for the target Python: pip's resolver resolves the image together with our
   `ROOTS` (megatron-core, omegaconf, matplotlib, psutil) for a manylinux x86_64 machine with that Python, and
   the wheels of every resolved distribution the image alone does not resolve to are downloaded (neither torch
   nor its CUDA libraries are carried). At check time each wheel whose distribution is not installed goes into
   `.gpu-check/site` (`pip install --no-deps --no-index --target`), put on the path; `tools/gpu_image_check.py`
   proves the set complete on a CPU machine;
2. writes `gpu_check.json` into the results folder (`--out-dir`, default `$OUT` when set, else docs/benchmarks)
   at once (environment, budget, `"status": "running"`), then runs every `gpu`-marked test file with pytest,
   whose plugin `tools/gpu_check_progress.py` rewrites the JSON as each test starts and ends: a run cut short
   leaves valid JSON naming the tests done and the one running; pytest's output goes to `gpu_tests.log`;
3. runs `benchmarks/gpu_trainer.py` (throughput and MFU of a 0.5B Qwen2 at 4k, NVML sampling of the loop) in what
   is left of the budget, its JSON, figure and log copied into the results folder;
4. marks the JSON `"status": "done"` and rewrites the generated section of `docs/gpu.md` (on a lent machine only
   the results folder comes back: `--update-doc` rewrites the section here from the returned JSON).
The budget (`--budget-s`, default 420 s, `--bench-s` of it kept for the benchmark) is enforced: a stage that
outlives its share is killed with its process group and recorded as failed. What travels (tracked files and
`wheels/`) is measured against `--max-carry-mib` (64). `--cpu-smoke` runs all of it on a CPU (GPU tests skip,
the benchmark at a tiny size, the page left alone): the rehearsal before a GPU is lent.

Without a GPU (and without `--cpu-smoke`) it prints one line and exits 2: nothing was verified, and a CI job or
script that runs it by mistake must not count that as a pass. Exit status: 0 when nothing failed (skips with
reasons are fine), 1 otherwise.

Left out: anything needing two GPUs (NCCL weight transport, TP/PP > 1 across GPUs) or CUDA vLLM when it is
not installed; the contract tests (`tests/test_gpu_contract.py`) cover those names on every CI run.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata as md
import json
import os
import platform
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
WHEELS = REPO / "wheels"
SITE = REPO / ".gpu-check" / "site"
DOC = REPO / "docs" / "gpu.md"
BEGIN, END = "<!-- gpu-check:begin -->", "<!-- gpu-check:end -->"
# The GPU image (docs/gpu.md): what a bare GPU machine has. Neither these nor anything they depend on is carried,
# so the image's own builds (CUDA torch above all) are the ones imported.
IMAGE = ("torch", "transformers", "triton", "nvidia-ml-py", "pytest")
# What the GPU path needs beyond the image, each pinned to the version installed here (what the CPU suite runs);
# their dependencies are resolved by pip for the target Python, not listed here. psutil: megatron-core's
# torch_dist checkpoint writer imports it without declaring it.
ROOTS = ("megatron-core", "omegaconf", "matplotlib", "psutil")
# A lent GPU machine: one command at most 10 minutes, about 15 in all with the machine's start and the transfers.
BUDGET_S = 420.0  # the whole check, enforced by the check itself
BENCH_S = 150.0  # of it, kept for the benchmark
MAX_CARRY_MIB = 64.0  # what may travel with the checkout
VERSIONS = ("torch", "megatron-core", "transformer-engine", "vllm", "transformers", "triton", "nvidia-ml-py",
            "omegaconf", "matplotlib")


def _version(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def environment() -> dict:
    """Device, driver and package versions of this machine (what every GPU result is tagged with)."""
    import torch

    env: dict = {"host": socket.gethostname(), "python": platform.python_version(),
                 "time_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"),
                 "cuda_available": torch.cuda.is_available(), "cuda_runtime": torch.version.cuda}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        env.update(device=torch.cuda.get_device_name(0), device_count=torch.cuda.device_count(),
                   memory_gib=round(p.total_memory / 2**30, 1), capability=f"{p.major}.{p.minor}")
    try:
        import pynvml

        pynvml.nvmlInit()
        drv = pynvml.nvmlSystemGetDriverVersion()
        env["driver"] = drv.decode() if isinstance(drv, bytes) else drv
        pynvml.nvmlShutdown()
    except Exception as exc:  # noqa: BLE001 - reported, not fatal
        env["driver"] = f"unknown ({type(exc).__name__})"
    env["versions"] = {d: _version(d) for d in VERSIONS}
    return env


# ------------------------------------------------------------------------------------------ wheels

def _platform_args(python_version: str) -> list[str]:
    """pip's target options for a manylinux x86_64 machine: pip does not widen `--platform` to older glibc tags
    by itself, and CUDA wheels (nvidia-cudnn, ...) carry manylinux_2_27 while others carry 2_17 or 2014."""
    tags = [f"manylinux_2_{m}_x86_64" for m in range(28, 4, -1)] + ["manylinux2014_x86_64", "manylinux2010_x86_64",
                                                                     "manylinux1_x86_64"]
    return ["--only-binary=:all:", "--python-version", python_version, "--implementation", "cp",
            *(a for t in tags for a in ("--platform", t))]


def resolve(requirements: list[str], python_version: str) -> dict[str, str]:
    """{distribution: version} that pip's resolver installs for `requirements` on a manylinux x86_64 machine
    with `python_version`: a dry run (metadata only, nothing installed) whose JSON report is read."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="gpu-check-resolve-") as tmp:
        report = Path(tmp) / "report.json"
        cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "-q", "--target",
               str(Path(tmp) / "t"), "--report", str(report), *_platform_args(python_version), *requirements]
        res = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if res.returncode != 0:
            errors = [ln for ln in res.stderr.splitlines() if ln.startswith("ERROR")] or res.stderr.splitlines()
            raise RuntimeError(f"pip cannot resolve {' '.join(requirements)} for Python {python_version}: "
                               f"{' '.join(errors)[-400:]}")
        items = json.loads(report.read_text())["install"]
    return {_canonical(i["metadata"]["name"]): i["metadata"]["version"] for i in items}


def _canonical(dist: str) -> str:
    return dist.replace("_", "-").replace(".", "-").lower()


def carried_set(python_version: str, pins: dict[str, str] | None = None) -> dict[str, str]:
    """ROOTS and everything they need that the image lacks: pip resolves the image together with ROOTS (so the
    carried versions agree with the image's dependencies), then drops what the image alone resolves to.
    Each root is pinned to the version installed here unless `pins` names another."""
    pins = {**{d: _version(d) for d in ROOTS}, **(pins or {})}
    roots = [f"{d}=={pins[d]}" if pins[d] else d for d in ROOTS]
    image = resolve(list(IMAGE), python_version)
    full = resolve([*IMAGE, *roots], python_version)
    return {d: v for d, v in sorted(full.items()) if d not in image}


def fetch_wheels(python_version: str, dest: Path = WHEELS) -> int:
    """Downloads the carried wheels (manylinux x86_64) for `python_version` into `dest`, replacing its wheels."""
    try:
        carry = carried_set(python_version)
    except RuntimeError as exc:
        print(f"gpu-check: {exc}")
        return 1
    dest.mkdir(parents=True, exist_ok=True)
    for old in dest.glob("*.whl"):  # a wheel left from another resolution would be installed too
        old.unlink()
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(dest),
           *_platform_args(python_version), *(f"{d}=={v}" for d, v in carry.items())]
    res = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if res.returncode != 0:
        print(f"gpu-check: cannot fetch the carried wheels for Python {python_version}: {res.stderr.strip()[-300:]}")
        return 1
    (dest / "PYTHON").write_text(python_version + "\n")  # checked before installing (install_carried)
    size = sum(p.stat().st_size for p in dest.glob("*.whl")) / 2**20
    print(f"gpu-check: {len(list(dest.glob('*.whl')))} wheels for Python {python_version} in {dest} ({size:.1f} MiB): "
          + ", ".join(f"{d} {v}" for d, v in carry.items()))
    return 0


def _dist_of(wheel: Path) -> str:
    return _canonical(wheel.name.split("-")[0])


class WheelsMismatch(RuntimeError):
    """The carried wheels were fetched for another Python."""


def install_carried(wheels: Path = WHEELS, site: Path = SITE) -> list[str]:
    """Installs each carried wheel whose distribution is missing into `site`; returns what was installed.
    `--no-deps`: the set is already complete (`carried_set`), and pip must not reach for an index or replace
    an image package. `site` goes on the path first, so what an earlier run put there counts as installed."""
    target = (wheels / "PYTHON").read_text().strip() if (wheels / "PYTHON").is_file() else None
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    if target is not None and target != here:
        raise WheelsMismatch(f"gpu-check: the carried wheels in {wheels} are for Python {target}, this is Python "
                             f"{here}: run tools/gpu_check.py --fetch-wheels --python-version {here} where a "
                             "package index is reachable")
    if site.is_dir() and str(site) not in sys.path:
        sys.path.insert(0, str(site))
    missing = [w for w in sorted(wheels.glob("*.whl")) if _version(_dist_of(w)) is None]
    if missing:
        site.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q", "--target", str(site),
                        *map(str, missing)], check=True)
    if site.is_dir():
        if str(site) not in sys.path:
            sys.path.insert(0, str(site))
        paths = (str(REPO), str(site), os.environ.get("PYTHONPATH", ""))
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    return [_dist_of(w) for w in missing]


# ------------------------------------------------------------------------------------------- runs

def gpu_test_files(tests: Path = REPO / "tests") -> list[str]:
    """Test files that mark anything `gpu`. Collecting only these keeps modules that import Ray or vLLM at
    the top (absent on bare GPU machines) from failing the collection."""
    return [p.relative_to(REPO).as_posix() for p in sorted(tests.glob("test_*.py")) if "mark.gpu" in p.read_text()]


def _run_logged(cmd: list[str], log: Path, timeout_s: float, env: dict | None = None) -> int | None:
    """Runs `cmd` in the repository with its output in `log` (and the tail echoed); None when it outlived
    `timeout_s` and was killed with its process group (a hung NCCL or engine process included)."""
    import signal

    with log.open("w") as f:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            rc = proc.wait(timeout=max(1.0, timeout_s))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = None
    sys.stdout.write(log.read_text()[-3000:])
    sys.stdout.flush()
    return rc


def run_tests(result_path: Path, timeout_s: float, files: list[str] | None = None) -> None:
    """Runs every gpu-marked test file with pytest; `tools/gpu_check_progress.py` adds each test's outcome to
    the JSON at `result_path` as it ends. A run killed at `timeout_s` gets the test it was in marked failed."""
    from gpu_check_progress import ENV, read_json, write_json

    files = files or gpu_test_files()
    env = {**os.environ, ENV: str(result_path),
           "PYTHONPATH": os.pathsep.join(p for p in (str(REPO / "tools"), os.environ.get("PYTHONPATH", "")) if p)}
    # a file that fails to import is recorded, and the others still run
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", *files, "-q", "-rs", "-p", "no:cacheprovider",
           "-p", "gpu_check_progress", "--continue-on-collection-errors"]
    rc = _run_logged(cmd, result_path.with_name("gpu_tests.log"), timeout_s, env)
    data = read_json(result_path)
    if rc is None:
        data["tests"].append({"test": data.get("running") or " ".join(files), "outcome": "failed", "seconds": None,
                              "detail": f"killed at the check's budget ({timeout_s:.0f} s for the tests)"})
    elif not data["tests"] and rc != 0:
        data["tests"].append({"test": " ".join(files), "outcome": "failed", "seconds": None,
                              "detail": f"pytest exited {rc} before any test (see gpu_tests.log)"})
    data["running"] = None
    write_json(result_path, data)


def run_benchmark(out: Path, timeout_s: float, cpu_smoke: bool = False) -> dict:
    """`benchmarks/gpu_trainer.py` at gpu-check's size; its JSON and figure are copied into `out` (its NVML
    report, a folder of figures and tables, stays in a scratch folder: what comes back from a lent machine is
    a few files)."""
    import shutil
    import tempfile

    scratch = Path(tempfile.mkdtemp(prefix="gpu-check-bench-"))
    cmd = [sys.executable, str(REPO / "benchmarks" / "gpu_trainer.py"), "--out-dir", str(scratch),
           *(["--cpu-smoke"] if cpu_smoke else ["--steps", "4", "--warmup", "1", "--loop-steps", "3"])]
    rc = _run_logged(cmd, out / "gpu_trainer.log", timeout_s)
    if rc is None:
        return {"outcome": "failed", "detail": f"killed at the check's budget ({timeout_s:.0f} s for the benchmark)"}
    if rc != 0:
        return {"outcome": "failed", "detail": (out / "gpu_trainer.log").read_text().strip()[-1500:]}
    for name in ("gpu_trainer.json", "gpu_trainer.png"):
        shutil.copy(scratch / name, out / name)
    data = json.loads((out / "gpu_trainer.json").read_text())
    return {"outcome": "passed", "tokens_per_s": data["tokens_per_s"], "mfu": data["mfu"],
            "speedup_vs_baseline": data["speedup_vs_baseline"], "layer_spec": data["trainer"]["layer_spec"],
            "nvml_ms_per_sample": data["nvml"]["ms_per_sample"]}


def carried_mib(wheels: Path = WHEELS) -> float:
    """MiB that travel to the GPU machine: the checkout's tracked files and the carried wheels."""
    res = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=False)
    tracked = [REPO / f for f in res.stdout.decode().split("\0") if f]
    files = [*tracked, *(wheels.glob("*") if wheels.is_dir() else [])]
    return round(sum(p.stat().st_size for p in files if p.is_file()) / 2**20, 1)


def update_doc(result: dict, doc: Path = DOC) -> None:
    env, lines = result["environment"], []
    v = env["versions"]
    lines.append(f"Last run: {env['time_utc']} UTC on {env.get('device')} (x{env.get('device_count')}, "
                 f"{env.get('memory_gib')} GiB, driver {env.get('driver')}, CUDA {env.get('cuda_runtime')}), "
                 f"Python {env['python']}, " + ", ".join(f"{k} {val}" for k, val in v.items() if val) + ".")
    if result.get("status", "done") != "done":
        lines += ["", f"Cut short while running `{result.get('running')}`: the results below are those it had."]
    lines += ["", "| test | outcome | seconds | detail |", "|---|---|---|---|"]
    for t in result["tests"]:
        seconds = "" if t.get("seconds") is None else t["seconds"]
        lines.append(f"| `{t['test']}` | {t['outcome']} | {seconds} | {t.get('detail', '')} |")
    b = result["benchmark"]
    if b.get("outcome") == "passed":
        mfu = b["mfu"]["megatron"] * 100 if b.get("mfu") else None
        lines += ["", f"Benchmark (`benchmarks/gpu_trainer.py`, {b['layer_spec']} spec): "
                      f"{b['tokens_per_s']['megatron']:.0f} tokens/s"
                      + (f", MFU {mfu:.1f} %" if mfu is not None else "")
                      + f", {b['speedup_vs_baseline']:.2f}x a transformers + AdamW loop; NVML sampler "
                        f"{b['nvml_ms_per_sample']} ms per sample. Details: `docs/benchmarks/gpu_trainer.json`."]
    else:
        lines += ["", f"Benchmark failed: {b.get('detail', '')[:300]}"]
    text = doc.read_text()
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    doc.write_text(text[:start] + "\n" + "\n".join(lines) + "\n" + text[end:])


def default_out_dir() -> Path:
    """`$OUT` when set (the folder a lent machine hands back), else docs/benchmarks."""
    return Path(os.environ["OUT"]) if os.environ.get("OUT") else REPO / "docs" / "benchmarks"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fetch-wheels", action="store_true", help="fill wheels/ for a GPU machine, then exit")
    ap.add_argument("--python-version", default="3.12",
                    help="the GPU machine's Python, for --fetch-wheels (3.12: current NGC images, the lent machines)")
    ap.add_argument("--budget-s", type=float, default=BUDGET_S,
                    help="the whole check's seconds, enforced: tests, then the benchmark in what is left")
    ap.add_argument("--bench-s", type=float, default=BENCH_S, help="seconds of the budget kept for the benchmark")
    ap.add_argument("--skip-bench", action="store_true")
    ap.add_argument("--tests", nargs="+", help="test files to run (default: every file that marks a test gpu)")
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="rehearse the whole check on a CPU (GPU tests skip, the benchmark at a tiny size)")
    ap.add_argument("--max-carry-mib", type=float, default=MAX_CARRY_MIB,
                    help="what may travel with the checkout (tracked files + wheels/); more fails the check")
    ap.add_argument("--out-dir", type=Path, default=None, help="where the results go (default: $OUT, else "
                                                                  "docs/benchmarks)")
    ap.add_argument("--doc", type=Path, default=DOC, help="the page whose gpu-check section is rewritten")
    ap.add_argument("--update-doc", type=Path, metavar="GPU_CHECK_JSON",
                    help="rewrite --doc's section from a gpu_check.json brought back from a GPU machine, then exit")
    args = ap.parse_args(argv)
    if args.fetch_wheels:
        return fetch_wheels(args.python_version)
    if args.update_doc:
        update_doc(json.loads(args.update_doc.read_text()), args.doc)
        return 0
    t0 = time.monotonic()
    try:
        import torch
    except ImportError:
        print("gpu-check: PyTorch is not installed; nothing to check on this machine")
        return 2
    if not torch.cuda.is_available() and not args.cpu_smoke:
        print("gpu-check: no NVIDIA GPU visible (torch.cuda.is_available() is False); nothing to check on this machine")
        return 2
    try:
        installed = install_carried()
    except WheelsMismatch as exc:
        if not args.cpu_smoke:
            print(exc)
            return 2
        # the rehearsal still measures what travels and runs the rest; tools/gpu_image_check.py proves the install
        installed = [f"not installed: {exc}".replace("gpu-check: ", "")]
    out = args.out_dir or default_out_dir()
    out.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(REPO / "tools"))
    from gpu_check_progress import read_json, write_json

    path = out / "gpu_check.json"
    carry = carried_mib()
    result = {"status": "running", "cpu_smoke": args.cpu_smoke, "budget_s": args.budget_s, "environment": environment(),
              "installed_from_wheels": installed, "carried_mib": carry, "running": None, "tests": [],
              "benchmark": {"outcome": "pending"}}
    write_json(path, result)
    deadline = t0 + args.budget_s
    reserve = 0.0 if args.skip_bench else args.bench_s
    run_tests(path, deadline - reserve - time.monotonic(), args.tests)
    result = read_json(path)
    left = deadline - time.monotonic()
    if args.skip_bench:
        bench = {"outcome": "skipped", "detail": "--skip-bench"}
    elif left < 30:
        bench = {"outcome": "failed", "detail": f"the budget of {args.budget_s:.0f} s was spent by the tests"}
    else:
        bench = run_benchmark(out, left, cpu_smoke=args.cpu_smoke)
    result.update(benchmark=bench, minutes=round((time.monotonic() - t0) / 60, 1), status="done")
    write_json(path, result)
    failed = [t["test"] for t in result["tests"] if t["outcome"] == "failed"]
    failed += ["benchmark"] if bench["outcome"] == "failed" else []
    if carry > args.max_carry_mib:
        failed.append("carry")
        print(f"gpu-check: {carry} MiB would travel with the checkout, over the {args.max_carry_mib:.0f} MiB limit")
    if not args.cpu_smoke:
        update_doc(result, args.doc)
    counts = {k: sum(t["outcome"] == k for t in result["tests"]) for k in ("passed", "skipped", "failed")}
    print(f"gpu-check: {counts['passed']} passed, {counts['skipped']} skipped, {counts['failed']} failed; benchmark "
          f"{bench['outcome']}; {result['minutes']} min of {args.budget_s / 60:.1f}; {path}"
          + ("" if args.cpu_smoke else f" and {args.doc} updated"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
