"""Placement keeps every TP group on one node, on the nodes the layout names, on an emulated multi-node cluster.

Hardware: CPU only. A `ray.cluster_utils.Cluster` of 4 nodes declaring 4 "GPUs" each (declared resources
only, no CUDA) hosts the 32B recipe's shape scaled down: trainer TP=2 x PP=2 x DP=2 on layout nodes 0-1,
rollout 4 engines x TP=2 (short rounds) or 2 x TP=4 (long rounds) on nodes 2-3. The real placement
functions (`megatron_sortedrl.placement`, which `TrainerGroup` and `RolloutPool` call) place a tiny probe
actor instead of Megatron ranks and vLLM engines, so the module stays well under a minute.

Run: .venv/bin/python -m pytest tests/test_placement_cluster.py -q
"""

from __future__ import annotations

import sys

import pytest

from megatron_sortedrl import placement as P
from megatron_sortedrl.config import ClusterConfig, ModelConfig, ParallelConfig, RolloutConfig, RunConfig
from megatron_sortedrl.errors import ClusterError, ConfigError
from megatron_sortedrl.layout import plan_layout, rollout_first_gpu

NODES, GPUS = 4, 4


class Probe:
    """Stands in for a trainer rank or an engine: reports where Ray put it."""

    def __init__(self, index: int):
        self.index = index

    def node_id(self) -> str:
        return P.node_id()

    def gpu_ids(self) -> list[int]:
        import ray

        return [int(g) for g in ray.get_gpu_ids()]


def scaled_32b() -> RunConfig:
    # No model directory: the layout arithmetic is checked, the model shape is not (nothing is loaded).
    return RunConfig(
        model=ModelConfig(path="no-model", build_tiny_if_missing=False),
        parallel=ParallelConfig(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, data_parallel_size=2),
        rollout=RolloutConfig(num_workers=4, tensor_parallel_size=2, long_round_tensor_parallel_size=4),
        cluster=ClusterConfig(device="gpu", num_nodes=NODES, gpus_per_node=GPUS))


@pytest.fixture(scope="module")
def cluster():
    import ray
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    # 2 CPUs per node: two engine bundles of 1 CPU fit, and Ray starts few idle workers on a 2-core machine.
    node = {"num_cpus": 2, "num_gpus": GPUS, "object_store_memory": 80 * 1024 * 1024}
    c = Cluster(initialize_head=True, head_node_args={**node, "include_dashboard": False})
    for _ in range(NODES - 1):
        c.add_node(wait=False, **node)  # nodes start side by side
    # Workers cannot import this test file: ship the probe class by value (no runtime env, so the workers
    # Ray already started are reused).
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    ray.init(address=c.address, log_to_driver=False)
    c.wait_for_nodes()
    yield c
    ray.shutdown()
    c.shutdown()


def _block(node_gpus: dict[int, int]):
    """Takes `n` GPUs on layout node i, as another job or a previous layout would."""
    import ray
    from ray.util.placement_group import placement_group

    nodes = P.cluster_nodes(gpu_only=True)
    bundles = [{"GPU": 1.0, "CPU": 0.01} for i, n in node_gpus.items() for _ in range(n)]
    selector = [{P.NODE_LABEL: nodes[i].node_id} for i, n in node_gpus.items() for _ in range(n)]
    pg = placement_group(bundles, strategy="PACK", bundle_label_selector=selector)
    ray.get(pg.ready(), timeout=60)
    return pg


def _probes(res, count: int, per_bundle: int, **options):
    import ray

    return P.start_group(ray.remote(Probe), lambda r: (r,), res, per_bundle, "probe", 300, num_ranks=count, **options)


# --------------------------------------------------------------------------------------- pure, no Ray

def test_node_order_mends_an_interleaved_bundle_table():
    # One bundle per GPU, rank = bundle index, as Ray may lay them out: TP=2 groups (0,1), (4,5) and (6,7)
    # would straddle nodes A and B.
    table = ["A", "B", "A", "A", "B", "A", "B", "B"]
    with pytest.raises(ClusterError, match=r"TP group 0 \(ranks 0-1\) spans nodes A, B"):
        P.check_groups(table, 2, "trainer")
    order = P.node_order(table, {"A": 0, "B": 1})
    assert order == [0, 2, 3, 5, 1, 4, 6, 7]
    P.check_groups([table[b] for b in order], 2, "trainer")  # sorted by node: every group whole


def test_engine_wider_than_a_node_fails_in_one_line():
    with pytest.raises(ClusterError) as info:
        P.engine_bundles(2, 8, gpu=True, gpus_per_node=4, first_gpu=8)
    msg = str(info.value)
    assert "\n" not in msg and "rollout engine 0 needs TP 8 GPUs on one node but nodes have 4" in msg
    assert "set rollout.tensor_parallel_size to a divisor of 4" in msg


def test_bundles_follow_the_layout_plan():
    cfg = scaled_32b()
    plan = plan_layout(cfg)
    trainer = P.trainer_bundles(8, 2, gpu=True, gpus_per_node=GPUS)
    assert [b.node for b in trainer] == [plan.trainer[2 * g].node for g in range(4)] == [0, 0, 1, 1]
    for engines, tp in ((plan.rollout_short, 2), (plan.rollout_long, 4)):
        bundles = P.engine_bundles(len(engines), tp, gpu=True, gpus_per_node=GPUS, first_gpu=rollout_first_gpu(cfg))
        assert [b.node for b in bundles] == [e.node for e in engines]
        assert all(b.resources == {"GPU": tp, "CPU": 1.0} for b in bundles)
    # what the rollout pool is given from the config: GPUs per node, its first GPU, the start-up timeout
    from megatron_sortedrl.rollout.pool_options import engine_placement_from

    assert engine_placement_from(cfg) == (GPUS, 8, 900.0)


def test_startup_timeout_is_checked_at_config_load():
    assert ClusterConfig(colocate=True).colocate  # runs now (megatron_sortedrl/colocate/, tests/test_colocate*.py)
    with pytest.raises(ConfigError, match=r"cluster.startup_timeout_s=0 "):
        ClusterConfig(startup_timeout_s=0)


# ------------------------------------------------------------------------------------ emulated cluster

def test_scaled_32b_layout_keeps_groups_on_their_nodes(cluster):
    import ray

    cfg = scaled_32b()
    plan = plan_layout(cfg)
    nodes = P.layout_nodes(NODES, "test")
    trainer_res = P.reserve(P.trainer_bundles(8, 2, gpu=True, cpus_per_rank=0.25, gpus_per_node=GPUS),
                            "trainer", 60)
    actors, rank_nodes = _probes(trainer_res, 8, 2, num_cpus=0.25, num_gpus=1)
    # rank r sits on the node the layout gives it: ranks 0-3 on node 0, 4-7 on node 1 (each TP group whole)
    assert rank_nodes == [nodes[p.node].node_id for p in plan.trainer]
    gpus = ray.get([a.gpu_ids.remote() for a in actors])
    assert len({(n, g[0]) for n, g in zip(rank_nodes, gpus)}) == 8  # one GPU each, none shared

    for engines, tp in ((plan.rollout_short, 2), (plan.rollout_long, 4)):  # both elastic-TP layouts
        res = P.reserve(P.engine_bundles(len(engines), tp, gpu=True, gpus_per_node=GPUS,
                                         first_gpu=rollout_first_gpu(cfg)), "rollout", 60)
        eng, eng_nodes = _probes(res, len(engines), 1, num_cpus=1, num_gpus=tp)
        assert eng_nodes == [nodes[e.node].node_id for e in engines]
        assert set(eng_nodes).isdisjoint(rank_nodes)  # the rollout node set is the trainer's complement
        assert all(len(g) == tp for g in ray.get([a.gpu_ids.remote() for a in eng]))
        for a in eng:
            ray.kill(a)
        res.release()
    for a in actors:
        ray.kill(a)
    trainer_res.release()


def test_fragmented_cluster_per_gpu_pack_splits_groups_per_group_bundles_do_not(cluster):
    import ray
    from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group

    blocker = _block({0: 1, 1: 1, 2: 2, 3: 2})  # free GPUs per node: 3, 3, 2, 2
    try:
        # The old scheme: one bundle per GPU, PACK, rank = bundle index. With 3 free GPUs on a node, some
        # TP=2 group must take one GPU there and one elsewhere.
        naive = placement_group([{"GPU": 1.0, "CPU": 0.01}] * 8, strategy="PACK")
        ray.get(naive.ready(), timeout=60)
        table = placement_group_table(naive)["bundles_to_node_id"]
        naive_nodes = [table[i] for i in range(8)]
        remove_placement_group(naive)
        with pytest.raises(ClusterError, match="spans nodes"):
            P.check_groups(naive_nodes, 2, "trainer")

        res = P.reserve(P.trainer_bundles(8, 2, gpu=True, cpus_per_rank=0.01), "trainer", 60)
        actors, rank_nodes = _probes(res, 8, 2, num_cpus=0.01, num_gpus=1)
        assert len(set(rank_nodes)) == 4  # one TP group on each node, none split
        order = [n.node_id for n in P.cluster_nodes(gpu_only=True)]
        assert rank_nodes == sorted(rank_nodes, key=order.index)  # ranks in node order
        for a in actors:
            ray.kill(a)
        res.release()
    finally:
        remove_placement_group(blocker)


def test_more_gpus_than_the_cluster_fails_in_one_line(cluster):
    # 6 nodes' worth of trainer on a 4-node cluster: named at once, not after the start-up timeout.
    with pytest.raises(ClusterError) as info:
        P.reserve(P.trainer_bundles(24, 4, gpu=True, gpus_per_node=GPUS), "trainer", 900)
    msg = str(info.value)
    assert "\n" not in msg and "trainer needs 6 GPU nodes (layout nodes 0-5) but the Ray cluster has 4" in msg
    assert "visible nodes (4)" in msg
    # Unpinned: an engine wider than any node, and more GPUs than all nodes together, fail before waiting.
    with pytest.raises(ClusterError, match="needs 8 GPUs on one node but the largest node has 4"):
        P.reserve(P.engine_bundles(1, 8, gpu=True), "rollout", 900)
    with pytest.raises(ClusterError, match="needs 20 GPUs .* but the cluster has 16"):
        P.reserve(P.engine_bundles(10, 2, gpu=True), "rollout", 900)


def test_resources_held_elsewhere_time_out_naming_what_is_free(cluster):
    from ray.util.placement_group import remove_placement_group

    blocker = _block({2: 3})
    try:
        with pytest.raises(ClusterError) as info:
            P.reserve(P.engine_bundles(2, 2, gpu=True, gpus_per_node=GPUS, first_gpu=8), "rollout", 2)
        msg = str(info.value)
        assert "\n" not in msg and "not ready after 2s (cluster.startup_timeout_s)" in msg
        assert "on layout nodes 2=" in msg and "GPU 1/4 free" in msg
    finally:
        remove_placement_group(blocker)


def test_unanswered_actors_time_out_naming_them(cluster):
    import ray

    @ray.remote(num_cpus=0.01)
    class Slow:
        def ready(self):
            import time

            time.sleep(30)

    slow = Slow.remote()
    with pytest.raises(ClusterError, match=r"engine start: 1 of 1 not ready after 1s .*: engine 0 on node"):
        P.wait_ready([slow.ready.remote()], "engine start", 1, labels=["engine 0 on node x"])
    ray.kill(slow)
