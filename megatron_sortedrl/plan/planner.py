"""The launch plan of a run config: memory per GPU, per engine and per node, and whether each fits.

    python -m megatron_sortedrl plan configs/qwen32b_128gpu.yaml --model-config configs/model_shapes/qwen2.5-32b
    from megatron_sortedrl.plan.planner import make_plan, check_plan
    plan = make_plan(cfg)            # a Plan: trainer stages, engine layouts, weight sync, host per node, checks
    check_plan(cfg)                  # what `train` runs at config load: resolves recompute auto, refuses a misfit

Every memory is compared with a capacity less `plan.margin`: a trainer GPU (`cluster.gpu_memory_gib`), an
engine rank (its vLLM budget must hold one full-length sequence of KV cache) and a node's host memory
(`cluster.host_memory_gib`, 0: this machine's RAM). On a CPU run (`cluster.device` cpu, or auto without
CUDA) there is no GPU: trainer ranks, engines and their KV caches are all host memory of the one node.

`parallel.recompute.granularity=auto` resolves to the least recompute that fits: none, then selective,
then full with method block and a growing number of recomputed layers per stage (block with every layer of
a stage is as lean as uniform), so compute is only spent where memory needs it.

Written here rather than taken from a library: no maintained package plans memory for Megatron-core
trainers next to vLLM engines; the formulas are spelled out by `plan --explain`.

Mixture-of-Experts models (an `Arch` with experts): the trainer adds experts per EP rank and ETP slice, the
router, token-dispatch buffers and expert activations (`moe_memory.py`), engines hold the total parameters;
an expert layout megatron-core cannot build (EP not dividing the experts, EP x ETP not dividing TP x DP, TP > 1
without sequence parallelism) is refused in one line before any arithmetic (`check_moe_layout`).

Colocated runs (`cluster.colocate` on GPU): the trainer check becomes one check per phase (rollout, weight
handoff, update) of a GPU that holds a trainer rank and an engine rank, and host memory adds the offloaded state
(`colocated.py`).

Left out: heterogeneous nodes, the trainer's temporary buffers outside the items listed (NCCL workspaces,
allocator fragmentation: that is what the margin is for), and checkpoint saves.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace

from megatron_sortedrl.errors import UserError
from megatron_sortedrl.plan.arch import Arch
from megatron_sortedrl.plan.engine import (BUCKET_BYTES, BUCKETS_IN_FLIGHT, DTYPE_BYTES, GIB, engine_memory,
                                          full_sequence_tokens, weight_sync_estimate)

PROCESS_GIB = {"gpu": 2.0, "cpu": 1.0}  # plan.process_host_gib = 0: one process's host memory


@dataclass
class Check:
    """One capacity check: `need` bytes of `capacity`, usable `capacity x (1 - margin)`."""

    what: str  # "trainer stage 0 per GPU"
    need: float
    capacity: float
    usable: float
    cause: str  # the largest contributor with the knob that sets it, "activations 99.1 GiB at ..."
    fix: str  # "set parallel.recompute.granularity=full or lower trainer.micro_batch_tokens"

    @property
    def fits(self) -> bool:
        return self.need <= self.usable

    def line(self) -> str:
        return (f"plan: {self.what} needs {self.need / GIB:.1f} GiB ({self.cause}) > {self.usable / GIB:.1f} GiB usable "
                f"of {self.capacity / GIB:.0f} GiB; {self.fix}")


@dataclass
class Plan:
    name: str
    arch: Arch
    device: str  # gpu | cpu
    recompute: dict  # the resolved parallel.recompute
    trainer: list[dict] = field(default_factory=list)  # per pipeline stage: items (bytes), total
    engines: dict = field(default_factory=dict)  # "short" / "long" -> engine_memory(...) + count
    sync: dict = field(default_factory=dict)
    host: list[dict] = field(default_factory=list)  # per node: items (bytes), total
    checks: list[Check] = field(default_factory=list)
    explain: list[str] = field(default_factory=list)
    process_gib: float = 0.0  # host memory assumed per process
    colocated: dict = field(default_factory=dict)  # cluster.colocate on GPU: phases per GPU, switch costs (colocated.py)

    @property
    def fits(self) -> bool:
        return all(c.fits for c in self.checks)

    def failures(self) -> list[Check]:
        return [c for c in self.checks if not c.fits]

    def to_dict(self) -> dict:
        return {"name": self.name, "device": self.device, "model": vars(self.arch), "recompute": self.recompute,
                "fits": self.fits, "trainer_stages": self.trainer,
                "engines": {k: {kk: vv for kk, vv in v.items() if kk != "explain"} for k, v in self.engines.items()},
                "weight_sync": {k: v for k, v in self.sync.items() if k != "explain"}, "host_nodes": self.host,
                "checks": [{**vars(c), "fits": c.fits} for c in self.checks], "explain": self.explain,
                **({"colocated": self.colocated} if self.colocated else {})}


# ------------------------------------------------------------------------------------------- inputs


def resolve_device(cfg) -> str:
    if cfg.cluster.device != "auto":
        return cfg.cluster.device
    import torch

    return "gpu" if torch.cuda.is_available() else "cpu"


def arch_of(cfg, model_config: str | None = None) -> Arch:
    """The model's shape: `model_config` (a directory or config.json), else model.path's config.json, else
    the built-in tiny model when the config builds it."""
    from pathlib import Path

    if model_config:
        return Arch.from_path(model_config)
    if (Path(cfg.model.path) / "config.json").is_file():
        return Arch.from_path(cfg.model.path)
    if cfg.model.build_tiny_if_missing:
        from megatron_sortedrl.tiny_model import tiny_config

        return Arch.from_dict(tiny_config(cfg.model.tiny), name="tiny")
    raise UserError(f"plan: model.path {cfg.model.path} has no config.json; set model.path to a Hugging Face model "
                    "directory (the `plan` command alone also takes --model-config, e.g. configs/model_shapes/<name>)")


def host_memory_bytes(cfg) -> float:
    if cfg.cluster.host_memory_gib:
        return cfg.cluster.host_memory_gib * GIB
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))  # this machine's RAM (Linux, macOS)


# ------------------------------------------------------------------------------------------- trainer


def trainer_stages(cfg, arch: Arch, recompute: dict, device: str) -> tuple[list[dict], list[str]]:
    """Per-stage trainer memory per rank (bytes) under `recompute`, and the arithmetic behind it (from
    plan.trainer_memory; the planner adds the frozen reference model's weights when algorithm.kl_coef > 0)."""
    from megatron_sortedrl.plan.trainer_memory import trainer_memory

    p = cfg.parallel
    gpu = device == "gpu"
    result = trainer_memory(
        arch, tp=p.tensor_model_parallel_size, pp=p.pipeline_model_parallel_size, dp=p.data_parallel_size,
        sequence_parallel=p.sequence_parallel, distributed_optimizer=p.use_distributed_optimizer and gpu,
        dtype=cfg.model.dtype, micro_batch_tokens=cfg.trainer.micro_batch_tokens,
        longest_sequence=full_sequence_tokens(cfg), recompute=recompute["granularity"],
        recompute_method=recompute["method"], recompute_num_layers=recompute["num_layers"],
        spec="te" if gpu else "local", ep=p.expert_model_parallel_size, etp=p.expert_tensor_parallel_size)
    stages = []
    for st in result.stages:
        items = {k: float(st.items[k]) for k in st.TOTAL_KEYS if k in st.items}
        if cfg.algorithm.kl_coef > 0:  # the reference model: a frozen copy of the weights, no grads or optimizer
            items["reference weights"] = float(st.items["weights"])
        if "moe_dispatch" in st.items:
            items["moe_dispatch"] = float(st.items["moe_dispatch"])
        stages.append({"stage": st.stage, "items": items, "total": sum(items.values()),
                       "activations_longest": float(st.items["activations_longest"]),
                       "activations_micro_batch": float(st.items["activations_microbatch"]),
                       "optimizer_other": float(st.items["optimizer_other"])})
    explain = list(result.explain)
    if cfg.algorithm.kl_coef > 0:
        explain.append("reference model (algorithm.kl_coef > 0): + one more copy of each stage's weights")
    return stages, explain


def check_moe_layout(cfg, arch: Arch) -> None:
    """Refuses, in one line, an expert layout megatron-core cannot build (before any arithmetic)."""
    from megatron_sortedrl.plan.moe_memory import check_expert_layout

    p = cfg.parallel
    ep, etp = p.expert_model_parallel_size, p.expert_tensor_parallel_size or p.tensor_model_parallel_size
    if not arch.is_moe:
        if ep > 1 or p.expert_tensor_parallel_size > 1:
            raise UserError(f"plan: parallel.expert_model_parallel_size={ep} / expert_tensor_parallel_size="
                            f"{p.expert_tensor_parallel_size} set for {arch.name}, a dense model; set both to 1 (0 for ETP)")
        return
    try:
        check_expert_layout(arch, tp=p.tensor_model_parallel_size, dp=p.data_parallel_size, ep=ep, etp=etp)
    except ValueError as exc:
        raise UserError(f"plan: {arch.name}: {exc}; set parallel.expert_model_parallel_size / "
                        "expert_tensor_parallel_size to divisors that fit") from None
    if p.tensor_model_parallel_size > 1 and not p.sequence_parallel:
        raise UserError(f"plan: {arch.name} is an MoE model at TP={p.tensor_model_parallel_size}: megatron-core trains "
                        "MoE with TP > 1 only with sequence parallelism; set parallel.sequence_parallel=true")


def _trainer_check(cfg, stage: dict, capacity: float, per: str, recompute: dict, moe: bool = False) -> Check:
    items = stage["items"]
    act = items.get("activations", 0.0)
    r = recompute
    rc = f"parallel.recompute.granularity={r['granularity']}" + (
        f" method={r['method']} num_layers={r['num_layers']}" if r["granularity"] == "full" else "")
    cause = f"activations {act / GIB:.1f} GiB at trainer.micro_batch_tokens={cfg.trainer.micro_batch_tokens}, {rc}"
    if r["granularity"] == "full" and r["method"] == "uniform" and r["num_layers"] == 1:
        fix = ("lower trainer.micro_batch_tokens or raise parallel.tensor_model_parallel_size / "
               "pipeline_model_parallel_size")
    else:
        fix = "set parallel.recompute.granularity=full (or auto) or lower trainer.micro_batch_tokens"
    if act < 0.5 * stage["total"]:  # weights and optimizer dominate: more model parallelism is the knob
        big = max(items, key=items.get)
        cause = f"{big} {items[big] / GIB:.1f} GiB with TP={cfg.parallel.tensor_model_parallel_size} " \
                f"PP={cfg.parallel.pipeline_model_parallel_size} DP={cfg.parallel.data_parallel_size}"
        fix = ("raise parallel.tensor_model_parallel_size or pipeline_model_parallel_size"
               + (" (or data_parallel_size, which divides the distributed optimizer's state)"
                  if cfg.parallel.use_distributed_optimizer else ", or set parallel.use_distributed_optimizer=true"))
        if moe:
            p = cfg.parallel
            ep, etp = p.expert_model_parallel_size, p.expert_tensor_parallel_size or p.tensor_model_parallel_size
            cause += f" EP={ep} ETP={etp}"
            room = p.tensor_model_parallel_size * p.data_parallel_size // etp  # the largest EP that TP x DP allows
            fix = (f"raise parallel.expert_model_parallel_size (fewer experts per GPU; up to {room} here)" if ep < room
                   else "raise pipeline_model_parallel_size or data_parallel_size (Adam's expert state is already "
                        "spread over every trainer GPU of a stage) or use GPUs with more memory")
            if not p.use_distributed_optimizer:
                fix += ", or set parallel.use_distributed_optimizer=true"
    return Check(f"trainer stage {stage['stage']} {per}", stage["total"], capacity, capacity * (1 - cfg.plan.margin),
                 cause, fix)


# ------------------------------------------------------------------------------------------- host


def _process_gib(cfg, device: str) -> float:
    return cfg.plan.process_host_gib or PROCESS_GIB[device]


def driver_items(cfg, arch: Arch, device: str) -> dict:
    """Node 0's host memory outside trainer ranks and engines: driver, reward workers, Ray, kept weights."""
    proc = _process_gib(cfg, device) * GIB
    return {"driver and reward processes": (1 + cfg.data.reward_workers) * proc,
            "Ray (raylet; GCS on node 0)": proc,
            "kept weight buckets (object store, for relayout)": arch.num_params * DTYPE_BYTES[cfg.model.dtype]}


def host_nodes(cfg, arch: Arch, device: str, trainer: list[dict], engines: dict, sync: dict) -> list[dict]:
    """Host memory per node (bytes by item). GPU run: processes, pinned sync buckets, kept weights in Ray's
    object store; CPU run: also every trainer rank's and engine's memory, all on the one node."""
    proc = _process_gib(cfg, device) * GIB
    p = cfg.parallel
    buckets = min(BUCKETS_IN_FLIGHT * BUCKET_BYTES, max(sync["stage_bytes"]))  # a small model is one bucket
    driver = driver_items(cfg, arch, device)
    if device == "cpu":
        ranks_per_stage = p.tensor_model_parallel_size * p.data_parallel_size
        items = dict(driver)
        items["trainer ranks"] = sum(ranks_per_stage * (proc + st["total"]) for st in trainer)
        # Each engine: its actor process plus one worker per TP rank holding weights / TP and its KV cache;
        # the layout that needs more (short or long rounds) counts.
        items["rollout engines"] = max(e["count"] * (proc + e["tp"] * (proc + e["weights"] + e["kv_bytes"]))
                                       for e in engines.values())
        items["weight-sync buckets in flight"] = sync["senders"] * buckets
        return [{"node": 0, "items": items, "total": sum(items.values())}]
    if cfg.cluster.gpus_per_node == 0:  # a GPU run that declares no cluster: everything on this one node
        items = dict(driver)
        items["trainer ranks"] = p.world_size * proc
        items["pinned weight-sync buckets"] = sync["senders"] * buckets
        items["engine processes"] = max(e["count"] * (1 + e["tp"]) for e in engines.values()) * proc
        return [{"node": 0, "items": items, "total": sum(items.values())}]
    from megatron_sortedrl.layout import plan_layout

    layout = plan_layout(cfg)
    nodes = []
    for node in range(cfg.cluster.num_nodes):
        ranks = [t for t in layout.trainer if t.node == node]
        senders = [t for t in ranks if t.detail.startswith("tp=0 dp=0")]
        engine_procs = max(sum(1 + len(e.gpus) for e in group if e.node == node)
                           for group in (layout.rollout_short, layout.rollout_long))
        items = dict(driver) if node == 0 else {"Ray (raylet; GCS on node 0)": proc}
        items["trainer ranks"] = len(ranks) * proc
        items["pinned weight-sync buckets"] = len(senders) * buckets
        items["engine processes"] = engine_procs * proc
        nodes.append({"node": node, "items": items, "total": sum(items.values())})
    return nodes


# ------------------------------------------------------------------------------------------- the plan


def make_plan(cfg, arch: Arch | None = None, recompute: dict | None = None) -> Plan:
    """The plan of `cfg` with `recompute` (default: the config's, `auto` resolved)."""
    arch = arch or arch_of(cfg)
    check_moe_layout(cfg, arch)
    device = resolve_device(cfg)
    if recompute is None:
        rc = cfg.parallel.recompute
        recompute = {"granularity": rc.granularity, "method": rc.method, "num_layers": rc.num_layers}
        if rc.granularity == "auto":
            recompute = resolve_recompute(cfg, arch)
    plan = Plan(cfg.name, arch, device, recompute)
    margin = cfg.plan.margin
    plan.explain.append(f"model {arch.name}: {arch.num_params:,} params, {arch.num_layers} layers, hidden "
                        f"{arch.hidden_size}, {arch.num_heads} heads / {arch.num_kv_heads} kv heads x {arch.head_dim}, "
                        f"vocab {arch.vocab_size}; dtype {cfg.model.dtype}; device {device}; margin {margin:.0%}")
    if arch.is_moe:
        plan.explain.append(
            f"MoE: {arch.active_params:,} active params per token ({arch.num_experts} experts, top-"
            f"{arch.experts_per_token}, in {len(arch.moe_layers)} of {arch.num_layers} layers); engines hold all "
            f"{arch.num_params:,} (memory follows total parameters, decode cost active ones)")
    plan.trainer, lines = trainer_stages(cfg, arch, recompute, device)
    plan.explain += lines
    r = cfg.rollout
    rollout_gpus = r.num_workers * r.tensor_parallel_size
    for key, tp in (("short", r.tensor_parallel_size), ("long", r.long_round_tensor_parallel_size)):
        em = engine_memory(cfg, arch, tp, device)
        em["count"] = r.num_workers if key == "short" else rollout_gpus // tp
        plan.engines[key] = em
        plan.explain += [f"{key}-round layout: {em['count']} engines x TP={tp}", *em["explain"]]
    plan.sync = weight_sync_estimate(cfg, arch, device)
    plan.explain += plan.sync["explain"]
    plan.process_gib = _process_gib(cfg, device)
    if cfg.cluster.colocate and device == "gpu":  # phases per GPU, offloaded state per node (colocated.py)
        from megatron_sortedrl.plan.colocated import colocated_host_nodes, colocated_phases

        plan.colocated = colocated_phases(cfg, arch, device, plan.trainer, plan.engines)
        plan.host = colocated_host_nodes(cfg, plan.colocated, plan.process_gib * GIB, driver_items(cfg, arch, device))
    else:
        plan.host = host_nodes(cfg, arch, device, plan.trainer, plan.engines, plan.sync)
        if cfg.cluster.colocate:  # CPU: the offload is a copy of the trainer's state within host memory
            ranks = cfg.parallel.tensor_model_parallel_size * cfg.parallel.data_parallel_size
            items = plan.host[0]["items"]
            items["offloaded trainer state (a copy)"] = ranks * sum(
                st["items"].get(k, 0.0) for st in plan.trainer for k in ("weights", "gradients", "optimizer"))
            plan.host[0]["total"] = sum(items.values())
    for node in plan.host:
        plan.explain.append(f"host node {node['node']}: " + " + ".join(
            f"{k} {v / GIB:.2f}" for k, v in node["items"].items() if v) + f" = {node['total'] / GIB:.2f} GiB")
    host_cap = host_memory_bytes(cfg)
    plan.explain.append(f"host memory per node: {host_cap / GIB:.1f} GiB ("
                        + ("cluster.host_memory_gib" if cfg.cluster.host_memory_gib else "this machine's RAM")
                        + f"); one process {_process_gib(cfg, device):g} GiB (plan.process_host_gib)")

    if device == "gpu":
        gpu = cfg.cluster.gpu_memory_gib * GIB
        for st in plan.trainer if not plan.colocated else []:  # colocated: the update phase's check counts it
            plan.checks.append(_trainer_check(cfg, st, gpu, "per GPU", recompute, moe=arch.is_moe))
        if plan.colocated:
            from megatron_sortedrl.plan.colocated import colocated_checks

            plan.checks += colocated_checks(cfg, plan.colocated, Check)
        for key, em in plan.engines.items():
            seq = em["full_sequence_tokens"]
            plan.checks.append(Check(
                f"{key}-round engine (TP={em['tp']}) KV cache", seq * em["kv_bytes_per_token"], em["kv_bytes"] + 0.0,
                em["kv_bytes"] + 0.0,
                f"one {seq}-token sequence; weights {em['weights'] / GIB:.1f} GiB of a {em['budget'] / GIB:.1f} GiB budget",
                "raise rollout.gpu_memory_utilization or the engine TP, or lower rollout.max_response_length"))
            if em["budget"] > gpu * (1 - margin) and not cfg.cluster.colocate:
                plan.checks.append(Check(f"{key}-round engine budget", em["budget"], gpu, gpu * (1 - margin),
                                         f"rollout.gpu_memory_utilization={r.gpu_memory_utilization}",
                                         "lower rollout.gpu_memory_utilization"))
    for node in plan.host:
        items = node["items"]
        big = max(items, key=items.get)
        knob = {"rollout engines": "lower rollout.kv_cache_gib or rollout.num_workers",
                "trainer ranks": "lower trainer.micro_batch_tokens or the trainer's world size"}.get(
            big, "set cluster.host_memory_gib to the nodes' memory or plan.check=warn")
        plan.checks.append(Check(f"host memory of node {node['node']}", node["total"], host_cap,
                                 host_cap * (1 - margin), f"{big} {items[big] / GIB:.1f} GiB", knob))
    return plan


def _candidates(cfg, arch: Arch):
    """Recompute settings from least to most recompute."""
    yield {"granularity": "none", "method": "uniform", "num_layers": 1}
    yield {"granularity": "selective", "method": "uniform", "num_layers": 1}
    for k in range(1, arch.num_layers // cfg.parallel.pipeline_model_parallel_size + 1):
        yield {"granularity": "full", "method": "block", "num_layers": k}
    yield {"granularity": "full", "method": "uniform", "num_layers": 1}


def resolve_recompute(cfg, arch: Arch) -> dict:
    """The least recompute whose trainer checks all fit (the leanest, full uniform 1, when none does: the
    plan then fails and names the cause)."""
    last: dict = {}
    for cand in _candidates(cfg, arch):
        last = cand
        plan = make_plan(cfg, arch, cand)
        # On a GPU run only the trainer's GPUs depend on recompute; on a CPU run the trainer is host memory.
        relevant = ("trainer", "host") if plan.device == "cpu" else ("trainer",)
        if all(c.fits for c in plan.checks if c.what.startswith(relevant)):
            return cand
    return last


def check_plan(cfg, arch: Arch | None = None, log=print):
    """What `train` runs at config load, before Ray starts: resolves recompute `auto` into the config (logged)
    and refuses (UserError, one line) a plan that does not fit unless `plan.check` says warn or off."""
    rc = cfg.parallel.recompute
    if cfg.plan.check == "skip":
        if rc.granularity == "auto":
            log("plan: plan.check=skip, so parallel.recompute.granularity=auto means none")
            cfg.parallel.recompute = replace(rc, granularity="none")
        return None
    plan = make_plan(cfg, arch)
    if rc.granularity == "auto":
        r = plan.recompute
        cfg.parallel.recompute = replace(rc, **r)
        log(f"plan: parallel.recompute.granularity=auto -> {r['granularity']}"
            + (f" (method {r['method']}, num_layers {r['num_layers']})" if r["granularity"] == "full" else "")
            + (", the least recompute that fits" if plan.fits else ", the leanest (the plan does not fit)"))
    bad = plan.failures()
    if bad:
        if cfg.plan.check == "error":
            raise UserError(bad[0].line() + " (or plan.check=warn to start anyway)")
        for c in bad:
            log(c.line() + " (plan.check=warn: starting anyway)")
    return plan


def fake_env_for_planning(names: list[str]) -> dict[str, str]:
    """Placeholder values for environment variables a recipe reads but this machine does not set (`plan`
    only: the shapes come from --model-config, and no path is opened)."""
    return {n: f"/unset/{n}" for n in names if n not in os.environ}
