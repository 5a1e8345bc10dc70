"""`make gpu-check`: everything of the GPU path that one NVIDIA GPU can run, in one command (<= 20 min on an H100).

    make gpu-check                                    # on a machine with an NVIDIA GPU
    python tools/gpu_check.py --fetch-wheels          # beforehand, where a package index is reachable (Python 3.12)
    python tools/gpu_check.py --fetch-wheels --python-version 3.11   # for a GPU machine with another Python

Without a GPU it prints one line and exits 2: nothing was verified, and a CI job or script that runs it by
mistake must not count that as a pass (2 is also what the CLI returns for a machine or input it cannot use).

On a GPU machine it:
1. makes missing dependencies importable from carried wheels: GPU machines may have only PyTorch,
   transformers, triton, nvidia-ml-py and pytest (`IMAGE`), and no package index. `--fetch-wheels` fills
   `wheels/` (~27 MB, carried with the checkout) for the target Python: pip's resolver resolves the image
   together with our `ROOTS` (megatron-core, omegaconf, matplotlib, psutil) for a manylinux x86_64 machine
   with that Python, and the wheels of every resolved distribution that the image alone does not resolve to
   are downloaded, so dependencies come from the resolver, and neither torch nor its CUDA libraries are
   carried. At check time each wheel whose distribution is not installed goes into `.gpu-check/site`
   (`pip install --no-deps --no-index --target`), which is put on the path; an installed one (the image's)
   is left alone and wins. `tools/gpu_image_check.py` proves the set complete on a CPU machine;
2. runs every `gpu`-marked test file with pytest (`tests/test_trainer_gpu.py`: single-rank trainer without
   Ray - bf16 log-probs against transformers, optimizer steps, the distributed optimizer, clipping, a
   checkpoint moved GPU -> CPU -> GPU; the Ray + Transformer Engine set when those exist;
   `tests/test_telemetry_nvml.py`; `tests/test_rollout_gpu.py`, skipped with its reason without CUDA vLLM);
3. runs `benchmarks/gpu_trainer.py` (throughput and MFU of a 0.5B Qwen2 at 4k, NVML sampling of the loop);
4. writes `docs/benchmarks/gpu_check.json` (device, driver, versions, each test's outcome) and rewrites
   the generated section of `docs/gpu.md`.
Exit status: 0 when nothing failed (skips with reasons are fine), 1 otherwise.

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
import xml.etree.ElementTree as ET
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


def run_tests(out: Path, timeout_s: int) -> list[dict]:
    junit = out / "gpu_tests.xml"
    files = gpu_test_files()
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", *files, "-q", "-rs", "-s", "-p", "no:cacheprovider",
           f"--junitxml={junit}"]
    try:
        subprocess.run(cmd, cwd=REPO, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        return [{"test": " ".join(files), "outcome": "failed", "detail": f"timed out after {timeout_s} s"}]
    if not junit.is_file():
        return [{"test": " ".join(files), "outcome": "failed", "detail": "pytest wrote no report"}]
    results = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        outcome, detail = "passed", ""
        for tag in ("failure", "error", "skipped"):
            el = case.find(tag)
            if el is not None:
                outcome = {"failure": "failed", "error": "failed", "skipped": "skipped"}[tag]
                detail = (el.get("message") or "").strip().splitlines()[0][:300] if el.get("message") else ""
        results.append({"test": f"{case.get('classname', '').split('.')[-1]}::{case.get('name')}", "outcome": outcome,
                        "seconds": round(float(case.get("time", 0.0)), 1), "detail": detail})
    return results


def run_benchmark(timeout_s: int) -> dict:
    try:
        res = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_trainer.py")], cwd=REPO,
                             timeout=timeout_s, capture_output=True, text=True, check=False)
    except subprocess.TimeoutExpired:
        return {"outcome": "failed", "detail": f"timed out after {timeout_s} s"}
    sys.stdout.write(res.stdout[-4000:])
    if res.returncode != 0:
        return {"outcome": "failed", "detail": res.stderr.strip()[-1500:]}
    data = json.loads((REPO / "docs" / "benchmarks" / "gpu_trainer.json").read_text())
    return {"outcome": "passed", "tokens_per_s": data["tokens_per_s"], "mfu": data["mfu"],
            "speedup_vs_baseline": data["speedup_vs_baseline"], "layer_spec": data["trainer"]["layer_spec"],
            "nvml_ms_per_sample": data["nvml"]["ms_per_sample"]}


def update_doc(result: dict, doc: Path = DOC) -> None:
    env, lines = result["environment"], []
    v = env["versions"]
    lines.append(f"Last run: {env['time_utc']} UTC on {env.get('device')} (x{env.get('device_count')}, "
                 f"{env.get('memory_gib')} GiB, driver {env.get('driver')}, CUDA {env.get('cuda_runtime')}), "
                 f"Python {env['python']}, " + ", ".join(f"{k} {val}" for k, val in v.items() if val) + ".")
    lines += ["", "| test | outcome | seconds | detail |", "|---|---|---|---|"]
    for t in result["tests"]:
        lines.append(f"| `{t['test']}` | {t['outcome']} | {t.get('seconds', '')} | {t.get('detail', '')} |")
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fetch-wheels", action="store_true", help="fill wheels/ for a GPU machine, then exit")
    ap.add_argument("--python-version", default="3.12",
                    help="the GPU machine's Python, for --fetch-wheels (3.12: current NGC images, the lent machines)")
    ap.add_argument("--tests-timeout", type=int, default=600)
    ap.add_argument("--bench-timeout", type=int, default=480)
    ap.add_argument("--skip-bench", action="store_true")
    ap.add_argument("--out-dir", type=Path, default=REPO / "docs" / "benchmarks", help="where gpu_check.json goes")
    ap.add_argument("--doc", type=Path, default=DOC, help="the page whose gpu-check section is rewritten")
    args = ap.parse_args(argv)
    if args.fetch_wheels:
        return fetch_wheels(args.python_version)
    try:
        import torch
    except ImportError:
        print("gpu-check: PyTorch is not installed; nothing to check on this machine")
        return 2
    if not torch.cuda.is_available():
        print("gpu-check: no NVIDIA GPU visible (torch.cuda.is_available() is False); nothing to check on this machine")
        return 2
    t0 = time.monotonic()
    try:
        installed = install_carried()
    except WheelsMismatch as exc:
        print(exc)
        return 2
    out = args.out_dir
    out.mkdir(parents=True, exist_ok=True)
    tests = run_tests(out, args.tests_timeout)
    bench = {"outcome": "skipped", "detail": "--skip-bench"} if args.skip_bench else run_benchmark(args.bench_timeout)
    result = {"environment": environment(), "installed_from_wheels": installed, "tests": tests, "benchmark": bench,
              "minutes": round((time.monotonic() - t0) / 60, 1)}
    (out / "gpu_check.json").write_text(json.dumps(result, indent=2) + "\n")
    update_doc(result, args.doc)
    failed = [t["test"] for t in tests if t["outcome"] == "failed"]
    failed += ["benchmark"] if bench["outcome"] == "failed" else []
    counts = {k: sum(t["outcome"] == k for t in tests) for k in ("passed", "skipped", "failed")}
    print(f"gpu-check: {counts['passed']} passed, {counts['skipped']} skipped, {counts['failed']} failed; benchmark "
          f"{bench['outcome']}; {result['minutes']} min; {out / 'gpu_check.json'} and {args.doc} updated")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
