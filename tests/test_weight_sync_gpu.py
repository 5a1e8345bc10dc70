"""GPU weight sync with one NCCL sender per pipeline stage (trainer on GPUs, one CUDA vLLM engine).

    .venv/bin/python -m pytest tests/test_weight_sync_gpu.py -q -m gpu      # needs 3+ GPUs and CUDA vLLM

Skipped without enough GPUs. The trainer runs at PP=2 (two stage senders, GPUs 0-1), the engine on a third
GPU. `pipelined`: one NCCL group per stage sender (sender + engine GPUs), the engine receives the whole sync
in one call; `serial`: the path before (one group of senders + engine GPUs, bucket by bucket). Either way the
engine must hold exactly the weights the object-store path gives it (digests), the path the CPU suite tests
(`tests/test_weight_sync.py`). Repeated relayouts must not grow the trainer GPUs' used memory (the old
communicators are destroyed before new ones are made). An EP2 x DP2 MoE trainer's expert pass (experts sent
from the EP peer to the stage sender over the trainer's NCCL expert group) must give the same weights too.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available() or torch.cuda.device_count() < 3:
    pytest.skip("needs 3 NVIDIA GPUs (2 trainer stages + 1 engine) and CUDA vLLM", allow_module_level=True)

ray = pytest.importorskip("ray")


@pytest.mark.parametrize("mode", ["pipelined", "serial"])
def test_stage_senders_over_nccl_match_object_store(tmp_path, mode):
    from megatron_sortedrl.config import RunConfig, TinyModelConfig
    from megatron_sortedrl.rollout import PoolOptions, RolloutPool
    from megatron_sortedrl.tiny_model import build_tiny_model
    from megatron_sortedrl.trainer.group import TrainerGroup

    model_dir = build_tiny_model(tmp_path / "tiny", TinyModelConfig(num_layers=4))
    cfg = RunConfig()
    cfg.model.path = str(model_dir)
    cfg.cluster.device = "gpu"
    cfg.parallel.pipeline_model_parallel_size = 2
    ray.init(address="local", include_dashboard=False)
    group = pool = None
    try:
        group = TrainerGroup(cfg)
        group.sft_step([([5, 6, 7, 8], [9, 10, 11, 12])] * 4)
        opts = {"model_path": str(model_dir), "device": "gpu", "max_model_len": 256, "gpu_memory_utilization": 0.3,
                "bucket_bytes": 1 << 20}
        pool = RolloutPool(PoolOptions(**opts, weight_transport="nccl", weight_sync_mode=mode))
        report = pool.sync_weights(group, version=1)
        assert report.transport == "nccl" and report.mode == mode and report.num_buckets > 1
        nccl_digests = pool.weights_digests()
        stats = ray.get(pool.slots[0].actor.rpc.remote("msrl_reload_stats"))[0]
        if mode == "pipelined":  # one layer in loading per stage sender, not every layer's q/k/v weights
            assert stats["max_layers_waiting"] <= 2, stats
        pool.shutdown()
        pool = RolloutPool(PoolOptions(**opts, weight_transport="object_store"))
        pool.sync_weights(group, version=1)
        assert pool.weights_digests() == nccl_digests
    finally:
        if pool is not None:
            pool.shutdown()
        if group is not None:
            group.shutdown()
        ray.shutdown()


def test_relayouts_destroy_the_old_nccl_groups(tmp_path):
    """Prediction 10: every relayout made a new trainer->engines NCCL group and kept the old one (its buffers
    stay on the GPU). Now the senders destroy theirs before joining the new engines' groups: after the first
    relayout, the trainer GPUs' used memory stays where it is."""
    from megatron_sortedrl.config import RunConfig, TinyModelConfig
    from megatron_sortedrl.rollout import PoolOptions, RolloutPool
    from megatron_sortedrl.tiny_model import build_tiny_model
    from megatron_sortedrl.trainer.group import TrainerGroup

    model_dir = build_tiny_model(tmp_path / "tiny", TinyModelConfig(num_layers=4))
    cfg = RunConfig()
    cfg.model.path, cfg.cluster.device = str(model_dir), "gpu"
    cfg.parallel.pipeline_model_parallel_size = 2
    ray.init(address="local", include_dashboard=False)
    group = pool = None
    try:
        group = TrainerGroup(cfg)
        pool = RolloutPool(PoolOptions(model_path=str(model_dir), device="gpu", max_model_len=256,
                                       gpu_memory_utilization=0.3, bucket_bytes=1 << 20, weight_transport="nccl"))
        used = []
        for k in range(4):
            pool.sync_weights(group, version=k + 1)
            used.append(ray.get([a.__ray_call__.remote(lambda self: (lambda f, t: t - f)(*torch.cuda.mem_get_info()))
                                 for a in group.actors]))
            pool.set_layout(1, 1)  # new engines: the next sync makes new groups
        live = ray.get([a.__ray_call__.remote(lambda self: int(getattr(self.worker, "_nccl", None) is not None))
                        for a in group.actors])
        assert sum(live) <= 2  # one communicator per stage sender, however many relayouts
        for rank in range(len(group.actors)):
            assert used[-1][rank] - used[1][rank] < 64 << 20, [u[rank] >> 20 for u in used]  # MiB per sync
    finally:
        if pool is not None:
            pool.shutdown()
        if group is not None:
            group.shutdown()
        ray.shutdown()


@pytest.mark.parametrize("mode", ["pipelined", "serial"])
def test_ep2_expert_pass_over_nccl_matches_object_store(tmp_path, mode):
    """An EP2 x DP2 trainer (GPUs 0-1) pushes a tiny Qwen3-MoE over NCCL: the expert pass's point-to-point
    sends run on the trainer's NCCL expert group, and the engine must hold exactly what the object-store path
    gives it (the CPU suite checks that path bit for bit against the whole-model export,
    tests/test_weight_sync_moe.py)."""
    from megatron_sortedrl.config import RunConfig
    from megatron_sortedrl.rollout import PoolOptions, RolloutPool
    from megatron_sortedrl.tiny_model import build_tiny_qwen3
    from megatron_sortedrl.trainer.group import TrainerGroup

    model_dir = build_tiny_qwen3(tmp_path / "moe", moe=True, seed=3)
    cfg = RunConfig()
    cfg.model.path, cfg.cluster.device = str(model_dir), "gpu"
    cfg.parallel.data_parallel_size = cfg.parallel.expert_model_parallel_size = 2
    ray.init(address="local", include_dashboard=False)
    group = pool = None
    try:
        group = TrainerGroup(cfg)
        group.sft_step([([5, 6, 7, 8], [9, 10, 11, 12])] * 4)
        opts = {"model_path": str(model_dir), "device": "gpu", "max_model_len": 256, "gpu_memory_utilization": 0.3,
                "bucket_bytes": 1 << 16}
        pool = RolloutPool(PoolOptions(**opts, weight_transport="nccl", weight_sync_mode=mode))
        report = pool.sync_weights(group, version=1)
        assert report.transport == "nccl" and report.num_buckets > 1
        nccl_digests = pool.weights_digests()
        pool.shutdown()
        pool = RolloutPool(PoolOptions(**opts, weight_transport="object_store"))
        pool.sync_weights(group, version=1)
        assert pool.weights_digests() == nccl_digests
    finally:
        if pool is not None:
            pool.shutdown()
        if group is not None:
            group.shutdown()
        ray.shutdown()
