"""The planner's MoE parameters per GPU against megatron-core itself: two gloo ranks build a small Qwen3-MoE-shaped
GPTModel (local spec, q/k norms, router, sequential experts) at EP=2, at TP=2 with ETP=2 and at TP=2 x EP=2,
and each rank's parameter count must equal `stage_params` for that layout. CPU only, about 30 s.

    python -m pytest tests/test_plan_moe_megatron.py -q

Only the parameter layout is checked (experts per EP rank, expert and dense TP sharding, replicated router and
norms): the MoE activation terms need the MoE trainer, which this code path does not have yet.
"""

from __future__ import annotations

import socket

import pytest

from megatron_sortedrl.plan.arch import Arch
from megatron_sortedrl.plan.trainer_memory import stage_params

SHAPE = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 64,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
         "intermediate_size": 96, "moe_intermediate_size": 16, "num_experts": 8, "num_experts_per_tok": 2,
         "vocab_size": 128, "max_position_embeddings": 512, "tie_word_embeddings": False}
LAYOUTS = [(1, 2, 1), (2, 1, 2), (2, 2, 1)]  # (TP, EP, ETP) on two ranks


def _rank(rank: int, world: int, port: int, queue) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    from megatron_sortedrl.trainer import cpu_compat
    from megatron_sortedrl.trainer.model import LocalRMSNorm

    cpu_compat.activate()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    counts = []
    try:
        for tp, ep, etp in LAYOUTS:
            ps.initialize_model_parallel(tp, 1, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
            cpu_compat.seed_model_parallel(0)
            cfg = TransformerConfig(
                num_layers=SHAPE["num_hidden_layers"], hidden_size=SHAPE["hidden_size"],
                ffn_hidden_size=SHAPE["intermediate_size"], num_attention_heads=SHAPE["num_attention_heads"],
                num_query_groups=SHAPE["num_key_value_heads"], kv_channels=SHAPE["head_dim"], normalization="RMSNorm",
                gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, hidden_dropout=0.0,
                attention_dropout=0.0, use_cpu_initialization=True, params_dtype=torch.float32,
                tensor_model_parallel_size=tp, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp,
                sequence_parallel=tp > 1, num_moe_experts=SHAPE["num_experts"],
                moe_router_topk=SHAPE["num_experts_per_tok"], moe_ffn_hidden_size=SHAPE["moe_intermediate_size"],
                qk_layernorm=True, moe_grouped_gemm=False,
                moe_token_dispatcher_type="allgather")  # alltoall makes a CUDA stream at construction
            layer = get_gpt_layer_local_spec(num_experts=SHAPE["num_experts"], moe_grouped_gemm=False,
                                             qk_layernorm=True, normalization="RMSNorm")
            layer.submodules.input_layernorm = layer.submodules.pre_mlp_layernorm = LocalRMSNorm
            layer.submodules.self_attention.submodules.q_layernorm = LocalRMSNorm
            layer.submodules.self_attention.submodules.k_layernorm = LocalRMSNorm
            block = TransformerBlockSubmodules(layer_specs=[layer] * SHAPE["num_hidden_layers"], layer_norm=LocalRMSNorm)
            model = GPTModel(config=cfg, transformer_layer_spec=block, vocab_size=SHAPE["vocab_size"],
                             max_sequence_length=512, pre_process=True, post_process=True,
                             share_embeddings_and_output_weights=False, position_embedding_type="rope")
            counts.append(sum(p.numel() for p in model.parameters()))
            ps.destroy_model_parallel()
        queue.put((rank, counts))
    except Exception as exc:  # the parent reports it rather than waiting for a count that never comes
        queue.put((rank, repr(exc)))
    finally:
        dist.destroy_process_group()


def test_parameters_per_gpu_equal_megatron_cores():
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, 2, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        results = dict(queue.get(timeout=240) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    arch = Arch.from_dict(SHAPE)
    for rank, counts in results.items():
        assert not isinstance(counts, str), f"rank {rank}: {counts}"
        for (tp, ep, etp), n in zip(LAYOUTS, counts):
            assert n == stage_params(arch, tp, 1, 0, ep=ep, etp=etp), (rank, tp, ep, etp)
    # by hand: per layer qkv 64x256 + proj 128x64, norms 2x64 + q/k norms 2x32, router 8x64 and 8 experts of
    # 3x64x16; embedding and output layer 128x64 each, final norm 64. EP=2: 4 experts per rank; TP=2 x ETP=2:
    # everything split halved, 8 half experts; TP=2 x EP=2 x ETP=1: 4 whole experts, dense part halved.
    assert results[0] == results[1] == [2 * (24576 + 192 + 512 + 4 * 3072) + 2 * 8192 + 64,
                                        2 * (12288 + 192 + 512 + 8 * 3072 // 2) + 8192 + 64,
                                        2 * (12288 + 192 + 512 + 4 * 3072) + 8192 + 64]


if __name__ == "__main__":  # spawn re-imports this module
    pytest.main([__file__, "-q"])
