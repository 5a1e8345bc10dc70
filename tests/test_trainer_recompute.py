"""Activation recompute and sequence parallelism on the real Megatron trainer, on CPU (gloo).

    pytest tests/test_trainer_recompute.py -q      # CPU; about a minute on 2 idle cores

Hardware: CPU only (one test is marked gpu). `TrainerWorker` is driven directly (no Ray): one spawned
process for the TP=1 layouts and two each for the TP=2 and PP=2 ones; each process builds its layouts
one after another on the tiny Qwen2 model and writes log-probs, the RL loss, the HF-layout gradients
and the bytes autograd saved for backward to a file. Every variant is compared with the plain run of
the same layout:

* recompute (full uniform, full block, selective) changes what is kept for backward, not the math: the
  recomputed forward runs the same ops on the same inputs in the same order, so log-probs, loss and
  gradients are bit-identical (checked with `torch.equal`);
* sequence parallelism at TP=2 changes where the sum over tokens of the norm weights' gradients and the
  order of the TP reductions happen (reduce-scatter + all-gather instead of all-reduce), so it equals
  TP=2 without it to float32 rounding: log-probs to 1e-5, gradients to atol 1e-6 / rtol 1e-4 (the
  tolerances test_trainer.py uses for TP=2 against TP=1).

"Recompute really recomputes" is measured with `torch.autograd.graph.saved_tensors_hooks` around the
decoder's forward: full recompute of every layer keeps exactly one hidden-size vector per token per layer
(plus the rotary table each checkpoint is handed), far below the plain run.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from helpers import random_train_items, rank0_port

FUSIONS = ("bias_activation_fusion", "bias_dropout_fusion", "masked_softmax_fusion", "apply_rope_fusion",
           "gradient_accumulation_fusion")
TP1_VARIANTS = {
    "plain": {},
    "full_uniform": {"granularity": "full", "method": "uniform", "num_layers": 1},
    "full_uniform_all": {"granularity": "full", "method": "uniform", "num_layers": 2},
    "full_block": {"granularity": "full", "method": "block", "num_layers": 1},
    "selective": {"granularity": "selective"},
}
TP2_VARIANTS = {
    "plain": {},
    "sp": {"sequence_parallel": True},
    "sp_full_block": {"sequence_parallel": True, "granularity": "full", "method": "block", "num_layers": 1},
    "sp_selective": {"sequence_parallel": True, "granularity": "selective"},
}
PP2_VARIANTS = {  # block 1 at PP=2: the first layer of each stage, i.e. both layers
    "plain": {},
    "full_block": {"granularity": "full", "method": "block", "num_layers": 1},
}


class _SavedBytes:
    """Bytes of the activations autograd keeps for backward while the decoder runs (parameters and the
    final norm excluded: only what the transformer layers keep)."""

    def __init__(self, module):
        self.total, self.counting = 0, False
        self.params = {p.untyped_storage().data_ptr() for p in module.parameters()}
        dec = module.decoder
        dec.register_forward_pre_hook(lambda *_: self._on(True))
        dec.register_forward_hook(lambda *_: self._on(False))
        if dec.final_layernorm is not None:  # only on the last pipeline stage
            dec.final_layernorm.register_forward_pre_hook(lambda *_: self._on(False))

    def _on(self, flag: bool) -> None:
        self.counting = flag

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        if self.counting and t.untyped_storage().data_ptr() not in self.params:
            self.total += t.numel() * t.element_size()
        return t


def _run_layouts(rank: int, world: int, model_dir: str, variants: dict, ports, out_dir: str, device: str,
                 pp: int) -> None:
    from megatron_sortedrl.config import RunConfig
    from megatron_sortedrl.trainer.worker import TrainerWorker

    torch.set_num_threads(1)
    items = random_train_items()
    for name, over in variants.items():
        cfg = RunConfig()
        cfg.model.path = model_dir
        cfg.cluster.device = device
        cfg.parallel.tensor_model_parallel_size = world // pp
        cfg.parallel.pipeline_model_parallel_size = pp
        cfg.parallel.sequence_parallel = over.get("sequence_parallel", False)
        rc = cfg.parallel.recompute
        rc.granularity = over.get("granularity", "none")
        rc.method, rc.num_layers = over.get("method", "uniform"), over.get("num_layers", 1)
        cfg.trainer.micro_batch_tokens = 48  # several micro-batches
        w = TrainerWorker(cfg, rank, world, "127.0.0.1", rank0_port(rank, world, ports))
        w.setup()
        counter = _SavedBytes(w.module)
        lp = w.logprobs(items)
        with torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t):
            lg = w.loss_and_grads(items, "rl")
        mbs = w._microbatches(w._shard(items))
        config = w.module.config
        res = {"logprobs": lp, "metrics": lg.get("metrics"), "grads": lg.get("grads"), "saved": counter.total,
               "tokens": sum(mb.tokens.numel() for mb in mbs), "recompute": config.recompute_granularity,
               "sequence_parallel": config.sequence_parallel,
               "fusions": {k: getattr(config, k) for k in FUSIONS}, "probed": w.kernels.fusions(),
               "overlap": (w.model.ddp_config.overlap_grad_reduce, w.model.ddp_config.overlap_param_gather),
               "sp_norm_weights": sum(bool(getattr(p, "sequence_parallel", False))
                                      for n, p in w.module.named_parameters() if "layernorm" in n)}
        reporter = w.reporter  # the last stage's TP rank 0: log-probs and metrics; rank 0: HF-layout grads
        w.shutdown()
        if rank == 0 or reporter:
            torch.save({"rank": rank, "reporter": reporter, **res}, Path(out_dir) / f"{name}.{rank}.pt")


def _measure(tmp_path: Path, model_dir: Path, world: int, variants: dict, device: str = "cpu",
             pp: int = 1) -> dict[str, dict]:
    out = tmp_path / f"w{world}pp{pp}"
    out.mkdir()
    ports = mp.get_context("spawn").Queue()
    mp.start_processes(_run_layouts, args=(world, str(model_dir), variants, ports, str(out), device, pp),
                       nprocs=world, join=True, start_method="spawn")
    merged = {}
    for name in variants:
        parts = [torch.load(f, weights_only=False) for f in sorted(out.glob(f"{name}.*.pt"))]
        first = next(r for r in parts if r["rank"] == 0)
        report = next(r for r in parts if r["reporter"])
        merged[name] = {**first, "logprobs": report["logprobs"], "metrics": report["metrics"]}
    return merged


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from megatron_sortedrl.config import TinyModelConfig
    from megatron_sortedrl.tiny_model import build_tiny_model

    d = tmp_path_factory.mktemp("recompute") / "tiny"
    build_tiny_model(d, TinyModelConfig(seed=3))
    return d


@pytest.fixture(scope="module")
def tp1(model_dir, tmp_path_factory):
    return _measure(tmp_path_factory.mktemp("m"), model_dir, 1, TP1_VARIANTS)


@pytest.fixture(scope="module")
def tp2(model_dir, tmp_path_factory):
    return _measure(tmp_path_factory.mktemp("m"), model_dir, 2, TP2_VARIANTS)


@pytest.fixture(scope="module")
def pp2(model_dir, tmp_path_factory):
    return _measure(tmp_path_factory.mktemp("m"), model_dir, 2, PP2_VARIANTS, pp=2)


def _bit_identical(a: dict, b: dict) -> None:
    assert a["logprobs"] == b["logprobs"]
    assert a["metrics"] == b["metrics"]
    assert set(a["grads"]) == set(b["grads"])
    for name, g in a["grads"].items():
        assert torch.equal(g, b["grads"][name]), name


@pytest.mark.parametrize("variant", ["full_uniform", "full_uniform_all", "full_block", "selective"])
def test_recompute_is_bit_identical_to_the_plain_run_tp1(tp1, variant):
    assert tp1[variant]["recompute"] == ("selective" if variant == "selective" else "full")
    assert tp1["plain"]["recompute"] is None
    assert tp1["plain"]["metrics"]["loss"] != 0.0 and sum(float(g.abs().sum()) for g in tp1["plain"]["grads"].values()) > 0
    _bit_identical(tp1[variant], tp1["plain"])


def test_recompute_is_bit_identical_to_the_plain_run_tp2_and_pp2(tp2, pp2):
    assert tp2["sp_full_block"]["recompute"] == "full" and tp2["sp_selective"]["recompute"] == "selective"
    _bit_identical(tp2["sp_full_block"], tp2["sp"])
    _bit_identical(tp2["sp_selective"], tp2["sp"])
    assert pp2["full_block"]["recompute"] == "full"
    _bit_identical(pp2["full_block"], pp2["plain"])
    assert pp2["full_block"]["saved"] < pp2["plain"]["saved"] / 5  # rank 0 (stage 1) checkpoints its layer


def test_sequence_parallel_matches_tp2_without_it(tp2, tp1):
    sp, plain = tp2["sp"], tp2["plain"]
    assert sp["sequence_parallel"] and not plain["sequence_parallel"]
    # with it, 2 layers x 2 norms + the final norm carry the marker by which Megatron sums their grads over TP
    assert sp["sp_norm_weights"] == 5 and plain["sp_norm_weights"] == 0
    diff = max(abs(x - y) for i in plain["logprobs"] for x, y in zip(sp["logprobs"][i], plain["logprobs"][i]))
    assert diff < 1e-5
    assert sp["metrics"]["loss"] == pytest.approx(plain["metrics"]["loss"], abs=1e-6)
    for name, g in plain["grads"].items():
        assert torch.allclose(sp["grads"][name], g, atol=1e-6, rtol=1e-4), name
        assert torch.allclose(g, tp1["plain"]["grads"][name], atol=1e-6, rtol=1e-4), name  # and TP=2 is TP=1


def test_full_recompute_keeps_one_hidden_vector_per_token_per_layer(tp1, model_dir):
    from megatron_sortedrl.trainer.model import read_hf_config

    arch = read_hf_config(model_dir)
    plain, full, block, sel = (tp1[k]["saved"] for k in ("plain", "full_uniform", "full_block", "selective"))
    hidden = tp1["plain"]["tokens"] * arch.hidden_size * 4  # one float32 hidden vector per token
    rope = tp1["plain"]["tokens"] * arch.head_dim * 4  # upper bound on the rotary table a checkpoint gets
    print(f"\nsaved for backward per layer: plain {plain / arch.num_layers / hidden:.1f}, selective "
          f"{sel / arch.num_layers / hidden:.1f}, full block(1) {block / arch.num_layers / hidden:.1f}, "
          f"full uniform(1) {full / arch.num_layers / hidden:.2f} hidden vectors per token")
    assert arch.num_layers * hidden <= full <= arch.num_layers * (hidden + rope)
    assert full < plain / 5
    # block(1) of 2 layers: one layer checkpointed, the other keeps what the plain run keeps
    assert 2 * block == plain + full
    assert sel < plain  # the attention core (scores, probabilities) is recomputed


def test_cpu_runs_without_fused_kernels_or_overlapped_reduction(tp1, tp2, pp2):
    for res in (*tp1.values(), *tp2.values(), *pp2.values()):
        assert res["fusions"] == dict.fromkeys(FUSIONS, False)
        assert res["overlap"] == (False, False)


# ---------------------------------------------------------------- configs only (no process groups, no CUDA)

QWEN25_32B = {"model_type": "qwen2", "vocab_size": 152064, "hidden_size": 5120, "intermediate_size": 27648,
              "num_layers": 64, "num_heads": 40, "num_kv_heads": 8, "head_dim": 128, "rms_norm_eps": 1e-5,
              "rope_theta": 1e6, "max_position_embeddings": 131072, "tie_word_embeddings": False, "qkv_bias": True}


def _rc(granularity="none", method="uniform", num_layers=1):
    from megatron_sortedrl.config import RecomputeConfig

    return RecomputeConfig(granularity=granularity, method=method, num_layers=num_layers)


@pytest.mark.parametrize("rc, expected", [
    (None, (None, None, None)),
    (_rc("none"), (None, None, None)),
    (_rc("auto"), (None, None, None)),  # not resolved by a launch planner: no recompute
    (_rc("selective"), ("selective", None, None)),
    (_rc("full", "uniform", 4), ("full", "uniform", 4)),
    (_rc("full", "block", 99), ("full", "block", 32)),  # at most the stage's 64 / PP2 layers
])
def test_recompute_settings_reach_megatron(rc, expected):
    from megatron_sortedrl.trainer.model import HFArch, transformer_config

    c = transformer_config(HFArch(**QWEN25_32B), torch.bfloat16, tp=8, pp=2, sequence_parallel=True, recompute=rc)
    assert (c.recompute_granularity, c.recompute_method, c.recompute_num_layers) == expected
    if expected[0] == "selective":
        assert c.recompute_modules == ["core_attn"]


def test_gpu_config_turns_fusions_and_overlap_on(monkeypatch):
    """The flagship layout's GPU TransformerConfig and DDP config, built here without touching CUDA
    (every kernel probe reported working, as on a GPU machine with TE, Apex and a compiler)."""
    from megatron.core.models.common.embeddings import rope_utils

    from megatron_sortedrl.config import RunConfig
    from megatron_sortedrl.trainer import kernels
    from megatron_sortedrl.trainer import model as M
    from megatron_sortedrl.trainer.worker import ddp_config

    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb", lambda *a, **k: None)  # TE's, for the check
    probes = kernels.KernelProbes(*(kernels.Probe(True),) * 5)
    c = M.transformer_config(M.HFArch(**QWEN25_32B), torch.bfloat16, tp=8, pp=2, sequence_parallel=True,
                             on_gpu=True, recompute=_rc("full", "uniform", 1),
                             fusions=M.kernel_fusions(True, probes))
    assert {k: getattr(c, k) for k in FUSIONS} == dict.fromkeys(FUSIONS, True)
    assert not c.persist_layer_norm and not c.use_cpu_initialization and c.sequence_parallel
    cfg = RunConfig()
    cfg.parallel.use_distributed_optimizer = True
    d = ddp_config(cfg, True, 4)
    assert d.overlap_grad_reduce and d.use_distributed_optimizer and d.bucket_size == 40_000_000
    assert not d.overlap_param_gather  # weights are read right after each update (see ddp_config)
    assert ddp_config(cfg, True, 64).bucket_size == 64_000_000


def test_gpu_config_without_kernels_leaves_fusions_off(monkeypatch):
    """A GPU config where no kernel loads (this machine: no CUDA, TE or Apex) turns every fusion off; it used
    to turn the masked-softmax and jit fusions on by device type alone."""
    from megatron_sortedrl.trainer import kernels
    from megatron_sortedrl.trainer import model as M

    monkeypatch.setattr(kernels, "block_transformer_engine", lambda: None)  # leave sys.modules alone
    kernels.probe_kernels.cache_clear()
    try:
        c = M.transformer_config(M.HFArch(**QWEN25_32B), torch.bfloat16, tp=8, on_gpu=True)
    finally:
        kernels.probe_kernels.cache_clear()
    assert {k: getattr(c, k) for k in FUSIONS} == dict.fromkeys(FUSIONS, False)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_gpu_recompute_with_fusions_and_overlap(model_dir, tmp_path):
    """One GPU, TE spec, float32: recompute under the fused kernels and the overlapped reduction. TE's
    fused attention may pick other kernels for the recomputed forward, so equality is to float32 rounding
    here, not bitwise."""
    pytest.importorskip("transformer_engine.pytorch")
    variants = {k: TP1_VARIANTS[k] for k in ("plain", "full_uniform", "selective")}
    res = _measure(tmp_path, model_dir, 1, variants, device="gpu")
    plain = res["plain"]
    assert plain["fusions"] == {k: plain["probed"][k] for k in FUSIONS}  # each fusion on where its kernel works
    assert plain["overlap"] == (True, False)
    for name in ("full_uniform", "selective"):
        got = res[name]
        diff = max(abs(x - y) for i in plain["logprobs"] for x, y in zip(got["logprobs"][i], plain["logprobs"][i]))
        assert diff < 1e-4, name
        for k, g in plain["grads"].items():
            assert torch.allclose(got["grads"][k], g, atol=1e-5, rtol=1e-3), (name, k)
    assert res["full_uniform"]["saved"] < plain["saved"] / 5
