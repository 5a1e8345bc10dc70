"""Source of Python packages read as syntax trees, never imported: name lookup through modules, re-exports
and class hierarchies, call signatures, and the strings a `Literal[...]` annotation allows.

    tree = SourceTree({"vllm": Path("~/.cache/.../vllm-0.33.0/src")})
    sym = tree.lookup("vllm.v1.engine.async_llm.AsyncLLM.pause_generation")
    sig = tree.signature(sym, bound=True)          # Sig(positional=[], kwonly=["mode", "clear_cache"], ...)

The engine of `tools/gpu_contract.py`, which checks our GPU code against CUDA packages that cannot be
installed on the machine doing the check. `overlay` swaps single modules for altered copies (the contract
tests' negative cases). Written by hand with `ast`: type checkers need the package importable and its
compiled dependencies.

Left out: `__all__`-driven star imports, metaclass-generated members, decorators that change signatures
(the decorated function's own parameters are used), and conditional definitions (every branch counts).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

# Bases from the standard library that add no public members of interest.
OPEN_OK_BASES = {"object", "ABC", "Generic", "Protocol", "Enum", "IntEnum", "TypedDict", "NamedTuple"}

@dataclass
class Sym:
    kind: str  # module | class | function | value
    qual: str
    module: str
    node: ast.AST | None = None
    annotation: ast.expr | None = None  # of a value (class attribute or `self.x: T`)


@dataclass
class Sig:
    positional: list[str]
    kwonly: list[str]
    required: set[str]
    varargs: bool
    varkw: bool
    annotations: dict[str, ast.expr]
    module: str


class SourceTree:
    """Modules of several packages read as ASTs from `roots`, with `overlay` files replacing single modules."""

    def __init__(self, roots: dict[str, Path], overlay: dict[str, Path] | None = None) -> None:
        self.roots, self.overlay = roots, overlay or {}
        self._ast: dict[str, ast.Module | None] = {}
        self._bindings: dict[str, dict] = {}
        self._members: dict[str, dict] = {}

    def path(self, mod: str) -> Path | None:
        if mod in self.overlay:
            return self.overlay[mod]
        root = self.roots.get(mod.split(".")[0])
        if root is None:
            return None
        base = root.joinpath(*mod.split("."))
        for p in (base.with_suffix(".py"), base / "__init__.py"):
            if p.is_file():
                return p
        return None

    def parse(self, mod: str) -> ast.Module | None:
        if mod not in self._ast:
            p = self.path(mod)
            self._ast[mod] = _parse_file(p) if p else None
        return self._ast[mod]

    def is_package(self, mod: str) -> bool:
        p = self.path(mod)
        return p is not None and p.name == "__init__.py"

    def bindings(self, mod: str) -> dict[str, tuple[str, object]]:
        """Top-level names of a module (in if/try branches too): name -> (kind, node or import target)."""
        if mod in self._bindings:
            return self._bindings[mod]
        out: dict[str, tuple[str, object]] = {}
        tree = self.parse(mod)
        package = mod if self.is_package(mod) else mod.rpartition(".")[0]

        def visit(stmts):
            for s in stmts:
                if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    out.setdefault(s.name, ("function", s))
                elif isinstance(s, ast.ClassDef):
                    out.setdefault(s.name, ("class", s))
                elif isinstance(s, ast.Assign):
                    for t in s.targets:
                        for n in ast.walk(t):
                            if isinstance(n, ast.Name):
                                out.setdefault(n.id, ("value", s))
                elif isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name):
                    out.setdefault(s.target.id, ("value", s))
                elif isinstance(s, ast.Import):
                    for a in s.names:
                        top = a.name.split(".")[0]
                        out.setdefault(a.asname or top, ("import", a.name if a.asname else top))
                elif isinstance(s, ast.ImportFrom):
                    base = _absolute(s, package)
                    for a in s.names:
                        if a.name != "*":
                            out.setdefault(a.asname or a.name, ("import", f"{base}.{a.name}"))
                elif isinstance(s, (ast.If, ast.Try, ast.With)):
                    visit(s.body)
                    visit(getattr(s, "orelse", []))
                    for h in getattr(s, "handlers", []):
                        visit(h.body)
                    visit(getattr(s, "finalbody", []))
        if tree is not None:
            visit(tree.body)
        self._bindings[mod] = out
        return out

    def lookup(self, dotted: str, _depth: int = 0) -> Sym | None:
        parts = dotted.split(".")
        for i in range(len(parts), 0, -1):
            mod = ".".join(parts[:i])
            if self.path(mod) is not None:
                sym: Sym | None = Sym("module", mod, mod, self.parse(mod))
                for name in parts[i:]:
                    sym = self.member(sym, name, _depth) if sym else None
                return sym
        return None

    def member(self, sym: Sym, name: str, _depth: int = 0) -> Sym | None:
        if _depth > 40:
            return None
        if sym.kind == "module":
            b = self.bindings(sym.module).get(name)
            if b is None:
                if self.path(f"{sym.module}.{name}") is not None:
                    sub = f"{sym.module}.{name}"
                    return Sym("module", sub, sub, self.parse(sub))
                return self._lazy(sym.module, name, _depth)
            kind, node = b
            if kind == "import":
                return self.lookup(str(node), _depth + 1)
            ann = node.annotation if isinstance(node, ast.AnnAssign) else None
            return Sym(kind, f"{sym.module}.{name}", sym.module, node, ann)
        if sym.kind == "class":
            found = self.class_members(sym).get(name)
            return found
        return None

    def _lazy(self, mod: str, name: str, depth: int) -> Sym | None:
        """vLLM's `MODULE_ATTRS = {"Name": ".module:Name"}` with a module-level `__getattr__`."""
        tree = self.parse(mod)
        if tree is None or "__getattr__" not in self.bindings(mod):
            return None
        package = mod if self.is_package(mod) else mod.rpartition(".")[0]
        for node in ast.walk(tree):
            if isinstance(node, ast.Dict):
                for k, v in zip(node.keys, node.values):
                    if isinstance(k, ast.Constant) and k.value == name and isinstance(v, ast.Constant) \
                            and isinstance(v.value, str) and ":" in v.value:
                        target, attr = v.value.split(":")
                        target = package + target if target.startswith(".") else target
                        return self.lookup(f"{target}.{attr}", depth + 1)
        return None

    def resolve_expr(self, expr: ast.expr, mod: str, depth: int = 0) -> Sym | None:
        if isinstance(expr, ast.Name):
            return self.member(Sym("module", mod, mod), expr.id, depth)
        if isinstance(expr, ast.Attribute):
            base = self.resolve_expr(expr.value, mod, depth)
            return self.member(base, expr.attr, depth) if base else None
        if isinstance(expr, ast.Subscript):
            return self.resolve_expr(expr.value, mod, depth)
        if isinstance(expr, ast.Constant) and isinstance(expr.value, str):  # a string annotation
            try:
                return self.resolve_expr(ast.parse(expr.value, mode="eval").body, mod, depth)
            except SyntaxError:
                return None
        if isinstance(expr, ast.BinOp):  # `X | None`: the first class found
            return self.resolve_expr(expr.left, mod, depth) or self.resolve_expr(expr.right, mod, depth)
        return None

    def is_closed(self, cls: Sym) -> bool:
        """True when every base class can be read here, so a name missing from its members is really missing
        (a subclass of torch.nn.Module, say, inherits `cuda` from a package this tree does not hold)."""
        for c in self._mro(cls):
            for b in c.node.bases:  # type: ignore[union-attr]
                s = self.resolve_expr(b, c.module)
                if (s is None or s.kind != "class") and _name_of(b) not in OPEN_OK_BASES:
                    return False
        return True

    def bases(self, cls: Sym) -> list[Sym]:
        out = []
        for b in cls.node.bases:  # type: ignore[union-attr]
            s = self.resolve_expr(b, cls.module)
            if s is not None and s.kind == "class":
                out.append(s)
        return out

    def class_members(self, cls: Sym) -> dict[str, Sym]:
        """Names defined in the class body, assigned as `self.x` in its methods, or inherited (own first)."""
        if cls.qual in self._members:
            return self._members[cls.qual]
        self._members[cls.qual] = own = {}
        node = cls.node
        assert isinstance(node, ast.ClassDef)
        for s in node.body:
            if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef)):
                own.setdefault(s.name, Sym("function", f"{cls.qual}.{s.name}", cls.module, s))
            elif isinstance(s, ast.ClassDef):
                own.setdefault(s.name, Sym("class", f"{cls.qual}.{s.name}", cls.module, s))
            elif isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name):
                own.setdefault(s.target.id, Sym("value", f"{cls.qual}.{s.target.id}", cls.module, s, s.annotation))
            elif isinstance(s, ast.Assign):
                for t in s.targets:
                    if isinstance(t, ast.Name):
                        own.setdefault(t.id, Sym("value", f"{cls.qual}.{t.id}", cls.module, s))
        for s in ast.walk(node):  # self.x = ... / self.x: T = ... in methods (annotated ones win)
            target = s.target if isinstance(s, ast.AnnAssign) else None
            targets = [target] if target is not None else (s.targets if isinstance(s, ast.Assign) else [])
            for t in targets:
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                    prev = own.get(t.attr)
                    if prev is None or (prev.kind == "value" and prev.annotation is None and target is not None):
                        own[t.attr] = Sym("value", f"{cls.qual}.{t.attr}", cls.module, s,
                                          s.annotation if isinstance(s, ast.AnnAssign) else None)
        for base in self.bases(cls):
            for k, v in self.class_members(base).items():
                own.setdefault(k, v)
        return own

    def value_type(self, sym: Sym) -> Sym | None:
        """The class of a value: its annotation, or the class its assigned call constructs."""
        if sym.kind == "class":
            return sym
        if sym.annotation is not None:
            return _union_class(self, sym.annotation, sym.module)
        node = sym.node
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(node.value, ast.Call):
            return self.call_result(self.resolve_expr(node.value.func, sym.module), sym.module)
        return None

    def call_result(self, callee: Sym | None, mod: str) -> Sym | None:
        if callee is None:
            return None
        if callee.kind == "class":
            return callee
        if callee.kind == "function" and isinstance(callee.node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            ret = callee.node.returns
            owner = callee.qual.rpartition(".")[0]
            if isinstance(ret, (ast.Constant, ast.Name)) and _name_of(ret) in ("Self", owner.rpartition(".")[2]):
                return self.lookup(owner)
            if ret is not None:
                t = self.resolve_expr(ret, callee.module)
                return t if t is not None and t.kind == "class" else None
        return None

    def signature(self, sym: Sym, bound: bool) -> Sig | None:
        """Parameters of a function (minus self/cls when `bound`) or of a class's constructor."""
        if sym.kind == "function" and isinstance(sym.node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = sym.node.args
            pos = [x.arg for x in a.posonlyargs + a.args]
            defaults = len(a.defaults)
            req = set(pos[:len(pos) - defaults] if defaults else pos)
            req |= {x.arg for x, d in zip(a.kwonlyargs, a.kw_defaults) if d is None}
            decos = {_name_of(d) for d in sym.node.decorator_list}
            if (bound or "classmethod" in decos) and "staticmethod" not in decos and pos:
                req.discard(pos[0])
                pos = pos[1:]
            ann = {x.arg: x.annotation for x in a.posonlyargs + a.args + a.kwonlyargs if x.annotation is not None}
            return Sig(pos, [x.arg for x in a.kwonlyargs], req, a.vararg is not None, a.kwarg is not None, ann,
                       sym.module)
        if sym.kind == "class":
            init = self.class_members(sym).get("__init__")
            if init is not None and init.kind == "function":
                return self.signature(init, bound=True)
            return self.fields_signature(sym)
        return None

    def fields_signature(self, cls: Sym) -> Sig:
        """Dataclass / msgspec / pydantic / TypedDict style: the annotated class attributes, bases first."""
        fields: dict[str, tuple[bool, ast.expr, str]] = {}
        kw_only = False
        for c in reversed(self._mro(cls)):
            total = not any(k.arg == "total" and isinstance(k.value, ast.Constant) and k.value.value is False
                            for k in c.node.keywords)  # type: ignore[union-attr]
            for s in c.node.body:  # type: ignore[union-attr]
                if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name):
                    text = ast.unparse(s.annotation)
                    if "ClassVar" in text or s.target.id.startswith("__") or text == "KW_ONLY":
                        continue
                    required = s.value is None and total and not text.startswith("NotRequired")
                    fields[s.target.id] = (required, s.annotation, c.module)
            kw_only |= any("kw_only=True" in ast.unparse(d) for d in c.node.decorator_list)  # type: ignore[union-attr]
        names = list(fields)
        req = {n for n, (r, _, _) in fields.items() if r}
        return Sig([] if kw_only else names, names if kw_only else [], req, False, False,
                   {n: a for n, (_, a, _) in fields.items()}, cls.module)

    def _mro(self, cls: Sym) -> list[Sym]:
        out, todo = [], [cls]
        while todo:
            c = todo.pop(0)
            if c.qual not in {x.qual for x in out}:
                out.append(c)
                todo.extend(self.bases(c))
        return out

    def literal_options(self, ann: ast.expr, mod: str, depth: int = 0) -> set[str] | None:
        """The strings a `Literal[...]` annotation (or an alias of one, or a union of them) allows; None:
        anything (no Literal, or `| str`)."""
        if depth > 10:
            return None
        if isinstance(ann, ast.BinOp):
            a, b = self.literal_options(ann.left, mod, depth + 1), self.literal_options(ann.right, mod, depth + 1)
            if (a is None and not _is_none(ann.left)) or (b is None and not _is_none(ann.right)):
                return None
            return (a or set()) | (b or set())
        if isinstance(ann, ast.Subscript) and _name_of(ann.value) == "Literal":
            items = ann.slice.elts if isinstance(ann.slice, ast.Tuple) else [ann.slice]
            out: set[str] = set()
            for it in items:
                if isinstance(it, ast.Constant):
                    out.add(str(it.value))
                else:
                    sub = self.literal_options(it, mod, depth + 1)
                    if sub is None:
                        return None
                    out |= sub
            return out
        if isinstance(ann, ast.Name):
            b = self.bindings(mod).get(ann.id)
            if b and b[0] == "value" and isinstance(b[1], ast.Assign):
                return self.literal_options(b[1].value, mod, depth + 1)
            if b and b[0] == "import":
                target, _, name = str(b[1]).rpartition(".")
                return self.literal_options(ast.Name(name), target, depth + 1) if self.path(target) else None
        return None


_PARSED: dict[tuple[str, int], ast.Module] = {}


def _parse_file(path: Path) -> ast.Module:
    """Parsed once per process and file version: the trees are only read, and a check parses ~150 modules."""
    key = (str(path), path.stat().st_mtime_ns)
    if key not in _PARSED:
        _PARSED[key] = ast.parse(path.read_text(encoding="utf-8"))
    return _PARSED[key]


def _absolute(node: ast.ImportFrom, package: str) -> str:
    if not node.level:
        return node.module or ""
    base = package.split(".")
    base = base[:len(base) - (node.level - 1)] if node.level > 1 else base
    return ".".join(base + ([node.module] if node.module else []))


def _name_of(expr: ast.expr) -> str:
    if isinstance(expr, ast.Name):
        return expr.id
    if isinstance(expr, ast.Attribute):
        return expr.attr
    if isinstance(expr, ast.Constant) and isinstance(expr.value, str):
        return expr.value
    if isinstance(expr, ast.Call):
        return _name_of(expr.func)
    return ""


def _is_none(expr: ast.expr) -> bool:
    return isinstance(expr, ast.Constant) and expr.value is None


def _union_class(t: SourceTree, ann: ast.expr, mod: str) -> Sym | None:
    """The one class of an annotation like `X | None` or `X | dict` (None when ambiguous)."""
    parts, todo = [], [ann]
    while todo:
        a = todo.pop()
        if isinstance(a, ast.BinOp):
            todo += [a.left, a.right]
        else:
            parts.append(a)
    found = (t.resolve_expr(p, mod) for p in parts if not _is_none(p))
    classes = [s for s in found if s is not None and s.kind == "class"]
    return classes[0] if len(classes) == 1 else None
