"""`python -m megatron_sortedrl plan <recipe> [key=value ...]`: the memory plan of a run, before launching it.

    python -m megatron_sortedrl plan configs/qwen32b_128gpu.yaml --model-config configs/model_shapes/qwen2.5-32b-instruct
    python -m megatron_sortedrl plan configs/tiny_cpu.yaml --explain          # with the arithmetic
    python -m megatron_sortedrl plan configs/qwen7b_16gpu.yaml --model-config ... --json plan.json

Reads the model's config.json only (no weights): `--model-config DIR_OR_FILE`, else model.path. A recipe's
`${oc.env:...}` paths that this machine does not set are given placeholders for planning (nothing is
opened). Prints trainer memory per GPU and pipeline stage, engine memory and KV-cache capacity at both
rollout layouts, weight-sync bytes and time, for a colocated run (`cluster.colocate`) memory per GPU in each
phase (rollout, switch, update) and the switch seconds, and host memory per node, each against its capacity less
`plan.margin` (docs/scaling.md). Exit status: 0 when everything fits, 1 when something does not (the
lines say what and which key to turn), 2 on bad input. `train` runs the same check at start.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import sys
from pathlib import Path

from megatron_sortedrl.cli import add_config_arguments, config_from_args
from megatron_sortedrl.errors import UserError

GIB = 2**30


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    parser.add_argument("--model-config", default=None, metavar="DIR_OR_FILE",
                        help="the model's Hugging Face config.json or its directory (default: model.path); shapes of "
                             "the shipped recipes' models are in configs/model_shapes/")
    parser.add_argument("--explain", action="store_true", help="also print the arithmetic behind every figure")
    parser.add_argument("--json", default=None, metavar="PATH", help="write the plan as JSON to PATH ('-': stdout)")


def _missing_env(path: str | None) -> list[str]:
    if not path or not Path(path).is_file():
        return []
    names = re.findall(r"\$\{oc\.env:([A-Za-z_][A-Za-z0-9_]*)\}", Path(path).read_text())
    return sorted({n for n in names if n not in os.environ})


def load_for_planning(args: argparse.Namespace):
    """The config with placeholders for unset environment variables (planning reads no paths)."""
    from megatron_sortedrl.plan.planner import fake_env_for_planning

    path = args.config if args.config and not ("=" in args.config and not args.config.endswith((".yaml", ".yml"))) else None
    fake = fake_env_for_planning(_missing_env(path))
    os.environ.update(fake)
    try:
        cfg = config_from_args(args)
    finally:
        for name in fake:
            os.environ.pop(name, None)
    return cfg, sorted(fake)


def _gib(x: float) -> str:
    g = x / GIB
    return f"{g:,.2f}" if g >= 0.1 or g == 0 else f"{g:.4f}"


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def _ranges(nodes: list[int]) -> str:
    """1,2,3,5 -> "1-3,5"."""
    runs: list[list[int]] = []
    for n in nodes:
        if runs and n == runs[-1][-1] + 1:
            runs[-1].append(n)
        else:
            runs.append([n])
    return ",".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)


def render(plan, cfg, explain: bool = False) -> str:
    from rich import box
    from rich.console import Console
    from rich.table import Table

    console = Console(file=io.StringIO(), width=160, record=True, color_system=None)
    def print_(item) -> None:
        console.print(item, soft_wrap=isinstance(item, str), markup=False, highlight=False)
    r = plan.recompute
    rc = r["granularity"] + (f" (method {r['method']}, num_layers {r['num_layers']})" if r["granularity"] == "full" else "")
    auto = " (auto)" if cfg.parallel.recompute.granularity == "auto" else ""
    a = plan.arch
    active = f", {_count(a.active_params)} active" if a.is_moe else ""
    print_(f"plan of {cfg.name}: model {a.name} ({_count(a.num_params)} params{active}, {cfg.model.dtype}), device {plan.device}, "
           f"recompute {rc}{auto}, margin {cfg.plan.margin:.0%}")
    p = cfg.parallel
    mem = "GPU" if plan.device == "gpu" else "rank (host memory)"
    print_(f"trainer per {mem}, GiB: TP={p.tensor_model_parallel_size} PP={p.pipeline_model_parallel_size} "
           f"DP={p.data_parallel_size}" + (f" EP={p.expert_model_parallel_size} ETP="
                                           f"{p.expert_tensor_parallel_size or p.tensor_model_parallel_size}" if a.is_moe else "")
           + f", micro_batch_tokens={cfg.trainer.micro_batch_tokens}, longest sequence "
           f"{plan.engines['short']['full_sequence_tokens']} tokens")
    t = Table(box=box.SIMPLE_HEAD)
    t.add_column("item")
    for st in plan.trainer:
        t.add_column(f"stage {st['stage']}", justify="right")
    for item in plan.trainer[0]["items"]:
        t.add_row(item.replace("_", " "), *[_gib(st["items"].get(item, 0.0)) for st in plan.trainer])
    for key, label in (("activations_longest", "  one micro-batch: longest sequence alone"),
                       ("activations_micro_batch", "  one micro-batch: full micro_batch_tokens")):
        if all(key in st for st in plan.trainer):
            t.add_row(label, *[_gib(st[key]) for st in plan.trainer])
    other = "plain" if p.use_distributed_optimizer and plan.device == "gpu" else "distributed"
    t.add_row(f"  optimizer if {other} (not in total)", *[_gib(st["optimizer_other"]) for st in plan.trainer])
    t.add_row("total", *[_gib(st["total"]) for st in plan.trainer])
    trainer_checks = [c for c in plan.checks if c.what.startswith("trainer")]
    if trainer_checks:
        t.add_row("usable", *[_gib(c.usable) for c in trainer_checks])
        t.add_row("fits", *["yes" if c.fits else "NO" for c in trainer_checks])
    print_(t)

    print_("rollout engines, per engine rank (GiB unless said)")
    e = Table(box=box.SIMPLE_HEAD)
    e.add_column("layout")
    for col in ("engines x TP", "budget", "weights", "reserve", "KV cache", "KV B/token",
                "KV tokens", "full seqs", "max_num_seqs", "fits"):
        e.add_column(col, justify="right")
    for key, em in plan.engines.items():
        fits = "-" if plan.device == "cpu" else ("yes" if all(
            c.fits for c in plan.checks if c.what.startswith(f"{key}-round engine")) else "NO")
        e.add_row(f"{key} rounds", f"{em['count']} x {em['tp']}", _gib(em["budget"]), _gib(em["weights"]),
                  _gib(em["reserve"]), _gib(em["kv_bytes"]), f"{em['kv_bytes_per_token']:,}", f"{em['kv_tokens']:,}",
                  f"{em['full_sequences']:,}", str(em["max_num_seqs"]), fits)
    print_(e)

    s = plan.sync
    print_(f"weight sync: {s['bytes'] / GIB:,.2f} GiB per sync from {s['senders']} sender(s) (one per pipeline stage), "
           f"about {s['seconds']:.2f} s at {s['bandwidth_gbs']:g} GB/s per link (every engine GPU receives the whole "
           "model; plan.sync_bandwidth_gbs)")

    if plan.colocated:
        for item in _phase_table(plan, cfg):
            print_(item)

    groups: dict[tuple, list[int]] = {}
    for n in plan.host:
        groups.setdefault(tuple(sorted((k, round(v)) for k, v in n["items"].items())), []).append(n["node"])
    print_(f"host memory per node, GiB (one process {plan.process_gib:g} GiB, plan.process_host_gib)")
    h = Table(box=box.SIMPLE_HEAD)
    h.add_column("item")
    for nodes in groups.values():
        h.add_column(f"node {_ranges(nodes)}", justify="right")
    items = list(dict.fromkeys(k for n in plan.host for k in n["items"]))
    firsts = [plan.host[nodes[0]] for nodes in groups.values()]
    for item in items:
        h.add_row(item, *[_gib(n["items"][item]) if item in n["items"] else "-" for n in firsts])
    h.add_row("total", *[_gib(n["total"]) for n in firsts])
    host_checks = {c.what: c for c in plan.checks if c.what.startswith("host")}
    checks = [host_checks[f"host memory of node {n['node']}"] for n in firsts]
    h.add_row("usable", *[_gib(c.usable) for c in checks])
    h.add_row("fits", *["yes" if c.fits else "NO" for c in checks])
    print_(h)

    if explain:
        print_("arithmetic:")
        for line in plan.explain:
            print_(f"  {line}")
    if plan.fits:
        print_("fits: every trainer GPU, engine and node is within its capacity less the margin")
    else:
        for c in plan.failures():
            print_(c.line())
    return "".join(line.rstrip() + "\n" for line in console.export_text().splitlines())


def _phase_table(plan, cfg):
    """Colocated: per GPU and phase (rollout, weight-handoff switch, update), then the switch costs."""
    from rich import box
    from rich.table import Table

    col = plan.colocated
    c = cfg.cluster
    head = (f"colocated phases per GPU, GiB (engine TP={col['engine_tp']} awake, cluster.engine_sleep_level="
            f"{col['sleep_level']}, trainer {'offloaded' if col['offload_trainer'] else 'resident'} during rollout: "
            f"cluster.offload_trainer={str(col['offload_trainer']).lower()})")
    t = Table(box=box.SIMPLE_HEAD)
    t.add_column("item")
    multi = len(col["stages"]) > 1
    for st in col["stages"]:
        for ph in ("rollout", "switch", "update"):
            t.add_column(f"{ph}" + (f" s{st['stage']}" if multi else ""), justify="right")
    items = list(dict.fromkeys(k for st in col["stages"] for ph in st["phases"].values() for k in ph))
    for item in items:
        t.add_row(item, *[_gib(ph[item]) if item in ph else "-" for st in col["stages"] for ph in st["phases"].values()])
    t.add_row("total", *[_gib(st["totals"][ph]) for st in col["stages"] for ph in ("rollout", "switch", "update")])
    usable = c.gpu_memory_gib * (1 - cfg.plan.margin) * GIB
    t.add_row("usable", *[_gib(usable)] * (3 * len(col["stages"])))
    fits = {ch.what: ch.fits for ch in plan.checks}
    t.add_row("fits", *["yes" if fits.get(f"colocated {ph} {'phase' if ph != 'switch' else 'peak'}, stage "
                                      f"{st['stage']} per GPU" + (" (vLLM budget)" if ph == "rollout" else ""), True)
                        else "NO" for st in col["stages"] for ph in ("rollout", "switch", "update")])
    s = col["switch_s"]
    worst = max(col["stages"], key=lambda st: st["state"])
    return [head, t, (
        f"rollout phase leaves room for rollout.gpu_memory_utilization <= {min(x['max_gpu_memory_utilization'] for x in col['stages']):.2f}"
        f" (set {cfg.rollout.gpu_memory_utilization})"), (
        f"switch per step, s: sleep {s['sleep']:.2f}, reload {s['reload']:.2f}, offload {s['offload']:.2f}, wake "
        f"{s['wake']:.2f}, handoff {s['handoff']:.2f}; total {s['total']:.2f} (trainer state "
        f"{worst['state'] / GIB:.2f} GiB per GPU at {col['offload_gbs']:g} GB/s, plan.offload_gbs; model "
        f"{col['handoff_bytes'] / GIB:.2f} GiB per engine GPU over CUDA IPC at {col['handoff_gbs']:g} GB/s, "
        "plan.handoff_gbs)")]


def run(args: argparse.Namespace) -> int:
    from megatron_sortedrl.plan.planner import arch_of, make_plan

    cfg, faked = load_for_planning(args)
    if faked and not args.model_config and not cfg.model.build_tiny_if_missing:
        raise UserError(f"plan: {', '.join(faked)} not set, so model.path has no config.json; pass --model-config "
                        "DIR_OR_FILE (e.g. configs/model_shapes/qwen2.5-32b-instruct)")
    arch = arch_of(cfg, args.model_config)
    cfg.validate_model_shape(arch.num_heads, arch.num_kv_heads, arch.num_layers)
    plan = make_plan(cfg, arch)
    if faked:
        print(f"(planning only: {', '.join(faked)} not set, placeholders used; no path is read)", file=sys.stderr)
    if args.json != "-":
        print(render(plan, cfg, args.explain), end="")
    if args.json:
        text = json.dumps(plan.to_dict(), indent=2)
        if args.json == "-":
            print(text)
        else:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(text + "\n")
    return 0 if plan.fits else 1
