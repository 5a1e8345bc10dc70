"""No key without effect: every config key is read by some code outside the config modules.

    python -m pytest tests/test_config_keys.py -q

A static scan (the standard library's `ast`, no imports of the scanned code): for every leaf key of the
run config (`megatron_sortedrl/config/`, with `scheduler.*` and `speculative.*` from their packages)
and of the simulator config (`scheduler/sim/sim_config.py`), some Python file of the package, `scheduler/`,
`speculative/` or `tools/` must read the attribute from an object that names its section: `cfg.data.seed`,
`data_cfg.seed`, `tiny.seed`, `s.history_max_prompts` after `s = cfg.scheduler`, or a parameter annotated
with the section's class (`def f(cfg: SchedulerConfig)`) or typed in its docstring. A leaf name that only
one key has also counts when read from a generic `cfg`/`config`. Inside the config modules, only the loader
functions count (the schema classes validating their own fields do not). A key only the Slurm scripts
consume would go in `SLURM_ONLY` with the reason; the test checks that those keys really appear in `slurm/`.

Left out: whether the value read changes behaviour, or whether the function reading it is ever called (a
read inside an unused helper passes); the per-feature tests check that. Keys read through
`getattr(cfg, name)` with a computed name would be missed; there are none today, and a missed key fails
loudly here rather than passing silently.
"""

from __future__ import annotations

import ast
import re
from dataclasses import MISSING, dataclass, field, fields, is_dataclass
from pathlib import Path

from megatron_sortedrl.config import RunConfig
from scheduler.sim.sim_config import SimConfig

REPO = Path(__file__).resolve().parent.parent
CONFIG_MODULES = {"scheduler/config.py", "speculative/config.py", "scheduler/sim/sim_config.py",
                  "megatron_sortedrl/agentic/config.py",
                  *(p.relative_to(REPO).as_posix() for p in (REPO / "megatron_sortedrl" / "config").glob("*.py"))}
SCANNED_DIRS = ("megatron_sortedrl", "scheduler", "speculative", "tools")
ROOT_NAMES = ("cfg", "config", "run", "sim")  # names the run (or sim) config object goes by at the top level

# key -> why only the Slurm scripts read it. Empty today: cluster.cpus_per_node and cluster.gpus_per_node
# reach slurm/ray_on_slurm.sh through `layout --ray-resources`, which reads them in Python.
SLURM_ONLY: dict[str, str] = {}


GENERIC_RECEIVERS = ("cfg", "config")  # names any section object may go by


def config_keys(cls: type, prefix: str = "") -> list[tuple[str, type]]:
    """(dotted key, class that declares it) for every leaf field under `cls`."""
    keys = []
    for f in fields(cls):
        default = f.default_factory() if f.default_factory is not MISSING else f.default
        if is_dataclass(default):
            keys.extend(config_keys(type(default), f"{prefix}{f.name}."))
        else:
            keys.append((prefix + f.name, cls))
    return keys


def _last_name(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


@dataclass
class Reads:
    """Attribute reads of the scanned files: attribute name -> names its receivers go by (the receiver's last
    identifier, plus the section it was assigned from or annotated with)."""

    by_attr: dict[str, set[str]] = field(default_factory=dict)

    def add_file(self, tree: ast.AST, class_sections: dict[str, str]) -> None:
        aliases: dict[str, str] = {}
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name in class_sections):
            aliases["self"] = class_sections[cls.name]  # a section class's own methods read its fields
        for _ in range(2):  # twice, so that `self.cfg = cfg` after `cfg: SchedulerConfig` resolves
            for node in ast.walk(tree):  # x = cfg.data / s, r = cfg.scheduler, cfg.rollout / def f(x: DataConfig)
                if isinstance(node, ast.Assign):
                    pairs = []
                    for target in node.targets:
                        if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple):
                            pairs += list(zip(target.elts, node.value.elts))
                        else:
                            pairs.append((target, node.value))
                    for target, value in pairs:
                        name = _last_name(value)
                        name = aliases.get(name, name) if isinstance(value, ast.Name) else name
                        if isinstance(target, (ast.Name, ast.Attribute)) and name:
                            aliases.setdefault(_last_name(target), name)
                elif isinstance(node, ast.arg) and node.annotation is not None:
                    ann = ast.unparse(node.annotation)
                    for cls_name, section in class_sections.items():
                        if re.search(rf"\b{cls_name}\b", ann):
                            aliases[node.arg] = section
                elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.args.args:
                    # `def f(cfg): """... for a `SpeculativeConfig` ..."""`: the docstring types the first argument
                    doc, first = ast.get_docstring(node) or "", node.args.args[0].arg
                    for cls_name, section in class_sections.items():
                        if first != "self" and f"`{cls_name}`" in doc:
                            aliases.setdefault(first, section)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
                receiver = _last_name(node.value)
                if receiver is not None:
                    self.by_attr.setdefault(node.attr, set()).update({receiver, aliases.get(receiver, receiver)})


def scan(class_sections: dict[str, str]) -> Reads:
    reads = Reads()
    for top in SCANNED_DIRS:
        for path in sorted((REPO / top).rglob("*.py")):
            tree = ast.parse(path.read_text(), str(path))
            if path.relative_to(REPO).as_posix() in CONFIG_MODULES:
                # The schema classes validate their own fields, which is no use; the loader functions beside
                # them count (load_sim_config consumes sim:run_config and sim:run_overrides).
                tree.body = [node for node in tree.body if not isinstance(node, ast.ClassDef)]
            reads.add_file(tree, class_sections)
    return reads


def unread_keys(roots: dict[str, type], reads: Reads | None = None) -> list[str]:
    """Keys of the given root schemas (prefix -> class) that no scanned file reads. A leaf name that only one
    key has counts when read from any config-like receiver (`cfg.min_confidence`); a name several keys share
    (`seed`, `num_layers`) only when the receiver names the section (`tiny.seed`, `data_cfg.seed`)."""
    keys = [(key, key.removeprefix(prefix).split(".")) for prefix, root in roots.items()
            for key, _cls in config_keys(root, prefix)]
    class_sections = {cls.__name__: key.removeprefix(prefix).split(".")[-2]
                      for prefix, root in roots.items() for key, cls in config_keys(root, prefix)
                      if "." in key.removeprefix(prefix)}
    leaf_count: dict[str, int] = {}
    for _key, parts in keys:
        leaf_count[parts[-1]] = leaf_count.get(parts[-1], 0) + 1
    reads = reads or scan(class_sections)
    missing = []
    for key, parts in keys:
        receivers = reads.by_attr.get(parts[-1], set())
        names = (parts[-2],) if len(parts) > 1 else ROOT_NAMES
        if leaf_count[parts[-1]] == 1:
            names += GENERIC_RECEIVERS
        if not any(n in r.lower() for r in receivers for n in names):
            missing.append(key)
    return missing


ROOTS = {"": RunConfig, "sim:": SimConfig}


def test_every_config_key_is_read_outside_the_config_modules():
    missing = [key for key in unread_keys(ROOTS) if key not in SLURM_ONLY]
    assert not missing, (
        f"config keys read by no code outside the config modules: {missing}; honour them, remove them, or "
        "add them to SLURM_ONLY with the reason")


def test_slurm_only_keys_appear_in_the_slurm_scripts():
    scripts = "\n".join(p.read_text() for p in (REPO / "slurm").glob("*.sh"))
    for key, reason in SLURM_ONLY.items():
        assert reason and key in scripts, key


def test_scanner_finds_an_unread_key_and_honours_aliases(tmp_path):
    """The scanner itself: a key read nowhere is reported, reads through an alias or an annotated
    parameter count, and a same-named attribute of another section does not."""

    @dataclass
    class PartConfig:
        alpha: int = 0
        beta: int = 0
        gamma: int = 0
        seed: int = 0

    @dataclass
    class OtherConfig:
        seed: int = 0

    @dataclass
    class Root:
        part: PartConfig = field(default_factory=PartConfig)
        other: OtherConfig = field(default_factory=OtherConfig)

    code = (
        "def f(cfg):\n    p = cfg.part\n    return p.alpha\n"
        "def g(x: PartConfig):\n    return x.beta\n"
        "def h(cfg):\n    return cfg.other.seed\n"
    )
    reads = Reads()
    reads.add_file(ast.parse(code), {"PartConfig": "part", "OtherConfig": "other"})
    assert unread_keys({"": Root}, reads) == ["part.gamma", "part.seed"]
