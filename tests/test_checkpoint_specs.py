"""Checkpoints move between the local layer spec (CPU, `convert`) and the Transformer Engine spec (GPU), both ways.

    python -m pytest tests/test_checkpoint_specs.py -q     # CPU, ~40-70 s (one 2-process conversion)

Transformer Engine cannot be installed here, so the TE model is a stand-in built from megatron-core's own
modules with TE's module tree: the norms fused into `linear_qkv` / `linear_fc1` (`layer_norm_weight`, no
`input_layernorm` / `pre_mlp_layernorm`), and `_extra_state` where TE has it (its linears, and its final
RMSNorm, which the local spec's norm lacks: that key is what made a CPU checkpoint fail to load on a GPU with
"Missing key in checkpoint state_dict: decoder.final_layernorm._extra_state"). Its state dict therefore carries
TE's names and extra-state keys, and it loads and saves through the real torch_dist path
(`trainer/checkpoint.py`, megatron's `dist_checkpointing`):

* a checkpoint written by `convert` at TP=2 loads into the TE-named model at TP=1 with the tensors of the same
  checkpoint loaded into the local spec, and both give the same logits;
* the TE model's checkpoint (with extra state that is not empty) loads back into the local spec, tensor for
  tensor, and into a fresh TE model with its extra state;
* a CPU trainer checkpoint (megatron DDP + optimizer, Adam state after one update) resumes in the TE-named
  model with the same parameters and Adam moments;
* the tolerance is only for `_extra_state`: a TE-named model that asks for a tensor the checkpoint lacks is
  refused with one line.

What it leaves out: Transformer Engine's own modules (the GPU test `tests/test_trainer_gpu.py` saves on GPU,
loads on CPU and back), and the distributed optimizer's checkpoint format (GPU only; here both sides use
the plain megatron optimizer the CPU path uses).
"""

from __future__ import annotations

import pickle

import pytest
import torch

pytest.importorskip("megatron.core")

from helpers import one_rank_world  # noqa: E402

from megatron_sortedrl.config import TinyModelConfig  # noqa: E402
from megatron_sortedrl.errors import CheckpointError  # noqa: E402


class _ExtraState:
    """TE modules keep FP8 metadata as a pickled uint8 tensor in `_extra_state` (empty when FP8 is off)."""

    def _init_extra(self) -> None:
        self.te_extra = torch.empty(0, dtype=torch.uint8)

    def get_extra_state(self) -> torch.Tensor:
        return self.te_extra

    def set_extra_state(self, state) -> None:
        if state is not None:
            self.te_extra = state


def _te_modules():
    from megatron.core.tensor_parallel import ColumnParallelLinear

    from megatron_sortedrl.trainer.model import LocalRMSNorm

    class NormColumnLinear(_ExtraState, ColumnParallelLinear):
        """TELayerNormColumnParallelLinear's layout: RMSNorm weight `layer_norm_weight` inside the linear."""

        def __init__(self, input_size, output_size, *, config, **kw):
            super().__init__(input_size, output_size, config=config, **kw)
            self.layer_norm_weight = torch.nn.Parameter(torch.ones(input_size))
            self.eps = config.layernorm_epsilon
            self._init_extra()

        def forward(self, x, *args, **kw):
            normed = torch.nn.functional.rms_norm(x, (x.shape[-1],), self.layer_norm_weight, self.eps)
            return super().forward(normed, *args, **kw)

    class ExtraStateNorm(_ExtraState, LocalRMSNorm):
        """TE's RMSNorm (a TE operation: it has extra state; megatron's local norm has none)."""

        def __init__(self, *args, **kw):
            super().__init__(*args, **kw)
            self._init_extra()

    return NormColumnLinear, ExtraStateNorm


def _te_block_spec(config, local_spec):
    """The local block spec rearranged into TE's module tree (what `get_gpt_layer_with_transformer_engine_spec`
    builds, with megatron's torch modules in place of TE's)."""
    from megatron.core.transformer.identity_op import IdentityOp

    norm_linear, norm = _te_modules()
    block = local_spec(False, config)
    layer = block.layer_specs[0]
    sub = layer.submodules
    sub.input_layernorm = sub.pre_mlp_layernorm = IdentityOp
    sub.self_attention.submodules.linear_qkv = norm_linear
    sub.mlp.submodules.linear_fc1 = norm_linear
    sub.sharded_state_dict_keys_map = {}  # TE's names are the checkpoint's names already
    block.layer_norm = norm
    return block


def _build(arch, te: bool):
    from megatron_sortedrl.trainer import model as model_mod

    if not te:
        return model_mod.build_model(arch, torch.float32, use_te=False)
    real = model_mod.layer_spec
    model_mod.layer_spec = lambda use_te, config: _te_block_spec(config, real)
    try:
        return model_mod.build_model(arch, torch.float32, use_te=True, on_gpu=False)
    finally:
        model_mod.layer_spec = real


def _params(model) -> dict[str, torch.Tensor]:
    return {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}


def _as_te_names(local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Local parameter names -> TE names through the project's weight table (`trainer/weights.py`)."""
    from megatron_sortedrl.trainer.weights import WEIGHT_TABLE

    out = dict(local)
    for local_name, te_name, _, _ in WEIGHT_TABLE:
        if local_name == te_name:
            continue
        for i in range(64):
            name = local_name.format(i=i)
            if name in out:
                out[te_name.format(i=i)] = out.pop(name)
    return out


def _logits(model, seq: torch.Tensor) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(seq, torch.arange(seq.shape[1])[None], None)


@pytest.fixture(scope="module")
def world():
    """One gloo rank with megatron's TP=PP=1 groups, in this process."""
    yield from one_rank_world()


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """A tiny untied model (so the output layer is in the checkpoint too) and its `convert` checkpoint at TP=2."""
    from megatron_sortedrl.convert.core import hf_to_mcore
    from megatron_sortedrl.tiny_model import build_tiny_model

    root = tmp_path_factory.mktemp("specs")
    hf = build_tiny_model(root / "tiny", TinyModelConfig(seed=5, tie_word_embeddings=False))
    return hf, hf_to_mcore(hf, root / "ckpt_tp2", tp=2, pp=1)


def test_te_named_state_dict_has_te_layout(world, converted):
    from megatron_sortedrl.trainer.model import read_hf_config

    arch = read_hf_config(converted[0])
    te, local = _build(arch, te=True).state_dict(), _build(arch, te=False).state_dict()
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in te
    assert "decoder.layers.1.mlp.linear_fc1.layer_norm_weight" in te
    assert "decoder.final_layernorm._extra_state" in te and "decoder.final_layernorm._extra_state" not in local
    assert not any("input_layernorm" in k or "pre_mlp_layernorm" in k for k in te)
    assert set(_as_te_names(_params(_build(arch, te=False)))) == set(_params(_build(arch, te=True)))


def test_converter_checkpoint_loads_into_te_model_and_back(world, converted, tmp_path):
    from megatron_sortedrl.trainer.checkpoint import load_checkpoint, save_checkpoint
    from megatron_sortedrl.trainer.model import read_hf_config

    hf, ckpt = converted
    arch = read_hf_config(hf)
    local = _build(arch, te=False)
    load_checkpoint(ckpt, local, None, None, load_optimizer=False)
    te = _build(arch, te=True)
    load_checkpoint(ckpt, te, None, None, load_optimizer=False)  # failed with "Missing key" before the fix
    want = _as_te_names(_params(local))
    got = _params(te)
    assert set(got) == set(want)
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name
    seq = torch.randint(0, arch.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    assert torch.allclose(_logits(te, seq), _logits(local, seq), rtol=0, atol=1e-5)

    # The TE model's own checkpoint, with FP8-like metadata in its extra state, back into the local spec...
    with torch.no_grad():
        for p in te.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    meta = torch.frombuffer(bytearray(pickle.dumps({"scale_fwd": [1.5, 2.0]})), dtype=torch.uint8)
    te.decoder.final_layernorm.set_extra_state(meta.clone())
    te.decoder.layers[0].self_attention.linear_qkv.set_extra_state(meta.clone())
    te_ckpt = save_checkpoint(tmp_path / "te_ckpt", te, None, None, {"step": 0}, {"step": 0})
    back = _build(arch, te=False)
    load_checkpoint(te_ckpt, back, None, None, load_optimizer=False)
    moved = _as_te_names(_params(back))
    for name, tensor in _params(te).items():
        assert torch.equal(moved[name], tensor), name
    assert torch.allclose(_logits(back, seq), _logits(te, seq), rtol=0, atol=1e-5)
    # ...and into a fresh TE model, extra state included.
    again = _build(arch, te=True)
    load_checkpoint(te_ckpt, again, None, None, load_optimizer=False)
    assert all(torch.equal(again.state_dict()[k], v) for k, v in _params(te).items())
    assert torch.equal(again.decoder.final_layernorm.get_extra_state(), meta)
    assert torch.equal(again.decoder.layers[0].self_attention.linear_qkv.get_extra_state(), meta)


def test_absent_tensor_is_still_refused(world, converted, monkeypatch):
    """Only `_extra_state` may be absent: a model asking for a tensor the checkpoint lacks is refused."""
    from megatron_sortedrl.trainer.checkpoint import load_checkpoint
    from megatron_sortedrl.trainer.model import read_hf_config

    hf, ckpt = converted
    arch = read_hf_config(hf)
    te = _build(arch, te=True)
    for layer in te.decoder.layers:  # every layer: a sharded key spans the layers
        layer.self_attention.linear_qkv.layer_norm_bias = torch.nn.Parameter(torch.zeros(arch.hidden_size))
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(ckpt, te, None, None, load_optimizer=False)
    msg = str(err.value)
    assert "lacks 1 tensor(s)" in msg and "linear_qkv.layer_norm_bias" in msg and "\n" not in msg


def _trainer(arch, te: bool):
    """The trainer's CPU stack around a model: megatron DDP and optimizer, as `TrainerWorker.setup` builds it."""
    from megatron.core.distributed import DistributedDataParallel

    from megatron_sortedrl.config import RunConfig
    from megatron_sortedrl.trainer.optimizer import build_optimizer
    from megatron_sortedrl.trainer.worker import ddp_config

    cfg = RunConfig()
    model = _build(arch, te)
    ddp = DistributedDataParallel(config=model.config, ddp_config=ddp_config(cfg, False, 1), module=model)
    opt, sched = build_optimizer([ddp], cfg, on_gpu=False)
    return ddp, opt, sched


def _adam_state(ddp, opt, te: bool) -> dict[str, torch.Tensor]:
    """exp_avg / exp_avg_sq per parameter, under TE names (the optimizer orders parameters differently)."""
    names = {p: n for n, p in ddp.module.named_parameters()}
    out = {}
    for o in getattr(opt, "chained_optimizers", [opt]):
        for p, st in o.optimizer.state.items():
            for key in ("exp_avg", "exp_avg_sq"):
                out[f"{names[p]}/{key}"] = st[key]
    if te:
        return out
    local_to_te = {n: next(iter(_as_te_names({n: None}))) for n in names.values()}
    return {f"{local_to_te[k.split('/')[0]]}/{k.split('/')[1]}": v for k, v in out.items()}


def test_cpu_trainer_checkpoint_with_optimizer_loads_into_te_model(world, converted, tmp_path):
    """A CPU trainer checkpoint (model + Adam state after one update) resumes in the TE-named model."""
    from megatron.core.distributed import finalize_model_grads

    from megatron_sortedrl.trainer.checkpoint import load_checkpoint, save_checkpoint
    from megatron_sortedrl.trainer.model import read_hf_config
    from megatron_sortedrl.trainer.optimizer import optimizer_step

    hf, ckpt = converted
    arch = read_hf_config(hf)
    ddp, opt, sched = _trainer(arch, te=False)
    load_checkpoint(ckpt, ddp.module, None, None, load_optimizer=False)
    seq = torch.randint(0, arch.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    ddp.module.train()
    ddp.module(seq, torch.arange(12)[None], None).float().pow(2).mean().backward()
    finalize_model_grads([ddp])
    assert optimizer_step(opt, sched, [ddp], 1.0, grad_clip=0.0, on_gpu=False)["skipped"] == 0.0
    saved = save_checkpoint(tmp_path / "cpu_trainer", ddp.module, opt, sched, {"step": 1}, {"step": 1})

    te_ddp, te_opt, te_sched = _trainer(arch, te=True)
    state = load_checkpoint(saved, te_ddp.module, te_opt, te_sched)
    assert state["step"] == 1
    want, got = _adam_state(ddp, opt, te=False), _adam_state(te_ddp, te_opt, te=True)
    assert set(got) == set(want) and any(v.abs().sum() > 0 for v in want.values())
    for key, tensor in want.items():
        assert torch.equal(got[key], tensor), key
    for name, tensor in _as_te_names(_params(ddp.module)).items():
        assert torch.equal(_params(te_ddp.module)[name], tensor), name
