"""GPU layout of a run: which node and GPU each trainer rank and each rollout engine gets.

    python -m megatron_sortedrl layout configs/qwen32b_128gpu.yaml      # prints the plan, starts nothing

The trainer takes TP x PP x DP GPUs from the first nodes, ranks in Megatron's order (TP fastest, then
DP, then PP), so a TP group always sits inside one node. An MoE trainer with expert parallelism also shows
its expert groups: Megatron carves EP x expert-TP out of each stage's TP x DP ranks (expert TP fastest,
then EP, then expert DP), so every rank also has an `ep=` and `etp=` coordinate, and the EP groups (the
ranks that exchange tokens by all-to-all in every MoE layer) are listed with the nodes they span. Rollout engines take the GPUs after the trainer,
for both layouts of elastic parallelism: the short-round layout (`rollout.num_workers` engines at
`rollout.tensor_parallel_size`) and the long-round layout (the same GPUs regrouped at
`rollout.long_round_tensor_parallel_size`). An engine never spans two nodes.

`check_layout` raises a `ConfigError` naming the key to change when the arithmetic does not work out;
`RunConfig` calls it for every config that declares GPUs (`cluster.gpus_per_node > 0`). On a running
Ray cluster `megatron_sortedrl.placement` pins trainer TP groups and engines to the nodes named here
(`layout_node`, `rollout_first_gpu`) and checks where they landed.

With `cluster.colocate` the engines take the trainer's own GPUs from GPU 0 (`rollout_first_gpu` is 0; the
blocks they share are checked by `colocate/placement.check_colocated`).

Left out: heterogeneous nodes, multi-node TP (neither Megatron's nor vLLM's TP should cross nodes).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_sortedrl.errors import ConfigError


@dataclass
class Placement:
    """One trainer rank or rollout engine: the node and the GPUs on it it owns."""

    role: str  # "trainer", "rollout-short" or "rollout-long"
    index: int  # trainer rank, or engine index within its layout
    node: int
    gpus: list[int]
    detail: str = ""  # "tp=0 pp=0 dp=0" for trainer ranks, "tp=2" for engines


@dataclass
class LayoutPlan:
    num_nodes: int
    gpus_per_node: int
    trainer: list[Placement] = field(default_factory=list)
    rollout_short: list[Placement] = field(default_factory=list)
    rollout_long: list[Placement] = field(default_factory=list)
    expert_groups: list[list[int]] = field(default_factory=list)  # trainer ranks of each EP group (EP > 1)

    @property
    def total_gpus(self) -> int:
        return self.num_nodes * self.gpus_per_node

    def format(self) -> str:
        lines = [f"{self.num_nodes} nodes x {self.gpus_per_node} GPUs = {self.total_gpus} GPUs"]
        for title, group in (("trainer", self.trainer), ("rollout, short rounds", self.rollout_short),
                             ("rollout, long rounds", self.rollout_long)):
            gpus = sum(len(p.gpus) for p in group)
            nodes = sorted({p.node for p in group})
            lines.append(f"{title}: {len(group)} {'ranks' if title == 'trainer' else 'engines'}, {gpus} GPUs "
                         f"on nodes {_ranges(nodes)}")
            for node in nodes:
                here = [p for p in group if p.node == node]
                cells = " ".join(f"{p.index}[{p.detail}]@{_ranges(p.gpus)}" for p in here)
                lines.append(f"  node {node}: {cells}")
            if title == "trainer" and self.expert_groups:
                nodes_of = {p.index: p.node for p in self.trainer}
                groups = " ".join(f"[{','.join(map(str, g))}]@nodes {_ranges(sorted({nodes_of[r] for r in g}))}"
                                  for g in self.expert_groups)
                lines.append(f"  expert-parallel groups (EP {len(self.expert_groups[0])}): {groups}")
        return "\n".join(lines)


def _ranges(values: list[int]) -> str:
    if not values:
        return "-"
    return f"{values[0]}-{values[-1]}" if len(values) > 1 and values[-1] - values[0] == len(values) - 1 else \
        ",".join(map(str, values))


def plan_layout(cfg) -> LayoutPlan:
    """The placement of `cfg` (a RunConfig) on `cluster.num_nodes x cluster.gpus_per_node` GPUs."""
    check_layout(cfg)
    c, p, r = cfg.cluster, cfg.parallel, cfg.rollout
    plan = LayoutPlan(c.num_nodes, c.gpus_per_node)
    tp, pp, dp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.data_parallel_size
    ep, etp = p.expert_model_parallel_size, p.expert_tensor_parallel_size or tp
    groups: dict[tuple[int, int, int], list[int]] = {}
    for rank in range(tp * pp * dp):
        node, gpu = divmod(rank, c.gpus_per_node)
        detail = f"tp={rank % tp} dp={(rank // tp) % dp} pp={rank // (tp * dp)}"
        if ep > 1:
            local = rank % (tp * dp)  # Megatron's expert order inside a stage: expert TP, EP, expert DP
            detail += f" ep={(local // etp) % ep} etp={local % etp}"
            key = (rank // (tp * dp), local // (etp * ep), local % etp)  # (stage, expert DP rank, expert TP rank)
            groups.setdefault(key, []).append(rank)
        plan.trainer.append(Placement("trainer", rank, node, [gpu], detail))
    plan.expert_groups = list(groups.values())
    first = rollout_first_gpu(cfg)
    rollout_gpus = r.num_workers * r.tensor_parallel_size
    for role, engine_tp, out in (("rollout-short", r.tensor_parallel_size, plan.rollout_short),
                                 ("rollout-long", r.long_round_tensor_parallel_size, plan.rollout_long)):
        for engine in range(rollout_gpus // engine_tp):
            start = first + engine * engine_tp
            node, gpu = divmod(start, c.gpus_per_node)
            out.append(Placement(role, engine, node, list(range(gpu, gpu + engine_tp)), f"tp={engine_tp}"))
    return plan


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def layout_node(gpu: int, gpus_per_node: int) -> int:
    """The layout's node index of global GPU number `gpu` (GPUs are numbered node by node)."""
    return gpu // gpus_per_node


def rollout_first_gpu(cfg) -> int:
    """First GPU of the rollout pool: after the trainer, aligned to the largest engine TP so no engine
    straddles a node boundary (gpus_per_node is a multiple of every TP, checked below)."""
    r = cfg.rollout
    if cfg.cluster.colocate:  # the engines share the trainer's GPUs
        return 0
    return _round_up(cfg.parallel.world_size, max(r.tensor_parallel_size, r.long_round_tensor_parallel_size))


def check_layout(cfg) -> None:
    """Raises ConfigError when the trainer and rollout layouts do not fit the declared cluster."""
    c, p, r = cfg.cluster, cfg.parallel, cfg.rollout
    ep, etp = p.expert_model_parallel_size, p.expert_tensor_parallel_size or p.tensor_model_parallel_size
    ranks = p.tensor_model_parallel_size * p.data_parallel_size
    if ranks % (ep * etp):
        fits = [e for e in range(1, ranks + 1) if ranks % (e * etp) == 0]
        raise ConfigError("parallel.expert_model_parallel_size", ep,
                          f"such that EP x expert TP ({ep} x {etp}) divides TP x DP ({p.tensor_model_parallel_size} x "
                          f"{p.data_parallel_size}): Megatron carves the expert groups out of each stage's TP x DP ranks"
                          + (f" (with this expert TP: {', '.join(map(str, fits))})" if fits else
                             f"; no EP does with expert TP {etp}: lower parallel.expert_tensor_parallel_size"))
    if c.gpus_per_node == 0:
        return
    for key, tp in (("parallel.tensor_model_parallel_size", p.tensor_model_parallel_size),
                    ("rollout.tensor_parallel_size", r.tensor_parallel_size),
                    ("rollout.long_round_tensor_parallel_size", r.long_round_tensor_parallel_size)):
        if c.gpus_per_node % tp:
            raise ConfigError(key, tp, f"a divisor of cluster.gpus_per_node ({c.gpus_per_node}) so a TP group stays in one node")
    rollout_gpus = r.num_workers * r.tensor_parallel_size
    if rollout_gpus % r.long_round_tensor_parallel_size:
        raise ConfigError(
            "rollout.long_round_tensor_parallel_size", r.long_round_tensor_parallel_size,
            f"a divisor of the rollout GPUs (num_workers x tensor_parallel_size = {rollout_gpus}) so both layouts use the same GPUs",
        )
    total = c.num_nodes * c.gpus_per_node
    needed = rollout_first_gpu(cfg) + rollout_gpus
    if needed > total:
        raise ConfigError(
            "cluster.num_nodes", c.num_nodes,
            f"at least {-(-needed // c.gpus_per_node)}: enough nodes for trainer (TPxPPxDP = {p.world_size} GPUs) plus "
            f"rollout ({r.num_workers} engines x TP {r.tensor_parallel_size} = {rollout_gpus} GPUs): {needed} GPUs, "
            f"have {c.num_nodes} x {c.gpus_per_node} = {total}",
        )
