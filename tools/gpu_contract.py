"""Contract check of the GPU path: every vLLM / Transformer Engine / megatron-core name our code uses, read
from the exact packages the `gpu` extra pins, without importing or installing them.

    .venv/bin/python tools/gpu_contract.py                 # download (cached), check, print the result
    .venv/bin/python tools/gpu_contract.py --vllm-src DIR  # check against an unpacked vllm tree instead
    .venv/bin/python -m pytest tests/test_gpu_contract.py -q

Why: CUDA vLLM and Transformer Engine cannot be installed on a CPU machine, and CI never has a GPU, so a
renamed keyword or a moved module in the GPU-only code would only show on a user's cluster. This reads
their source instead. `fetch_sources` runs `pip download --no-deps` of the pinned wheels into a cache
(`$MSRL_CONTRACT_CACHE`, default ~/.cache/megatron-sortedrl/contract/<dist>-<version>) and unpacks only
the `.py` files; megatron-core is read from its installed source.

What is checked (the *uses* are derived from our code by AST, so a new call is checked too):
* imports, and attribute chains on imported names (`specs.get_gpt_layer_with_transformer_engine_spec`),
  through re-exports and vLLM's lazy `MODULE_ATTRS` table;
* every call of such a name: positional count, keyword names, required parameters, and string literals
  passed where the parameter's annotation is a `Literal[...]` (`pause_generation(mode="keep")`);
* methods called on objects whose class is known from a constructor, a factory's return annotation or a
  class attribute's annotation (`self.engine = AsyncLLM.from_engine_args(...)`, then `self.engine.abort`);
* `collective_rpc("name", kwargs={...})`: a method of our worker extension, or of vLLM's GPU `Worker`
  with those keyword parameters;
* keyword dictionaries built for a vLLM config class (`KWARG_BUILDERS`: the engine arguments, the
  speculative config), nested dicts by the field's annotation (`weight_transfer_config={"backend": ...}`),
  and the weight-transfer payloads against the init/update-info classes of each backend they go to
  (`PAYLOADS`, backend read from `if self.backend == ...` branches, classes from vLLM's factory);
* hooks vLLM calls in our classes: `self.<attr>` of the worker extensions exists on vLLM's `Worker`
  (and on its model runner, one attribute deeper); the custom proposer is constructed and `propose`d the
  way vLLM's model runner does in its `"custom_class"` branch;
* the Transformer Engine classes that megatron-core's TE layer spec subclasses exist in the pinned TE.

Written by hand with `ast` (the source reader is `tools/contract_source.py`): no maintained library
checks call signatures statically across an uninstalled wheel; type checkers need the package importable
and its compiled dependencies.
Deliberately left out: types of arguments, return values (beyond the factory typing above), and calls on
objects whose class cannot be read off the source (`Any`, values from untyped containers).
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import os
import shutil
import socket
import subprocess
import sys
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tools/ is not a package
from contract_source import Sig, SourceTree, Sym, _name_of, _union_class

REPO = Path(__file__).resolve().parent.parent
# What the `gpu` extra of pyproject.toml pins; tests/test_gpu_contract.py checks the two agree.
PINS = {"vllm": "0.33.0", "transformer-engine": "2.11.0"}
# Top-level packages whose names are checked, and the distribution each comes from (None: installed).
PACKAGES = {"vllm": "vllm", "transformer_engine": "transformer-engine", "megatron": None}
OUR_PACKAGES = ("megatron_sortedrl", "speculative", "scheduler")
# Keyword dicts our code builds for a vLLM class: "<file>::<function>" -> the class they are splatted into.
KWARG_BUILDERS = {
    "megatron_sortedrl/rollout/engine_worker.py::engine_kwargs": "vllm.engine.arg_utils.AsyncEngineArgs",
    "speculative/proposer.py::vllm_speculative_config": "vllm.config.SpeculativeConfig",
}
# Dicts passed as the first argument of these actor methods reach vLLM's weight-transfer engine of the
# configured backend, which builds `<engine>.<attribute>(**dict)`.
PAYLOADS = {"transfer_init": "init_info_cls", "transfer_update": "update_info_cls"}
PAYLOAD_FILE = "megatron_sortedrl/rollout/weight_sync_gpu.py"
WEIGHT_TRANSFER_FACTORY = "vllm.distributed.weight_transfer.factory"
# Classes whose `self` is a vLLM object at run time (mixins), and attributes set from outside.
HOOK_MODULES = {"megatron_sortedrl/rollout/worker_extension.py": "vllm.v1.worker.gpu_worker.Worker",
                "speculative/vllm_extension.py": "vllm.v1.worker.gpu_worker.Worker"}
PROPOSER = "speculative/proposer.py::HistoSpecProposer"
# The proposer's `runner` is set by the worker mixin to the worker's model runner.
EXTERNAL_ATTRS = {
    "speculative/proposer.py::HistoSpecProposer.runner": ("vllm.v1.worker.gpu_worker.Worker", "model_runner")}
MEGATRON_TE_SPEC = "megatron.core.models.gpt.gpt_layer_specs"


class RegistryUnreachable(RuntimeError):
    """The package index cannot be reached: the contract test skips with this reason."""


# ----------------------------------------------------------------------------------------- sources

def cache_dir() -> Path:
    return Path(os.environ.get("MSRL_CONTRACT_CACHE", Path.home() / ".cache" / "megatron-sortedrl" / "contract"))


def _registry_reachable(host: str = "pypi.org") -> bool:
    try:
        socket.create_connection((host, 443), timeout=5).close()
        return True
    except OSError:
        return False


def fetch_sources(dist: str, version: str, cache: Path | None = None) -> Path:
    """Directory holding the `.py` files of `dist==version` (downloaded and unpacked once, then cached)."""
    root = (cache or cache_dir()) / f"{dist}-{version}"
    src, done = root / "src", root / "COMPLETE"
    if done.is_file():
        return src
    wheels = root / "wheel"
    wheels.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet",
           "-d", str(wheels), f"{dist}=={version}"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, check=False)
    found = sorted(wheels.glob("*.whl"))
    if res.returncode != 0 or not found:
        if not _registry_reachable():
            raise RegistryUnreachable(f"cannot download {dist}=={version}: the package index is unreachable")
        raise RuntimeError(f"pip download {dist}=={version} failed: {res.stderr.strip()[-600:]}")
    shutil.rmtree(src, ignore_errors=True)
    with zipfile.ZipFile(found[-1]) as z:  # only the Python sources: the wheel's binaries are not needed
        z.extractall(src, [n for n in z.namelist() if n.endswith(".py")])
    for whl in found:
        whl.unlink()  # hundreds of MB; the extracted sources are what is kept
    done.write_text(f"{dist}=={version}\n")
    return src


def default_roots() -> dict[str, Path]:
    """{top-level package: directory containing it}: pinned downloads for vLLM and TE, installed megatron."""
    spec = importlib.util.find_spec("megatron")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("megatron-core is not installed (it is a base dependency; run `make setup`)")
    return {"vllm": fetch_sources("vllm", PINS["vllm"]),
            "transformer_engine": fetch_sources("transformer-engine", PINS["transformer-engine"]),
            "megatron": Path(next(iter(spec.submodule_search_locations))).parent}


# ---------------------------------------------------------------------------------------- our side

@dataclass
class Report:
    uses: list[str] = field(default_factory=list)  # "file:line: what was checked"
    problems: list[str] = field(default_factory=list)  # "file:line: what is wrong"

    def ok(self) -> bool:
        return not self.problems


@dataclass
class Typed:
    kind: str  # sym (a module, class or function itself) | inst (an instance of class `sym`) | method (bound)
    sym: Sym


def our_files(repo: Path = REPO) -> dict[str, ast.Module]:
    out = {}
    for pkg in OUR_PACKAGES:
        for p in sorted((repo / pkg).rglob("*.py")):
            out[p.relative_to(repo).as_posix()] = ast.parse(p.read_text(encoding="utf-8"))
    return out


def _parents(tree: ast.AST) -> dict[ast.AST, ast.AST]:
    return {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}


class Checker:
    def __init__(self, tree: SourceTree, files: dict[str, ast.Module] | None = None) -> None:
        self.t = tree
        self.files = our_files() if files is None else files
        self.r = Report()
        self.hook_own: set[str] = set()  # members our worker-extension classes define themselves
        for rel in HOOK_MODULES:
            if rel in self.files:
                for cls in [n for n in ast.walk(self.files[rel]) if isinstance(n, ast.ClassDef)]:
                    self.hook_own |= _class_own_names(cls)

    # -- reporting
    def use(self, site: str, what: str) -> None:
        self.r.uses.append(f"{site}: {what}")

    def bad(self, site: str, what: str, why: str) -> None:
        self.r.problems.append(f"{site}: {what} - {why}")

    def run(self) -> Report:
        for rel, mod in self.files.items():
            self.check_file(rel, mod)
        self.check_builders()
        self.check_payloads()
        self.check_proposer()
        self.check_megatron_te()
        return self.r

    # -- one of our files
    def check_file(self, rel: str, mod: ast.Module) -> None:
        env: dict[str, str] = {}
        for node in ast.walk(mod):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.split(".")[0] in PACKAGES:
                        site = f"{rel}:{node.lineno}"
                        self.use(site, f"import {a.name}")
                        if self.t.path(a.name) is None:
                            self.bad(site, f"import {a.name}", "no such module")
                        env[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
            elif isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] in PACKAGES:
                site = f"{rel}:{node.lineno}"
                for a in node.names:
                    dotted = f"{node.module}.{a.name}"
                    self.use(site, f"from {node.module} import {a.name}")
                    if self.t.path(node.module) is None:
                        self.bad(site, f"from {node.module} import {a.name}", f"no module {node.module}")
                    elif self.t.lookup(dotted) is None:
                        self.bad(site, f"from {node.module} import {a.name}", f"{node.module} has no {a.name}")
                    env[a.asname or a.name] = dotted
        host = HOOK_MODULES.get(rel)
        for cls in [n for n in mod.body if isinstance(n, ast.ClassDef)] + [None]:
            scope = _Scope(self, rel, env, cls, host)
            for fn in (cls.body if cls else mod.body):
                if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    scope.function(fn)

    # -- keyword dicts built for a vLLM class
    def check_builders(self) -> None:
        for where, target in KWARG_BUILDERS.items():
            rel, _, fname = where.partition("::")
            fn = _find_def(self.files.get(rel), fname)
            cls = self.t.lookup(target)
            if fn is None or cls is None:
                self.bad(rel, where, f"builder or its target {target} not found")
                continue
            sig = self.t.signature(cls, bound=True)
            own = {a.arg for a in fn.args.args + fn.args.kwonlyargs}
            keys = _dict_keys(fn)
            for frel, fmod in self.files.items():  # callers' extra keywords go into the dict too
                for c in ast.walk(fmod):
                    if isinstance(c, ast.Call) and _name_of(c.func) == fname:
                        keys += [(k.arg, k.value, f"{frel}:{c.lineno}") for k in c.keywords
                                 if k.arg and k.arg not in own]
            for key, value, line in keys:
                site = f"{rel}:{line}" if isinstance(line, int) else line
                self.use(site, f"{target.rpartition('.')[2]}({key}=...)")
                self.check_key(site, cls, sig, key, value)

    def check_key(self, site: str, cls: Sym, sig: Sig | None, key: str, value: ast.expr | None) -> None:
        name = cls.qual.rpartition(".")[2]
        if sig is None:
            return
        if key not in sig.positional + sig.kwonly and not sig.varkw:
            self.bad(site, f"{name}({key}=...)", f"{cls.qual} has no field or parameter {key!r}")
            return
        ann = sig.annotations.get(key)
        if ann is None or value is None:
            return
        if isinstance(value, ast.Constant) and isinstance(value.value, str):
            opts = self.t.literal_options(ann, sig.module)
            if opts is not None and value.value not in opts:
                self.bad(site, f"{name}({key}={value.value!r})", f"allowed: {sorted(opts)}")
        nested = _literal_dict(value)
        if nested is not None:
            sub = _union_class(self.t, ann, sig.module)
            if sub is not None:
                subsig = self.t.signature(sub, bound=True)
                for k, v in nested:
                    self.use(site, f"{name}.{key}[{k!r}]")
                    self.check_key(site, sub, subsig, k, v)

    # -- weight-transfer payloads, per backend
    def check_payloads(self) -> None:
        mod = self.files.get(PAYLOAD_FILE)
        if mod is None:
            return
        parents = _parents(mod)
        ours = {c.value for c in ast.walk(mod) if isinstance(c, ast.Constant) and isinstance(c.value, str)}
        registered = self.backend_registry()
        backends = sorted(b for b in registered if b in ours and _compared_to_backend(mod, b))
        for call in [c for c in ast.walk(mod) if isinstance(c, ast.Call)]:
            f = call.func
            if not (isinstance(f, ast.Attribute) and f.attr == "remote" and isinstance(f.value, ast.Attribute)
                    and f.value.attr in PAYLOADS and call.args):
                continue
            kind, site = f.value.attr, f"{PAYLOAD_FILE}:{call.lineno}"
            fn = _enclosing(call, parents, (ast.FunctionDef, ast.AsyncFunctionDef))
            keys = _payload_keys(call.args[0], fn)
            for b in backends:
                if b not in _branch_backends(call, parents, backends):
                    continue
                engine = self.t.lookup(registered[b])
                attr = self.t.member(engine, PAYLOADS[kind]) if engine else None
                cls = (self.t.resolve_expr(attr.node.value, attr.module)
                       if attr and isinstance(attr.node, ast.Assign) else None)
                if cls is None or cls.kind != "class":
                    self.bad(site, f"{kind} payload for backend {b!r}", f"{registered[b]}.{PAYLOADS[kind]} not found")
                    continue
                sig = self.t.signature(cls, bound=True)
                mine = {k for k, node in keys if b in _branch_backends(node, parents, backends)}
                self.use(site, f"{kind} payload {sorted(mine)} -> {cls.qual} ({b})")
                for k in sorted(mine):
                    self.check_key(site, cls, sig, k, None)
                missing = sorted(r for r in (sig.required if sig else ()) if r not in mine)
                if missing:
                    self.bad(site, f"{kind} payload for backend {b!r}", f"{cls.qual} requires {missing}")

    def backend_registry(self) -> dict[str, str]:
        """{backend: "module.EngineClass"} from vLLM's `WeightTransferEngineFactory.register_engine` calls."""
        mod = self.t.parse(WEIGHT_TRANSFER_FACTORY)
        out = {}
        for c in ast.walk(mod) if mod else ():
            if isinstance(c, ast.Call) and _name_of(c.func) == "register_engine" and len(c.args) == 3 \
                    and "WeightTransferEngineFactory" in ast.unparse(c.func):
                name, module, cls = (a.value for a in c.args if isinstance(a, ast.Constant))
                out[name] = f"{module}.{cls}"
        return out

    # -- the custom proposer, as vLLM's model runner builds and calls it
    def check_proposer(self) -> None:
        rel, _, cname = PROPOSER.partition("::")
        ours = next((n for n in ast.walk(self.files.get(rel, ast.Module([], []))) if isinstance(n, ast.ClassDef)
                     and n.name == cname), None)
        worker = self.t.lookup(HOOK_MODULES[next(iter(HOOK_MODULES))])
        runner_attr = self.t.class_members(worker).get("model_runner") if worker else None
        runner = self.t.value_type(runner_attr) if runner_attr else None
        if ours is None or runner is None:
            self.bad(rel, PROPOSER, "proposer class or vLLM's model runner not found")
            return
        methods = {f.name: f for f in ours.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))}
        rmod = self.t.parse(runner.module)
        calls = []
        for node in ast.walk(rmod):
            if isinstance(node, ast.If) and any(isinstance(c, ast.Constant) and c.value == "custom_class"
                                                for c in ast.walk(node.test)):
                calls += [x for s in node.body for x in ast.walk(s) if isinstance(x, ast.Call)]
            if isinstance(node, ast.If) and isinstance(node.test, ast.Call) and _name_of(node.test.func) == "hasattr" \
                    and "drafter" in ast.unparse(node.test):
                calls += [x for s in node.body for x in ast.walk(s) if isinstance(x, ast.Call)]
        calls = list({id(c): c for c in calls}.values())
        seen_propose = False
        vsite = f"vllm:{runner.module}"
        for c in calls:
            recv = c.func.value if isinstance(c.func, ast.Attribute) else None
            if recv is not None and "drafter" in ast.unparse(recv) \
                    and c.func.attr in methods:  # type: ignore[union-attr]
                m = c.func.attr  # type: ignore[union-attr]
                seen_propose |= m == "propose"
                self.use(f"{rel}:{methods[m].lineno}", f"{cname}.{m} called by {vsite}:{c.lineno}")
                self.bind(f"{rel}:{methods[m].lineno}", f"{cname}.{m}", Sym("function", m, rel, methods[m]), True, c,
                          f" (as {vsite}:{c.lineno} calls it)")
            elif isinstance(c.func, ast.Name):  # a factory such as create_custom_proposer(vllm_config)
                fn = self.t.resolve_expr(c.func, runner.module)
                if fn is None or fn.kind != "function":
                    continue
                built = {t.id for s in ast.walk(fn.node) if isinstance(s, ast.Assign) and isinstance(s.value, ast.Call)
                         and _name_of(s.value.func) == "getattr" for t in s.targets if isinstance(t, ast.Name)}
                for k in [x for x in ast.walk(fn.node) if isinstance(x, ast.Call) and _name_of(x.func) in built]:
                    init = Sym("function", "__init__", rel, methods.get("__init__"))
                    self.use(f"{rel}:{ours.lineno}", f"{cname}(...) built by {fn.qual}")
                    if init.node is not None:
                        self.bind(f"{rel}:{ours.lineno}", f"{cname}.__init__", init, True, k,
                                  f" (as {fn.qual} constructs it)")
        if not seen_propose:
            self.bad(f"{rel}:{ours.lineno}", f"{cname}.propose",
                     f"{runner.qual} no longer calls propose() in its 'custom_class' branch")

    # -- the TE classes megatron-core's TE spec builds on
    def check_megatron_te(self) -> None:
        """Every `te.*` base class in the megatron-core modules the TE layer spec imports its layers from."""
        mods = {str(target).rpartition(".")[0] for kind, target in self.t.bindings(MEGATRON_TE_SPEC).values()
                if kind == "import" and str(target).rpartition(".")[0].endswith(".transformer_engine")}
        for mod in sorted(mods):
            for cls in [n for n in ast.walk(self.t.parse(mod) or ast.Module([], [])) if isinstance(n, ast.ClassDef)]:
                for b in cls.bases:
                    text = ast.unparse(b)
                    if not text.startswith("te."):
                        continue
                    site = f"megatron:{mod}:{cls.lineno}"
                    self.use(site, f"{cls.name} subclasses {text}")
                    if self.t.resolve_expr(b, mod) is None:
                        self.bad(site, f"{cls.name}({text})",
                                 f"transformer_engine {PINS['transformer-engine']} has no {text[3:]}")

    # -- a call against a signature
    def bind(self, site: str, what: str, callee: Sym, bound: bool, call: ast.Call, note: str = "") -> None:
        sig = self.t.signature(callee, bound)
        if sig is None:
            return
        star = any(isinstance(a, ast.Starred) for a in call.args)
        starstar = any(k.arg is None for k in call.keywords)
        npos = len([a for a in call.args if not isinstance(a, ast.Starred)])
        if not star and not sig.varargs and npos > len(sig.positional):
            self.bad(site, what, f"takes {len(sig.positional)} positional arguments, {npos} given{note}")
        given = set(sig.positional[:npos])
        for k in call.keywords:
            if k.arg is None:
                continue
            given.add(k.arg)
            if k.arg in sig.positional[:npos]:
                self.bad(site, f"{what}({k.arg}=...)", f"got multiple values for {k.arg!r}: "
                         f"{npos} positional arguments fill {sig.positional[:npos]}{note}")
            elif k.arg not in sig.positional[npos:] + sig.kwonly and not sig.varkw:
                self.bad(site, f"{what}({k.arg}=...)", f"no parameter {k.arg!r}{note}")
            elif isinstance(k.value, ast.Constant) and isinstance(k.value.value, str) and k.arg in sig.annotations:
                opts = self.t.literal_options(sig.annotations[k.arg], sig.module)
                if opts is not None and k.value.value not in opts:
                    self.bad(site, f"{what}({k.arg}={k.value.value!r})", f"allowed: {sorted(opts)}")
        if not star and not starstar:
            missing = sorted(sig.required - given)
            if missing:
                self.bad(site, what, f"missing required {missing}{note}")
        node = callee.node
        for i, a in enumerate(call.args[:len(sig.positional)]):  # dict literals read by key in the callee
            keys = _literal_dict(a)
            if keys is None or not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            read = {s.slice.value for s in ast.walk(node)
                    if isinstance(s, ast.Subscript) and isinstance(s.ctx, ast.Load)
                    and isinstance(s.value, ast.Name) and s.value.id == sig.positional[i]
                    and isinstance(s.slice, ast.Constant)}
            missing = sorted(read - {k for k, _ in keys})
            if missing:
                self.bad(site, what, f"its {sig.positional[i]!r} dict is read for keys {missing}{note}")


class _Scope:
    """Types of names inside one of our classes (or the module level) and the checks of each expression."""

    def __init__(self, c: Checker, rel: str, env: dict[str, str], cls: ast.ClassDef | None, host: str | None):
        self.c, self.rel, self.env, self.cls = c, rel, env, cls
        self.host = c.t.lookup(host) if host and cls is not None else None
        self.own = _class_own_names(cls) | c.hook_own if cls is not None else set()
        self.self_types: dict[str, Typed] = {}
        if cls is not None:
            for (where, (owner, attr)) in EXTERNAL_ATTRS.items():
                frel, _, q = where.partition("::")
                cname, _, name = q.partition(".")
                if frel == rel and cname == cls.name:
                    o = c.t.lookup(owner)
                    m = c.t.class_members(o).get(attr) if o else None
                    t = c.t.value_type(m) if m else None
                    if t is not None:
                        self.self_types[name] = Typed("inst", t)
            for s in ast.walk(cls):
                if isinstance(s, ast.Assign) and len(s.targets) == 1 and isinstance(s.targets[0], ast.Attribute) \
                        and isinstance(s.targets[0].value, ast.Name) and s.targets[0].value.id == "self":
                    t = self.etype(s.value, {}, check=False)
                    if t is not None and t.kind == "inst":
                        self.self_types[s.targets[0].attr] = t

    def function(self, fn: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        local: dict[str, Typed] = {}
        for node in _ordered(fn):
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                t = self.etype(node.value, local, check=False)
                for tg in targets:
                    if isinstance(tg, ast.Name):
                        if t is not None and t.kind == "inst":
                            local[tg.id] = t
                        else:
                            local.pop(tg.id, None)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
                self.etype(node, local, check=True)
            elif isinstance(node, ast.Call):
                self.call(node, local)

    def site(self, node: ast.AST) -> str:
        return f"{self.rel}:{getattr(node, 'lineno', 0)}"

    def etype(self, e: ast.expr, local: dict[str, Typed], check: bool) -> Typed | None:
        t = self.c.t
        if isinstance(e, ast.Await):
            return self.etype(e.value, local, check)
        if isinstance(e, ast.Name):
            if e.id in local:
                return local[e.id]
            if e.id in self.env:
                s = t.lookup(self.env[e.id])
                return Typed("sym", s) if s else None
            return None
        if isinstance(e, ast.Attribute):
            if isinstance(e.value, ast.Name) and e.value.id == "self" and self.cls is not None:
                if e.attr in self.self_types:
                    return self.self_types[e.attr]
                if self.host is None or e.attr in self.own:
                    return None
                base = Typed("inst", self.host)
            else:
                base = self.etype(e.value, local, check=False)
            return self.member(base, e.attr, e, check) if base else None
        if isinstance(e, ast.Call):
            if _name_of(e.func) == "getattr" and len(e.args) >= 2 and isinstance(e.args[1], ast.Constant):
                if isinstance(e.args[0], ast.Name) and e.args[0].id == "self":
                    base = None if self.host is None or e.args[1].value in self.own else Typed("inst", self.host)
                else:
                    base = self.etype(e.args[0], local, False)
                return self.member(base, str(e.args[1].value), e, check) if base else None
            f = self.etype(e.func, local, check=False)
            if f is None:
                return None
            r = t.call_result(f.sym, f.sym.module) if f.kind in ("sym", "method") else None
            return Typed("inst", r) if r else None
        return None

    def member(self, base: Typed, attr: str, node: ast.AST, check: bool) -> Typed | None:
        t = self.c.t
        s = base.sym
        if s.kind not in ("module", "class"):
            return None
        m = t.member(s, attr)
        shown = f"{s.qual}.{attr}"
        if check:
            self.c.use(self.site(node), shown)
            if m is None and (s.kind == "module" or t.is_closed(s)):
                self.c.bad(self.site(node), shown, f"{s.qual} has no attribute {attr!r}")
        if m is None:
            return None
        if base.kind == "inst":
            if m.kind == "function":
                decos = {_name_of(d) for d in m.node.decorator_list}  # type: ignore[union-attr]
                if "property" in decos or "cached_property" in decos:
                    r = t.call_result(m, m.module)
                    return Typed("inst", r) if r else None
                return Typed("method", m)
            vt = t.value_type(m) if m.kind == "value" else None
            return Typed("inst", vt) if vt else None
        return Typed("sym", m)

    def call(self, c: ast.Call, local: dict[str, Typed]) -> None:
        if isinstance(c.func, ast.Attribute) and c.func.attr == "collective_rpc" and c.args \
                and isinstance(c.args[0], ast.Constant):
            self.rpc(c)
            return
        if _name_of(c.func) == "getattr" and not isinstance(c.func, ast.Attribute):
            self.etype(c, local, check=True)
            return
        f = self.etype(c.func, local, check=False)
        if f is None or f.sym.kind not in ("function", "class"):
            return
        what = f.sym.qual
        self.c.use(self.site(c), f"call {what}")
        self.c.bind(self.site(c), what, f.sym, f.kind == "method", c)

    def rpc(self, c: ast.Call) -> None:
        name = c.args[0].value  # type: ignore[attr-defined]
        site = self.site(c)
        if name in self.c.hook_own:
            self.c.use(site, f"collective_rpc({name!r}) -> our worker extension")
            return
        worker = self.c.t.lookup(HOOK_MODULES[next(iter(HOOK_MODULES))])
        m = self.c.t.class_members(worker).get(name) if worker else None
        self.c.use(site, f"collective_rpc({name!r}) -> vLLM Worker.{name}")
        if m is None or m.kind != "function":
            self.c.bad(site, f"collective_rpc({name!r})",
                       "neither our worker extension nor vLLM's Worker has this method")
            return
        kw = next((k.value for k in c.keywords if k.arg == "kwargs"), None)
        args = next((k.value for k in c.keywords if k.arg == "args"), None)
        fake = ast.Call(func=c.func, args=list(args.elts) if isinstance(args, ast.Tuple) else
                        ([ast.Starred(args)] if args is not None else []), keywords=[])
        keys = _literal_dict(kw) if kw is not None else []
        if kw is not None and keys is None:
            fake.keywords.append(ast.keyword(arg=None, value=kw))
        for k, v in keys or []:
            fake.keywords.append(ast.keyword(arg=k, value=v))
        self.c.bind(site, f"Worker.{name}", m, True, fake)


# ------------------------------------------------------------------------------------------ helpers

def _class_own_names(cls: ast.ClassDef | None) -> set[str]:
    if cls is None:
        return set()
    names = {s.name for s in cls.body if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
    for s in ast.walk(cls):
        for t in (s.targets if isinstance(s, ast.Assign) else [s.target] if isinstance(s, ast.AnnAssign) else []):
            if isinstance(t, ast.Name):
                names.add(t.id)
            elif isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                names.add(t.attr)
    return names


def _ordered(fn: ast.AST):
    """Nodes of a function in source order (assignments before later uses), nested functions included."""
    return sorted((n for n in ast.walk(fn) if hasattr(n, "lineno") and n is not fn),
                  key=lambda n: (n.lineno, n.col_offset, 0 if isinstance(n, (ast.Assign, ast.AnnAssign)) else 1))


def _find_def(mod: ast.Module | None, name: str):
    return next((n for n in ast.walk(mod) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name),
                None) if mod else None


def _literal_dict(e: ast.expr | None) -> list[tuple[str, ast.expr]] | None:
    """(key, value) of `{"k": v}` or `dict(k=v)`; None if `e` is neither (or has non-constant keys)."""
    if isinstance(e, ast.Dict) and all(isinstance(k, ast.Constant) for k in e.keys):
        return [(str(k.value), v) for k, v in zip(e.keys, e.values)]  # type: ignore[union-attr]
    if isinstance(e, ast.Call) and _name_of(e.func) == "dict" and not e.args:
        return [(k.arg, k.value) for k in e.keywords if k.arg]
    return None


def _dict_keys(fn: ast.AST) -> list[tuple[str, ast.expr | None, int]]:
    """Keys a builder function puts into the dicts it makes: literals, dict(...) and `d["k"] = v`. A dict
    that is itself a value (of a key, or of `d["k"] = {...}`) is checked through that key's annotation."""
    nested = set()
    for n in ast.walk(fn):
        for _, v in _literal_dict(n) or []:
            nested.add(v)
        if isinstance(n, ast.Assign) and any(isinstance(t, ast.Subscript) for t in n.targets):
            nested.add(n.value)
    out = []
    for n in ast.walk(fn):
        if n not in nested:
            out += [(k, v, n.lineno) for k, v in _literal_dict(n) or []]  # type: ignore[arg-type]
        if isinstance(n, ast.Assign):
            for t in n.targets:
                if isinstance(t, ast.Subscript) and isinstance(t.slice, ast.Constant):
                    out.append((str(t.slice.value), n.value, n.lineno))
    return out


def _payload_keys(arg: ast.expr, fn: ast.AST | None) -> list[tuple[str, ast.AST]]:
    lit = _literal_dict(arg)
    if lit is not None:
        return [(k, arg) for k, _ in lit]
    if isinstance(arg, ast.Name) and fn is not None:
        out = []
        for n in ast.walk(fn):
            if isinstance(n, (ast.Assign, ast.AnnAssign)):
                targets = n.targets if isinstance(n, ast.Assign) else [n.target]
                for t in targets:
                    if isinstance(t, ast.Name) and t.id == arg.id:
                        out += [(k, n) for k, _ in _literal_dict(n.value) or []]
                    if isinstance(t, ast.Subscript) and isinstance(t.value, ast.Name) and t.value.id == arg.id \
                            and isinstance(t.slice, ast.Constant):
                        out.append((str(t.slice.value), n))
        return out
    return []


def _enclosing(node: ast.AST, parents: dict, kinds: tuple) -> ast.AST | None:
    while node in parents:
        node = parents[node]
        if isinstance(node, kinds):
            return node
    return None


def _compared_to_backend(mod: ast.Module, value: str) -> bool:
    return any(isinstance(n, ast.Compare) and "backend" in ast.unparse(n.left)
               and any(isinstance(c, ast.Constant) and c.value == value for x in n.comparators for c in ast.walk(x))
               for n in ast.walk(mod))


def _branch_backends(node: ast.AST, parents: dict, universe: list[str]) -> set[str]:
    """Backends under which `node` runs, from the enclosing `if <...>.backend == "x"` tests."""
    allowed = set(universe)
    child = node
    while child in parents:
        p = parents[child]
        if isinstance(p, ast.If) and isinstance(p.test, ast.Compare) and "backend" in ast.unparse(p.test.left) \
                and isinstance(p.test.ops[0], ast.Eq) and isinstance(p.test.comparators[0], ast.Constant):
            b = p.test.comparators[0].value
            if child in p.body:
                allowed &= {b}
            elif child in p.orelse:
                allowed -= {b}
        child = p
    return allowed


# ---------------------------------------------------------------------------------------------- CLI

def check(roots: dict[str, Path] | None = None, overlay: dict[str, Path] | None = None,
          files: dict[str, ast.Module] | None = None) -> Report:
    return Checker(SourceTree(roots or default_roots(), overlay), files).run()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vllm-src", type=Path, help="an unpacked vllm tree (default: the pinned wheel, cached)")
    ap.add_argument("--te-src", type=Path, help="an unpacked transformer_engine tree")
    ap.add_argument("-v", "--verbose", action="store_true", help="list every checked use")
    args = ap.parse_args(argv)
    try:
        roots = {**default_roots(), **({"vllm": args.vllm_src} if args.vllm_src else {}),
                 **({"transformer_engine": args.te_src} if args.te_src else {})}
    except RegistryUnreachable as exc:
        print(f"gpu contract: {exc}", file=sys.stderr)
        return 2
    report = check(roots)
    if args.verbose:
        print("\n".join(report.uses))
    for p in report.problems:
        print(p)
    print(f"gpu contract: {len(report.uses)} uses checked against vllm {PINS['vllm']}, transformer-engine "
          f"{PINS['transformer-engine']}, installed megatron-core: {len(report.problems)} problems")
    return 0 if report.ok() else 1


if __name__ == "__main__":
    sys.exit(main())
