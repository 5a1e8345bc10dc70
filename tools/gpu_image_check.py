"""Proves on a CPU machine that `make gpu-check` installs and imports on the GPU image.

    python tools/gpu_image_check.py                        # Python 3.12 (the GPU machines') and 3.11
    python tools/gpu_image_check.py --python 3.12 -v       # one version, every import listed
    python tools/gpu_image_check.py --list                 # only the derived import list, nothing built

The GPU image (docs/gpu.md) has PyTorch (CUDA), transformers, triton, nvidia-ml-py and pytest, and no package
index. For each Python version this builds a fresh virtual environment holding only those packages (CPU torch
2.13.0 from this machine's pip configuration stands in for CUDA torch on 3.11; on 3.12 PyPI's torch, a CUDA build
that runs on CPU), fetches the carried wheels with `gpu_check.fetch_wheels` (the `--fetch-wheels` code), installs
them with `gpu_check.install_carried` in that environment's interpreter (exactly as `make gpu-check` does), and
then, in a child process that sees only the `PYTHONPATH` gpu-check gives its pytest, imports every module that
the gpu-check test files and benchmark import (and each name they take from it).

That list is derived by reading the files, not kept by hand: every `import` in the files gpu-check runs
(`gpu_check.gpu_test_files()`, `benchmarks/gpu_trainer.py`, `tests/conftest.py`), at any depth, and, through
every project module they name, that module's own imports at any depth (a function's imports run when a GPU test
calls it). Vendor packages the image lacks by design (`ABSENT`: Ray, vLLM, Transformer Engine; arctic-inference,
which only vLLM engines use; the optional metric writers wandb, MLflow and TensorBoard, which only a run's
metrics use) may be missing where the code guards them: after `pytest.importorskip`, an import
of one of them or a conditional `pytest.skip` in the same scope, inside `try/except ImportError`, or in a
function of project code or a conftest fixture (those run on the Ray/vLLM paths the GPU tests skip without
them). Any other failure fails the check.

Environments and wheels are cached under `~/.cache/megatron-sortedrl/gpu-image/` (`MSRL_GPU_IMAGE_CACHE` moves
it), keyed by the inputs that decide them (the Python version, the image's pins, the carried roots and
`tools/gpu_check.py`). A first build takes minutes (measured on 2 shared cores: 3.11 about 9 min, 3.12 about
23 min, most of it PyTorch's CUDA wheels, ~5 GB installed); with both cached a version takes 25-40 s.
Exit status: 0 when every required import works, 1 when one does not (each named with its error), 2 for unusable
input (no such interpreter, no package index for a first build).

Left out: anything that needs the GPU itself (kernels, NCCL, CUDA vLLM); the image's own package versions are
stood in for by the versions installed here (`image_requirements`), not the image's exact ones.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tools"))
import gpu_check  # noqa: E402

# docs/gpu.md: the GPU image has neither Ray, vLLM nor Transformer Engine, and gpu-check does not carry them: the
# gpu tests skip with a reason without them. arctic-inference (HistoSpec's suffix trees) runs only inside vLLM.
ABSENT = ("ray", "vllm", "transformer_engine", "arctic_inference", "wandb", "mlflow", "tensorboard")
# Modules of packages the image has that need an ABSENT one (the TensorBoard writer needs `tensorboard`).
NEEDS_ABSENT = ("torch.utils.tensorboard",)
# Where imports of project code are looked up: packages at the repository root, then these folders (the
# benchmark puts tools/ on its path; tests import tests/helpers.py as `helpers`).
LOCAL_DIRS = (REPO, REPO / "tools", REPO / "tests", REPO / "benchmarks")
CACHE = Path(os.environ.get("MSRL_GPU_IMAGE_CACHE", Path.home() / ".cache" / "megatron-sortedrl" / "gpu-image"))


# ------------------------------------------------------------------------------------ the import list

@dataclass(frozen=True)
class Use:
    """One import our GPU path executes: `from module import names` (names empty for `import module`)."""

    module: str
    names: tuple[str, ...]
    guarded: bool  # may fail with an ABSENT module missing (the code skips or falls back there)
    where: str  # file:line of the first such import


def _local_file(module: str) -> Path | None:
    parts = module.split(".")
    for base in LOCAL_DIRS:
        for cand in (base.joinpath(*parts).with_suffix(".py"), base.joinpath(*parts, "__init__.py")):
            if cand.is_file():
                return cand
    return None


def _absent(module: str) -> bool:
    return module.split(".")[0] in ABSENT or any(module == m or module.startswith(m + ".") for m in NEEDS_ABSENT)


def _catches_import_error(handler: ast.ExceptHandler) -> bool:
    names = [handler.type] if not isinstance(handler.type, ast.Tuple) else list(handler.type.elts)
    return handler.type is None or any(isinstance(n, ast.Name) and n.id in ("ImportError", "ModuleNotFoundError",
                                                                            "Exception") for n in names)


def _importorskip(node: ast.AST) -> str | None:
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "importorskip"
            and node.args and isinstance(node.args[0], ast.Constant)):
        return node.args[0].value
    return None


def _resolve_relative(path: Path, level: int, module: str | None) -> str:
    pkg = path.relative_to(REPO).with_suffix("").parts[:-1]  # a module's package; an __init__'s own
    base = pkg[: len(pkg) - (level - 1)] if level > 1 else pkg
    return ".".join([*base, *([module] if module else [])])


def file_imports(path: Path, guarded: bool = False, functions_guarded: bool = False
                 ) -> list[tuple[str, tuple[str, ...], bool, int]]:
    """(module, names, guarded, line) for every import in `path`, in every scope, in source order.
    `functions_guarded`: a function's imports may miss an ABSENT package (project code: its functions that need
    Ray or vLLM run only on those paths, which the GPU tests skip without them)."""
    out: list[tuple[str, tuple[str, ...], bool, int]] = []

    def visit(node: ast.AST, guarded: bool) -> bool:
        """Records the imports in one simple statement or expression; returns the guard for what follows."""
        for n in ast.walk(node):
            if isinstance(n, ast.Import):
                for a in n.names:
                    out.append((a.name, (), guarded, n.lineno))
                    guarded = guarded or _absent(a.name)
            elif isinstance(n, ast.ImportFrom) and n.module != "__future__":
                mod = n.module if not n.level else _resolve_relative(path, n.level, n.module)
                out.append((mod, tuple(a.name for a in n.names if a.name != "*"), guarded, n.lineno))
                guarded = guarded or _absent(mod)
            elif (name := _importorskip(n)) is not None:
                out.append((name, (), True, n.lineno))
                guarded = guarded or _absent(name)
        return guarded

    def scope(body: list[ast.stmt], guarded: bool) -> None:
        for stmt in body:
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                for d in stmt.decorator_list:
                    visit(d, guarded)
                # runs when called, after the guards above it in its file
                scope(stmt.body, guarded or (functions_guarded and not isinstance(stmt, ast.ClassDef)))
            elif isinstance(stmt, ast.Try):
                handled = any(_catches_import_error(h) for h in stmt.handlers)
                scope(stmt.body, guarded or handled)  # a failed import there is handled by the code
                for h in stmt.handlers:
                    scope(h.body, guarded)
                scope(stmt.orelse + stmt.finalbody, guarded)
            elif isinstance(stmt, (ast.If, ast.With, ast.AsyncWith, ast.For, ast.AsyncFor, ast.While)):
                for child in ast.iter_child_nodes(stmt):
                    if not isinstance(child, ast.stmt):
                        guarded = visit(child, guarded)
                scope(stmt.body, guarded)
                scope(getattr(stmt, "orelse", []), guarded)
                # `if not <probe>: pytest.skip(...)`: what follows runs only where the probe found its package
                guarded = guarded or (isinstance(stmt, ast.If) and any(
                    isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "skip"
                    for b in stmt.body for n in ast.walk(b)))
            else:
                guarded = visit(stmt, guarded)

    scope(ast.parse(path.read_text(), str(path)).body, guarded)
    return out


def gpu_check_files() -> list[Path]:
    """What `make gpu-check` runs: its test files (found as it finds them), their conftest, the benchmark."""
    return [*(REPO / f for f in gpu_check.gpu_test_files()), REPO / "tests" / "conftest.py",
            REPO / "benchmarks" / "gpu_trainer.py"]


def import_list(roots: list[Path] | None = None) -> list[Use]:
    """Every import the gpu-check files execute, followed through project modules (see the module docstring)."""
    seen_files: dict[Path, bool] = {}
    uses: dict[tuple[str, tuple[str, ...]], Use] = {}
    roots = roots or gpu_check_files()
    todo = [(p, False) for p in roots]
    while todo:
        path, guarded = todo.pop()
        if path in seen_files and (not seen_files[path] or guarded):
            continue  # already read, and at least as strictly
        seen_files[path] = guarded
        # Functions of project code and conftest fixtures run only for the callers that need them (see
        # file_imports); a gpu test file's and the benchmark's functions all run on the GPU machine.
        lenient = path not in roots or path.name == "conftest.py"
        for module, names, g, line in file_imports(path, guarded, functions_guarded=lenient):
            key = (module, names)
            where = f"{path.relative_to(REPO)}:{line}"
            if key not in uses or (uses[key].guarded and not g):
                uses[key] = Use(module, names, g, where)
            for target in [module, *(f"{module}.{n}" for n in names)]:
                local = _local_file(target)
                if local is not None:
                    todo.append((local, g))
    return sorted(uses.values(), key=lambda u: (u.module, u.names))


# The probe runs in the image environment: the whole of it is sent as `python -c`, so it imports nothing of ours.
PROBE = r"""
import importlib, json, sys, traceback
uses, absent = json.loads(sys.argv[1]), tuple(sys.argv[2].split(","))
results = []
for module, names, guarded, where in uses:
    err = None
    try:
        mod = importlib.import_module(module)
        for n in names:
            if not hasattr(mod, n):  # a submodule imported by name, or a lazy attribute
                importlib.import_module(f"{module}.{n}")
    except BaseException as exc:  # noqa: BLE001 - every failure is reported, none ends the probe
        missing = getattr(exc, "name", None) or ""
        allowed = isinstance(exc, ModuleNotFoundError) and guarded and missing.split(".")[0] in absent
        err = {"error": f"{type(exc).__name__}: {exc}"[:400], "allowed": allowed,
               "tail": "" if allowed else traceback.format_exc()[-1200:]}
    results.append({"module": module, "names": names, "where": where, **(err or {"ok": True})})
print(json.dumps(results))
"""


# ------------------------------------------------------------------------------------- environments

def image_requirements() -> list[str]:
    """The image's packages, each at the version installed here (CPU torch's `+cpu` dropped: on 3.12 the
    PyPI build of the same version, a CUDA build, stands in). triton is left to torch: a CUDA torch pins the
    triton it was built with, which differs from the one installed beside the CPU build."""
    out = []
    for d in gpu_check.IMAGE:
        v = gpu_check._version(d)
        out.append(f"{d}=={v.split('+')[0]}" if v and d != "triton" else d)
    return out


def interpreter(version: str) -> str | None:
    """A Python `version` interpreter: on PATH, else a pyenv install."""
    cands = [shutil.which(f"python{version}"),
             *map(str, sorted(Path.home().glob(f".pyenv/versions/{version}.*/bin/python"), reverse=True))]
    for c in filter(None, cands):
        res = subprocess.run([c, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"], capture_output=True,
                             text=True, check=False)
        if res.returncode == 0 and res.stdout.strip() == version:
            return c
    return None


def _key(*parts: str) -> str:
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:12]


def _prune(keep: Path) -> None:
    """Removes what earlier inputs built for the same version (environments are GBs)."""
    prefix = keep.name.rsplit("-", 1)[0] + "-"
    for old in keep.parent.glob(prefix + "*"):
        if old != keep:
            shutil.rmtree(old, ignore_errors=True)


def _pip(python: str | Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(python), "-m", "pip", "--disable-pip-version-check", *args], capture_output=True,
                          text=True, check=False)


def image_env(version: str, python: str, cache: Path = CACHE) -> Path:
    """A virtual environment with only the image's packages (cached; built under a temporary name and renamed
    when complete, so an interrupted build is never taken for a finished one)."""
    reqs = image_requirements()
    env = cache / f"image-py{version}-{_key(version, *reqs)}"
    if (env / "bin" / "python").exists():
        return env
    tmp = env.with_name(env.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([python, "-m", "venv", str(tmp)], check=True)
    res = _pip(tmp / "bin" / "python", "install", "-q", *reqs)
    if res.returncode != 0:
        errors = [ln for ln in res.stderr.splitlines() if ln.startswith("ERROR")] or res.stderr.splitlines()[-3:]
        raise RuntimeError(f"cannot build the image environment for Python {version} ({' '.join(reqs)}): "
                           f"{' '.join(errors)[-400:]}")
    tmp.rename(env)
    _prune(env)
    return env


def carried_wheels(version: str, cache: Path = CACHE) -> Path:
    """The wheels `gpu_check.py --fetch-wheels --python-version <version>` fetches (cached)."""
    roots = [f"{d}=={gpu_check._version(d)}" for d in gpu_check.ROOTS]
    dest = cache / f"wheels-py{version}-{_key(version, *roots, Path(gpu_check.__file__).read_text())}"
    if (dest / ".complete").exists():
        return dest
    if gpu_check.fetch_wheels(version, dest) != 0:
        raise RuntimeError(f"cannot fetch the carried wheels for Python {version} (is a package index reachable?)")
    (dest / ".complete").touch()
    _prune(dest)
    return dest


def check(version: str, python: str, wheels: Path | None = None, cache: Path = CACHE) -> dict:
    """Builds (or reuses) the image environment, installs the carried wheels as gpu-check does into a fresh
    site, and imports every use; returns {"installed": [...], "results": [...], "seconds": ...}."""
    import tempfile
    import time

    t0 = time.monotonic()
    env = image_env(version, python, cache)
    wheels = wheels or carried_wheels(version, cache)
    uses = json.dumps([[u.module, list(u.names), u.guarded, u.where] for u in import_list()])
    local = [str(d) for d in LOCAL_DIRS[1:]]  # our own files, as pytest and the benchmark find them
    with tempfile.TemporaryDirectory(prefix="gpu-image-") as tmp:
        # One process installs (gpu_check.install_carried) and starts the probe with the PYTHONPATH it set,
        # as `make gpu-check` starts pytest.
        driver = (
            "import json, subprocess, sys; from pathlib import Path\n"
            f"sys.path.insert(0, {str(REPO / 'tools')!r}); import gpu_check\n"
            f"installed = gpu_check.install_carried(Path({str(wheels)!r}), Path({tmp!r}) / 'site')\n"
            f"probe = {f'import sys; sys.path[1:1] = {local!r}' + chr(10)!r} + sys.argv[1]\n"
            "res = subprocess.run([sys.executable, '-c', probe, sys.argv[2], sys.argv[3]], capture_output=True,"
            " text=True)\n"
            "print(json.dumps({'installed': installed, 'rc': res.returncode, 'out': res.stdout,"
            " 'err': res.stderr[-3000:]}))\n")
        clean = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
        res = subprocess.run([str(env / "bin" / "python"), "-c", driver, PROBE, uses, ",".join(ABSENT)], cwd=REPO,
                             env={**clean, "CUDA_VISIBLE_DEVICES": ""}, capture_output=True, text=True, check=False)
    if res.returncode != 0:
        raise RuntimeError(f"installing the carried wheels failed: {res.stderr.strip()[-1500:]}")
    out = json.loads(res.stdout.strip().splitlines()[-1])
    if out["rc"] != 0:
        raise RuntimeError(f"the import probe died: {out['err']}")
    return {"installed": out["installed"], "results": json.loads(out["out"]), "seconds": time.monotonic() - t0}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--python", action="append", help="a Python version to check (repeatable; default 3.12, 3.11)")
    ap.add_argument("--wheels", type=Path, help="check this wheel directory instead of fetching the carried set")
    ap.add_argument("--list", action="store_true", help="print the derived import list and exit")
    ap.add_argument("-v", "--verbose", action="store_true", help="list every import and its outcome")
    args = ap.parse_args(argv)
    if args.list:
        for u in import_list():
            print(f"{'guarded  ' if u.guarded else 'required '}{u.module}"
                  f"{' (' + ', '.join(u.names) + ')' if u.names else ''}  {u.where}")
        return 0
    if args.wheels is not None and not any(args.wheels.glob("*.whl")):
        print(f"gpu-image-check: no wheels in {args.wheels}; fill it with tools/gpu_check.py --fetch-wheels")
        return 2
    failed = False
    for version in args.python or ["3.12", "3.11"]:
        python = interpreter(version)
        if python is None:
            print(f"gpu-image-check: no Python {version} interpreter found (python{version} on PATH or pyenv); "
                  "install one or pass another --python")
            return 2
        try:
            r = check(version, python, args.wheels)
        except RuntimeError as exc:
            print(f"gpu-image-check: Python {version}: {exc}")
            return 2
        bad = [x for x in r["results"] if "error" in x and not x["allowed"]]
        absent = sorted({x["error"].split("'")[1].split(".")[0] for x in r["results"] if x.get("allowed")})
        for x in r["results"] if args.verbose else bad:
            status = "ok" if x.get("ok") else ("absent by design" if x.get("allowed") else "FAILED")
            print(f"  {status:16} {x['module']}{' (' + ', '.join(x['names']) + ')' if x['names'] else ''}  "
                  f"{x['where']}{'  ' + x['error'] if 'error' in x else ''}")
            if x in bad and args.verbose:
                print("    " + x["tail"].replace("\n", "\n    "))
        ok = sum(1 for x in r["results"] if x.get("ok"))
        print(f"gpu-image-check: Python {version}: {len(r['installed'])} carried wheels installed, {ok} imports ok, "
              f"{sum(1 for x in r['results'] if x.get('allowed'))} absent by design ({', '.join(absent) or 'none'}),"
              f" {len(bad)} failed ({r['seconds']:.0f} s)")
        failed |= bool(bad)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
