"""The layers of docs/architecture.md, read from the code's own imports: a new circle or an upward import fails
here with the two file names.

Hardware: CPU only (reads source with `ast`, imports nothing). Run:
    .venv/bin/python -m pytest tests/test_architecture.py -q

What counts as an import: every `import` / `from ... import` statement in a product file (megatron_sortedrl/,
scheduler/, speculative/), at module level or inside a function or an `if TYPE_CHECKING:` block alike: a
deferred or type-only import is still a dependency a reader has to follow. `from pkg import name`, where
`pkg/__init__.py` only hands `name` on from one of its modules, counts as an import of that module; package
faces (`__init__.py`) are no nodes of their own. Imports made by `importlib` are not seen.
"""

from __future__ import annotations

import ast
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("megatron_sortedrl", "scheduler", "speculative")

# The pure scheduling policies (docs/architecture.md, layer "policies"): they, and every product file they
# reach, take from megatron_sortedrl/ only these leaf modules.
POLICIES = tuple(f"scheduler/{name}.py" for name in
                 ("protocol", "base", "policies", "history", "placement", "layout", "selective"))
LEAVES = ("megatron_sortedrl/sample.py", "megatron_sortedrl/errors.py", "megatron_sortedrl/schema.py")
# The simulator layer sits above the policies: nothing below it imports it.
SIMULATOR = "scheduler/sim/"


def _module_file(module: str) -> str | None:
    """The product file (relative path) that a dotted module name loads, or None outside the product."""
    if module.split(".")[0] not in PACKAGES:
        return None
    base = ROOT.joinpath(*module.split("."))
    if base.with_suffix(".py").is_file():
        return base.with_suffix(".py").relative_to(ROOT).as_posix()
    if (base / "__init__.py").is_file():
        return (base / "__init__.py").relative_to(ROOT).as_posix()
    return None


@lru_cache(maxsize=None)
def _tree(path: str) -> ast.Module:
    return ast.parse((ROOT / path).read_text(), filename=path)


@lru_cache(maxsize=None)
def _face_exports(init: str) -> dict[str, str]:
    """What a package face hands on: name -> the module file it comes from."""
    out: dict[str, str] = {}
    for node in _tree(init).body:
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            target = _module_file(node.module)
            if target is None:
                continue
            for alias in node.names:
                sub = _module_file(f"{node.module}.{alias.name}")
                out[alias.asname or alias.name] = sub or target
    return out


def _resolve(target: str, name: str | None, seen: frozenset = frozenset()) -> str:
    """Follow `name` through package faces to the file that defines it."""
    if name is None or not target.endswith("__init__.py") or target in seen:
        return target
    nxt = _face_exports(target).get(name)
    if nxt is None:
        return target
    return _resolve(nxt, name, seen | {target})


def product_files() -> list[str]:
    return sorted(p.relative_to(ROOT).as_posix() for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


@lru_cache(maxsize=None)
def imports(path: str) -> tuple[tuple[str, str, int], ...]:
    """(imported file, name taken or '', line) for every product import in `path`."""
    out = []
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = _module_file(alias.name)
                if target:
                    out.append((target, "", node.lineno))
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            target = _module_file(node.module)
            if target is None:
                continue
            for alias in node.names:
                sub = _module_file(f"{node.module}.{alias.name}")
                out.append((sub or _resolve(target, alias.name), alias.name if sub is None else "", node.lineno))
    return tuple(out)


def graph() -> dict[str, set[str]]:
    """File -> the files it imports; package faces are no nodes."""
    edges: dict[str, set[str]] = {}
    for path in product_files():
        if path.endswith("__init__.py"):
            continue
        edges[path] = {t for t, _, _ in imports(path) if t != path and not t.endswith("__init__.py")}
    return edges


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one file (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges.get(start, ()))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def reach(starts: tuple[str, ...], edges: dict[str, set[str]]) -> dict[str, str]:
    """Every file reachable from `starts` -> the file that first imported it on the way."""
    parent = {s: s for s in starts}
    todo = list(starts)
    while todo:
        node = todo.pop()
        for child in sorted(edges.get(node, ())):
            if child not in parent:
                parent[child] = node
                todo.append(child)
    return parent


def test_no_import_circle():
    edges = graph()
    problems = []
    for component in circles(edges):
        members = set(component)
        ties = [f"{a} -> {b}" for a in component for b in sorted(edges[a] & members)]
        problems.append(f"import circle of {len(component)} files: " + "; ".join(ties))
    assert not problems, "\n".join(problems)


def test_no_private_name_across_files():
    problems = [f"{path}:{line} imports private `{name}` from {target}"
                for path in product_files() for target, name, line in imports(path)
                if name.startswith("_") and not name.startswith("__") and target != path]
    assert not problems, "\n".join(problems)


def test_policies_take_only_leaf_records():
    edges = graph()
    parent = reach(POLICIES, edges)
    problems = [f"{parent[f]} -> {f}: the policies (and what they import) take from megatron_sortedrl/ only "
                f"{', '.join(LEAVES)}"
                for f in sorted(parent) if f.startswith("megatron_sortedrl/") and f not in LEAVES]
    problems += [f"{parent[f]} -> {f}: the policies never import the simulator layer"
                 for f in sorted(parent) if f.startswith(SIMULATOR)]
    assert not problems, "\n".join(problems)


def test_nothing_below_the_simulator_imports_it():
    problems = [f"{path}:{line} -> {target}: only the simulator layer, the driver's commands and tools above "
                f"it import {SIMULATOR}"
                for path in product_files() if path.startswith(("scheduler/", "speculative/"))
                and not path.startswith(SIMULATOR)
                for target, _, line in imports(path) if target.startswith(SIMULATOR)]
    assert not problems, "\n".join(problems)


def test_speculative_takes_only_leaf_records():
    """speculative/ stands below the driver (relayout, the tiny model, the config loader): what it needs from
    there is passed in."""
    problems = [f"{path}:{line} -> {target}: speculative/ takes from megatron_sortedrl/ only {', '.join(LEAVES)}; "
                f"pass what it needs in"
                for path in product_files() if path.startswith("speculative/")
                for target, _, line in imports(path)
                if (target.startswith("megatron_sortedrl/") and target not in LEAVES) or target.startswith(SIMULATOR)]
    assert not problems, "\n".join(problems)
