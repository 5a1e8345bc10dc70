"""GPU weight sync with one NCCL sender per pipeline stage (trainer on GPUs, one CUDA vLLM engine).

    .venv/bin/python -m pytest tests/test_weight_sync_gpu.py -q -m gpu      # needs 3+ GPUs and CUDA vLLM

Skipped without enough GPUs. The trainer runs at PP=2 (two stage senders, GPUs 0-1), the engine on a third
GPU; the NCCL group is senders + engine GPUs. The engine must then hold exactly the weights the object-store
path gives it (digests), which is the path the CPU suite tests (`tests/test_weight_sync.py`).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available() or torch.cuda.device_count() < 3:
    pytest.skip("needs 3 NVIDIA GPUs (2 trainer stages + 1 engine) and CUDA vLLM", allow_module_level=True)

ray = pytest.importorskip("ray")


def test_stage_senders_over_nccl_match_object_store(tmp_path):
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
        pool = RolloutPool(PoolOptions(**opts, weight_transport="nccl"))
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
