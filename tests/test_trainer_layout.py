"""HF <-> Megatron weight layouts and micro-batching, as pure functions (no process groups).

    pytest tests/test_trainer_layout.py -q       # CPU, seconds
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megatron_sortedrl.trainer.logprobs import SeqItem, make_microbatches
from megatron_sortedrl.trainer.weights import WEIGHT_TABLE, full_to_shard, fuse_qkv, shards_to_full, split_qkv


def _arch(heads=8, kv=2, hd=4, hidden=16, vocab=13):
    return SimpleNamespace(num_heads=heads, num_kv_heads=kv, head_dim=hd, hidden_size=hidden, vocab_size=vocab)


def test_fuse_qkv_is_grouped_per_query_group():
    a = _arch()
    q = torch.randn(a.num_heads * a.head_dim, a.hidden_size)
    k = torch.randn(a.num_kv_heads * a.head_dim, a.hidden_size)
    v = torch.randn(a.num_kv_heads * a.head_dim, a.hidden_size)
    fused = fuse_qkv(q, k, v, a.num_kv_heads)
    qpg, hd = a.num_heads // a.num_kv_heads, a.head_dim
    rows = []
    for g in range(a.num_kv_heads):  # [q heads of group g..., k_g, v_g]
        rows += [q[(g * qpg + j) * hd:(g * qpg + j + 1) * hd] for j in range(qpg)]
        rows += [k[g * hd:(g + 1) * hd], v[g * hd:(g + 1) * hd]]
    assert torch.equal(fused, torch.cat(rows))
    assert all(torch.equal(x, y) for x, y in zip(split_qkv(fused, a.num_heads, a.num_kv_heads, hd), (q, k, v)))
    qb, kb, vb = q[:, 0], k[:, 0], v[:, 0]  # biases use the same layout
    assert torch.equal(fuse_qkv(qb, kb, vb, a.num_kv_heads), fused[:, 0])


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("layout", ["replicated", "vocab", "column", "row", "qkv", "gate_up"])
def test_shard_then_gather_round_trips(layout, tp):
    a = _arch()
    if layout == "qkv":
        full = [torch.randn(a.num_heads * a.head_dim, 16), torch.randn(8, 16), torch.randn(8, 16)]
    elif layout == "gate_up":
        full = [torch.randn(12, 16), torch.randn(12, 16)]
    elif layout == "vocab":
        full = [torch.randn(a.vocab_size, 16)]  # 13 rows: padded to a multiple of TP
    else:
        full = [torch.randn(12, 16)]
    shards = [full_to_shard(full, layout, tp, r, a) for r in range(tp)]
    assert len({s.shape for s in shards}) == 1
    back = shards_to_full(shards, layout, a)
    assert all(torch.equal(x, y) for x, y in zip(back, full))
    if layout == "gate_up" and tp == 2:  # rank i holds [gate_i; up_i]
        assert torch.equal(shards[1], torch.cat([full[0][6:], full[1][6:]]))


def test_weight_table_covers_both_specs_once():
    local = [r[0] for r in WEIGHT_TABLE]
    te = [r[1] for r in WEIGHT_TABLE]
    assert len(set(local)) == len(local) and len(set(te)) == len(te)
    assert "decoder.layers.{i}.self_attention.linear_qkv.layer_norm_weight" in te


def test_microbatches_respect_budget_and_pad_per_batch():
    items = [SeqItem(i, [1] * (2 + i % 5), [2] * (1 + (7 * i) % 13), {"a": [float(i)] * (1 + (7 * i) % 13)})
             for i in range(20)]
    mbs = make_microbatches(items, budget_tokens=40)
    assert sorted(i for mb in mbs for i in mb.indices) == list(range(20))
    longest = max(len(it.prompt) + len(it.response) - 1 for it in items)
    for mb in mbs:
        b, s = mb.tokens.shape
        assert b * s <= 40 or b == 1
        assert s == max(len(items[i].prompt) + len(items[i].response) - 1 for i in mb.indices)
        for row, (i, (st, en)) in enumerate(zip(mb.indices, mb.response_slices)):
            it = items[i]
            assert mb.loss_mask[row].sum() == len(it.response) == en - st
            assert mb.labels[row, st:en].tolist() == it.response
            assert mb.tokens[row, : len(it.prompt)].tolist() == it.prompt
            assert torch.all(mb.extras["a"][row, st:en] == float(i))
    assert sum(mb.tokens.numel() for mb in mbs) < 20 * longest  # no batch pays for the global maximum


def test_microbatch_rejects_mismatched_extras():
    with pytest.raises(ValueError, match="response tokens"):
        make_microbatches([SeqItem(0, [1, 2], [3, 4], {"a": [1.0]})], 100)


def test_group_fails_fast_on_a_missing_model_dir(tmp_path):
    from megatron_sortedrl.config import RunConfig
    from megatron_sortedrl.errors import UserError
    from megatron_sortedrl.trainer.group import TrainerGroup

    cfg = RunConfig()
    cfg.model.path = str(tmp_path / "nope")
    with pytest.raises(UserError, match="config.json"):
        TrainerGroup(cfg)  # before any Ray actor is started
