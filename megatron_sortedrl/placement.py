"""Placement on a Ray cluster: trainer TP groups and rollout engines in placement groups that keep every
group on one node, pinned to the layout's nodes, checked where they landed, with a timeout on every wait.

    from megatron_sortedrl import placement as P
    res = P.reserve(P.trainer_bundles(16, 8, gpu=True, cpus_per_rank=1, gpus_per_node=8), "trainer", timeout_s=900)
    actors, nodes = P.start_group(cls, lambda r: (cfg, r, 16), res, group_size=8, what="trainer",
                                  timeout_s=900, num_gpus=1)           # one actor per rank, TP groups checked
    res = P.reserve(P.engine_bundles(32, 2, gpu=True, gpus_per_node=8, first_gpu=64), "rollout engines", 900)
    engine = cls.options(scheduling_strategy=res.strategy(e), num_gpus=2).remote(...)
    P.wait_ready(refs, "rollout engine start", 900, labels=[...]); res.release()

How it keeps groups whole: one bundle per trainer TP group ({GPU: TP} on GPU, {CPU: TP x cpus} on CPU) and
one per engine ({GPU: TP, CPU: 1}). Ray never splits a bundle, so a group cannot straddle nodes whatever
order Ray lays bundles in (with one bundle per GPU and rank = bundle index, PACK may put bundles 0-2 on one
node and 3-5 on the next, splitting the TP group of ranks 2-3). When the cluster is declared
(`cluster.gpus_per_node > 0` on GPU), each bundle also carries a label selector for the Ray node the layout
names: layout node i is the i-th alive GPU node ordered by (address, host name, node id), so trainer and
engines land on their own node sets exactly as `python -m megatron_sortedrl layout <recipe>` prints.
Once ready, bundles are ordered by (node, bundle index) and group g takes the g-th; with Megatron's rank
order (TP fastest, then DP, then PP; `parallel_state` order "tp-cp-ep-dp-pp") the ranks of a node are
consecutive, so DP groups stay inside a node where they fit and pipeline stages are what crosses nodes.
Every trainer actor then reports its node and `check_groups` fails in one line if a TP group is split.

Every wait (placement group ready, actors answering) is bounded by `timeout_s`
(`cluster.startup_timeout_s`); on timeout a `ClusterError` names what was asked, what is missing and
the visible nodes with their free resources.

Tested on an emulated 4-node cluster: `.venv/bin/python -m pytest tests/test_placement_cluster.py -q`.
Hand-written: Ray has no "order bundles by node" or "pin to the n-th node" helper. Left out: heterogeneous
nodes and moving a group once placed. Colocated trainer and engines share bundles of their own
(`megatron_sortedrl/colocate/placement.py`), built from the same `Bundle` and `reserve`.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from megatron_sortedrl.errors import ClusterError
from megatron_sortedrl.layout import layout_node

NODE_LABEL = "ray.io/node-id"  # Ray's built-in per-node label, used to pin a bundle to one node


@dataclass(frozen=True)
class NodeView:
    """One alive Ray node as placement sees it."""

    node_id: str
    address: str
    hostname: str
    cpus: float
    gpus: float

    @property
    def name(self) -> str:
        return f"{self.hostname or self.address}/{self.node_id[:8]}"


@dataclass
class Bundle:
    """One placement-group bundle: a trainer TP group or an engine."""

    resources: dict[str, float]
    label: str  # "TP group 1 (ranks 2-3)", "engine 4": for messages
    node: int | None = None  # layout node index it must land on; None: anywhere


def _sort_key(node: dict) -> tuple:
    addr = node.get("NodeManagerAddress", "")
    try:
        ip = (0, int(ipaddress.ip_address(addr)))
    except ValueError:
        ip = (1, 0)
    return ip, node.get("NodeManagerHostname", ""), node["NodeID"]


def cluster_nodes(gpu_only: bool = False) -> list[NodeView]:
    """Alive nodes in layout order (address, host name, node id); `gpu_only` drops nodes without GPUs."""
    import ray

    out = []
    for n in sorted((n for n in ray.nodes() if n.get("Alive")), key=_sort_key):
        res = n.get("Resources", {})
        if gpu_only and res.get("GPU", 0) <= 0:
            continue
        out.append(NodeView(n["NodeID"], n.get("NodeManagerAddress", ""), n.get("NodeManagerHostname", ""),
                            res.get("CPU", 0.0), res.get("GPU", 0.0)))
    return out


def _free_per_node() -> dict[str, dict[str, float]]:
    try:  # Ray keeps per-node availability in its private state API; totals alone are still worth printing
        from ray._private.state import state

        return state.available_resources_per_node()
    except Exception:
        return {}


def _node_names() -> dict[str, str]:
    import ray

    return {n.node_id: n.name for n in cluster_nodes()} if ray.is_initialized() else {}


def describe_nodes() -> str:
    """'visible nodes (2): vm/1f44fc95 GPU 2/4 free, CPU 3/4 free; ...' for error messages."""
    nodes, free = cluster_nodes(), _free_per_node()
    cells = []
    for n in nodes:
        f = free.get(n.node_id)
        gpu = f"GPU {f.get('GPU', 0):g}/{n.gpus:g} free" if f is not None else f"GPU {n.gpus:g}"
        cpu = f"CPU {f.get('CPU', 0):g}/{n.cpus:g} free" if f is not None else f"CPU {n.cpus:g}"
        cells.append(f"{n.name} {gpu}, {cpu}")
    return f"visible nodes ({len(nodes)}): " + ("; ".join(cells) or "none")


def layout_nodes(count: int, what: str) -> list[NodeView]:
    """The first `count` GPU nodes in layout order. No waiting: the Slurm bring-up (`ray-check`) has already
    waited for every node to join, so a missing node is an error now rather than after a long timeout."""
    nodes = cluster_nodes(gpu_only=True)
    if len(nodes) < count:
        raise ClusterError(
            f"{what} needs {count} GPU nodes (layout nodes 0-{count - 1}) but the Ray cluster has {len(nodes)}; "
            f"{describe_nodes()}; lower cluster.num_nodes or the layout, or start the missing nodes with "
            f"`ray start --num-gpus=...`")
    return nodes[:count]


# ------------------------------------------------------------------------------------------------ bundles

def _span(first: int, size: int) -> str:
    return f"{first}" if size == 1 else f"{first}-{first + size - 1}"


def trainer_bundles(world_size: int, tp: int, *, gpu: bool, cpus_per_rank: float = 1.0,
                    gpus_per_node: int = 0) -> list[Bundle]:
    """One bundle per trainer TP group; pinned to the layout's node when GPUs per node are declared."""
    if world_size % tp:
        raise ClusterError(f"trainer world size {world_size} is not a multiple of its TP size {tp}")
    out = []
    for g in range(world_size // tp):
        res = {"CPU": cpus_per_rank * tp, **({"GPU": float(tp)} if gpu else {})}
        node = None
        if gpu and gpus_per_node:
            node = _one_node(g * tp, tp, gpus_per_node, f"trainer TP group {g}", "parallel.tensor_model_parallel_size")
        out.append(Bundle(res, f"TP group {g} (ranks {_span(g * tp, tp)})", node))
    return out


def engine_bundles(num_engines: int, tp: int, *, gpu: bool, cpus_per_rank: float = 1.0, gpus_per_node: int = 0,
                   first_gpu: int = 0) -> list[Bundle]:
    """One bundle per rollout engine (all its TP devices); engine e takes layout GPUs first_gpu + e*tp onwards,
    pinned to their node when GPUs per node are declared."""
    out = []
    for e in range(num_engines):
        res = {"GPU": float(tp), "CPU": 1.0} if gpu else {"CPU": cpus_per_rank * tp}
        node = None
        if gpu and gpus_per_node:
            node = _one_node(first_gpu + e * tp, tp, gpus_per_node, f"rollout engine {e}", "rollout.tensor_parallel_size")
        out.append(Bundle(res, f"engine {e} (TP {tp})", node))
    return out


def _one_node(first: int, size: int, gpus_per_node: int, who: str, key: str) -> int:
    node = layout_node(first, gpus_per_node)
    if size > gpus_per_node or layout_node(first + size - 1, gpus_per_node) != node:
        raise ClusterError(f"{who} needs TP {size} GPUs on one node but nodes have {gpus_per_node} "
                           f"(cluster.gpus_per_node) and its GPUs {_span(first, size)} cross a node boundary; "
                           f"set {key} to a divisor of {gpus_per_node}")
    return node


# ------------------------------------------------------------------------------------------- reservation

@dataclass
class Reservation:
    """A ready placement group: where each bundle landed and the bundles in (node, index) order."""

    pg: Any
    bundle_nodes: list[str]  # Ray node id of each bundle, by bundle index
    order: list[int]  # bundle indices sorted by (node in layout order, bundle index); group g uses order[g]

    def strategy(self, group: int):
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=self.order[group])

    def node_of(self, group: int) -> str:
        return self.bundle_nodes[self.order[group]]

    def release(self) -> None:
        from ray.util.placement_group import remove_placement_group

        if self.pg is not None:
            remove_placement_group(self.pg)
            self.pg = None


def node_order(bundle_nodes: Sequence[str], node_rank: dict[str, int]) -> list[int]:
    """Bundle indices sorted by (node position in layout order, bundle index): a pure function of the table."""
    return sorted(range(len(bundle_nodes)),
                  key=lambda b: (node_rank.get(bundle_nodes[b], len(node_rank)), bundle_nodes[b], b))


def _summary(bundles: Sequence[Bundle]) -> str:
    counts: dict[str, int] = {}
    for b in bundles:
        key = "{" + ", ".join(f"{k}: {v:g}" for k, v in sorted(b.resources.items())) + "}"
        counts[key] = counts.get(key, 0) + 1
    return " + ".join(f"{n} x {k}" for k, n in counts.items())


def _check_fits(bundles: Sequence[Bundle], nodes: list[NodeView], what: str) -> None:
    """Fails at once (no waiting) when the cluster's totals can never hold the bundles."""
    if any(b.node is not None for b in bundles):
        for i, node in enumerate(nodes):
            want = sum(b.resources.get("GPU", 0) for b in bundles if b.node == i)
            if want > node.gpus:
                raise ClusterError(f"{what} needs {want:g} GPUs on layout node {i} ({node.name}) which has "
                                   f"{node.gpus:g}; set cluster.gpus_per_node to the GPUs each node really has")
        return
    for res in ("GPU", "CPU"):
        biggest = max((b.resources.get(res, 0) for b in bundles), default=0)
        largest = max((getattr(n, res.lower() + "s") for n in nodes), default=0)
        total_want = sum(b.resources.get(res, 0) for b in bundles)
        total_have = sum(getattr(n, res.lower() + "s") for n in nodes)
        if biggest > largest:
            raise ClusterError(f"{what} needs {biggest:g} {res}s on one node but the largest node has {largest:g}; "
                               f"lower the TP size or add larger nodes; {describe_nodes()}")
        if total_want > total_have:
            raise ClusterError(f"{what} needs {total_want:g} {res}s ({_summary(bundles)}) but the cluster has "
                               f"{total_have:g}; lower the layout or add nodes; {describe_nodes()}")


def reserve(bundles: Sequence[Bundle], what: str, timeout_s: float) -> Reservation:
    """A ready placement group for `bundles` (PACK; pinned bundles use label selectors), or ClusterError."""
    import ray
    from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group

    pinned = [b.node for b in bundles if b.node is not None]
    if pinned:
        nodes = layout_nodes(max(pinned) + 1, what)
        selector = [{NODE_LABEL: nodes[b.node].node_id} if b.node is not None else {} for b in bundles]
    else:
        nodes, selector = cluster_nodes(), None
    _check_fits(bundles, nodes, what)
    pg = placement_group([dict(b.resources) for b in bundles], strategy="PACK", bundle_label_selector=selector)
    try:
        ray.get(pg.ready(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(pg)
        where = ""
        if pinned:
            where = " on layout nodes " + ", ".join(f"{i}={nodes[i].name}" for i in sorted(set(pinned)))
        raise ClusterError(f"{what}: placement group of {_summary(bundles)}{where} not ready after {timeout_s:g}s "
                           f"(cluster.startup_timeout_s); {describe_nodes()}; free those resources, add nodes or "
                           f"shrink the layout") from None
    table = placement_group_table(pg)["bundles_to_node_id"]
    bundle_nodes = [table[i] for i in range(len(bundles))]
    rank = {n.node_id: i for i, n in enumerate(cluster_nodes())}
    return Reservation(pg, bundle_nodes, node_order(bundle_nodes, rank))


# --------------------------------------------------------------------------------------- actors and waits

def wait_ready(refs: Sequence[Any], what: str, timeout_s: float, labels: Sequence[str] | None = None) -> list[Any]:
    """`ray.get(refs)` bounded by `timeout_s`; on timeout names the items still missing."""
    import ray

    refs = list(refs)
    _, pending = ray.wait(refs, num_returns=len(refs), timeout=timeout_s) if refs else ([], [])
    if pending:
        labels = list(labels) if labels is not None else [f"#{i}" for i in range(len(refs))]
        missing = [labels[i] for i, r in enumerate(refs) if r in set(pending)]
        raise ClusterError(f"{what}: {len(missing)} of {len(refs)} not ready after {timeout_s:g}s "
                           f"(cluster.startup_timeout_s): {', '.join(missing)}; {describe_nodes()}")
    return ray.get(refs)


def check_groups(rank_nodes: Sequence[str], group_size: int, what: str, layout: str = "") -> None:
    """Raises ClusterError when ranks g*size..(g+1)*size-1 (one TP group) report more than one node."""
    names = _node_names()
    for g in range(len(rank_nodes) // group_size):
        here = list(dict.fromkeys(rank_nodes[g * group_size:(g + 1) * group_size]))
        if len(here) > 1:
            raise ClusterError(
                f"{what} TP group {g} (ranks {_span(g * group_size, group_size)}) spans nodes "
                f"{', '.join(names.get(n, n[:8]) for n in here)}{' in layout ' + layout if layout else ''}; "
                f"set the TP size to a divisor of the GPUs per node (cluster.gpus_per_node) and check that every "
                f"node declares them (ray start --num-gpus)")


def start_group(actor_cls: Any, args_for_rank: Callable[[int], tuple], reservation: Reservation, group_size: int,
                what: str, timeout_s: float, *, num_ranks: int | None = None, layout: str = "",
                **options: Any) -> tuple[list[Any], list[str]]:
    """One actor per rank, rank r in the bundle of group r // group_size (in node order); waits for every
    actor's `node_id()` and checks each group is on one node. `actor_cls` is a `ray.remote` class with a
    `node_id()` method; `options` go to `.options()` (num_cpus, num_gpus, runtime_env, ...).
    Returns (actors, node id per rank); kills the actors again on failure."""
    import ray

    n = num_ranks if num_ranks is not None else len(reservation.order) * group_size
    actors = [actor_cls.options(scheduling_strategy=reservation.strategy(r // group_size), **options)
              .remote(*args_for_rank(r)) for r in range(n)]
    try:
        nodes = wait_ready([a.node_id.remote() for a in actors], f"{what} actors", timeout_s,
                           labels=[f"rank {r}" for r in range(n)])
        check_groups(nodes, group_size, what, layout)
    except BaseException:
        for a in actors:
            ray.kill(a)
        raise
    return actors, nodes


def node_id() -> str:
    """The Ray node id of the calling worker (what actors report for `check_groups`)."""
    import ray

    return ray.get_runtime_context().get_node_id()


def local_ray_env(cluster: Any) -> dict[str, str]:
    """Environment for the local Ray instance a run starts (`cluster`: `ClusterConfig`): the workers' niceness
    (`cluster.worker_niceness`), read by the raylet when it starts them. Empty for Ray's default or for a
    cluster given by `cluster.ray_address` (started elsewhere, with its own environment)."""
    if cluster.ray_address or cluster.worker_niceness < 0:
        return {}
    return {"RAY_worker_niceness": str(cluster.worker_niceness)}


def socket_env(cluster: Any) -> dict[str, str]:
    """GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME from `cluster.socket_ifname` (empty: none; the environment's,
    if any, stands). The driver puts them in its own environment (the local Ray it starts passes it to every
    worker) and in the job's runtime_env (a cluster started elsewhere: every actor of the job gets them)."""
    if not cluster.socket_ifname:
        return {}
    return {"GLOO_SOCKET_IFNAME": cluster.socket_ifname, "NCCL_SOCKET_IFNAME": cluster.socket_ifname}
