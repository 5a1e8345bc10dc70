"""Kernel probes: Transformer Engine detection and the fusions megatron-core would use, decided by what loads.

    python -m pytest tests/test_kernels.py -q              # CPU, ~40 s (one real torch.compile)
    python -m pytest tests/test_kernels.py -q -m slow      # + megatron's compiled fusions in a CPU forward
    python -m pytest tests/test_kernels.py -q -m gpu       # on a GPU: the probes' verdicts hold in a bf16 run

A missing kernel is simulated the way it fails on a slim GPU image: an import that raises (a broken
`transformer_engine.pytorch` under an importable top-level package, absent Apex extensions) or no C compiler /
Python headers on the lookup path. Each time the probe says no with the cause, the fusion flag is off in the
TransformerConfig the trainer builds, and that model runs forward on CPU. The probes' positive paths run here
where they can: a real torch.compile of a throwaway function (needs gcc and Python.h, which this machine has),
and the Apex import probe against stand-in modules.
"""

from __future__ import annotations

import importlib.abc
import sys
import types

import pytest
import torch

from helpers import free_port, one_rank_world

from megatron_sortedrl.trainer import kernels

pytest.importorskip("megatron.core")

FUSIONS = ("bias_activation_fusion", "bias_dropout_fusion", "masked_softmax_fusion", "apply_rope_fusion",
           "gradient_accumulation_fusion")


class _FailingExtension(importlib.abc.MetaPathFinder):
    """Makes `import <name>` fail as a TE wheel built against another torch does: OSError from the loader."""

    def __init__(self, name: str) -> None:
        self.name = name

    def find_spec(self, fullname, path, target=None):
        if fullname == self.name:
            raise OSError(f"libtransformer_engine.so: undefined symbol: _ZN3c104cuda9SetDeviceEi ({fullname})")
        return None


@pytest.fixture
def broken_te(monkeypatch):
    """A top-level `transformer_engine` that imports (its __init__ swallows the failure, as TE's does) whose
    `.pytorch` does not."""
    top = types.ModuleType("transformer_engine")
    top.__path__ = []  # a package, so the submodule import reaches the finders
    monkeypatch.setitem(sys.modules, "transformer_engine", top)
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch", None)  # recorded, so it is removed afterwards
    monkeypatch.delitem(sys.modules, "transformer_engine.pytorch")
    finder = _FailingExtension("transformer_engine.pytorch")
    monkeypatch.setattr(sys, "meta_path", [finder, *sys.meta_path])
    return finder


def test_broken_te_is_not_selected_and_is_blocked_for_megatron(broken_te):
    # What the old detection imported: it succeeds. (By name: the fixture's stand-in, not a real import that
    # tools/gpu_image_check.py should require of the GPU image.)
    importlib.import_module("transformer_engine")

    probe = kernels.probe_transformer_engine()
    assert not probe.ok
    assert "transformer_engine.pytorch does not import" in probe.why and "OSError" in probe.why
    assert "\n" not in probe.why
    # megatron guards its TE imports with `except ImportError`: after the probe that is what it gets
    with pytest.raises(ImportError):
        importlib.import_module("transformer_engine.pytorch")
    assert "transformer_engine=no (transformer_engine.pytorch does not import: OSError" in kernels.KernelProbes(
        probe, *(kernels.Probe(False, "x"),) * 4).line()


def test_absent_te_selects_local_spec():
    probe = kernels.probe_transformer_engine(block_if_broken=False)  # TE is not installed here
    assert not probe.ok and "transformer_engine.pytorch does not import" in probe.why


def test_apex_softmax_probe(monkeypatch):
    for name in kernels.APEX_SOFTMAX_MODULES:  # Apex is not installed here; make sure of it
        monkeypatch.setitem(sys.modules, name, None)
    probe = kernels.probe_apex_softmax()
    assert not probe.ok and kernels.APEX_SOFTMAX_MODULES[0] in probe.why
    for name in kernels.APEX_SOFTMAX_MODULES:  # the import path of the probe when the extensions exist
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    assert kernels.probe_apex_softmax().ok


def test_compile_probe_needs_a_compiler_and_headers(monkeypatch):
    monkeypatch.setattr(kernels, "c_compiler", lambda: None)
    probe = kernels.probe_torch_compile("cpu")
    assert not probe.ok and "no C compiler" in probe.why
    monkeypatch.setattr(kernels, "c_compiler", lambda: "/usr/bin/gcc")
    monkeypatch.setattr(kernels, "python_headers", lambda: None)
    probe = kernels.probe_torch_compile("cpu")
    assert not probe.ok and "Python.h" in probe.why


def test_compile_probe_positive_path_runs_here():
    if kernels.c_compiler() is None or kernels.python_headers() is None:
        pytest.skip("this machine has no C compiler or Python headers")
    probe = kernels.probe_torch_compile("cpu")
    assert probe.ok, probe.why


@pytest.fixture(scope="module")
def world():
    yield from one_rank_world()


def _forward(model, arch) -> torch.Tensor:
    tokens = torch.randint(0, arch.vocab_size, (4, 32), generator=torch.Generator().manual_seed(0))
    model.train()  # the training-time fused paths (bias-dropout-add has a train and an inference variant)
    with torch.no_grad():
        return model(tokens, torch.arange(32)[None].expand(4, -1), None)


def test_failed_probes_turn_fusions_off_and_model_runs(world, tiny_model_dir, monkeypatch):
    from megatron_sortedrl.trainer.model import build_model, kernel_fusions, read_hf_config

    monkeypatch.setattr(kernels, "c_compiler", lambda: None)
    for name in kernels.APEX_SOFTMAX_MODULES:
        monkeypatch.setitem(sys.modules, name, None)
    probes = kernels.run_probes("cpu")
    assert not probes.torch_compile.ok and not probes.apex_softmax.ok and not probes.transformer_engine.ok
    fusions = kernel_fusions(True, probes)  # what a GPU trainer with these probes builds
    assert {k: fusions[k] for k in FUSIONS} == dict.fromkeys(FUSIONS, False)
    arch = read_hf_config(tiny_model_dir)
    model = build_model(arch, torch.float32, fusions=fusions)
    assert {k: getattr(model.config, k) for k in FUSIONS} == dict.fromkeys(FUSIONS, False)
    logits = _forward(model, arch)
    assert logits.shape[:2] == (4, 32) and torch.isfinite(logits).all()
    line = probes.line()
    assert "torch_compile=no (no C compiler" in line and line.endswith("fusions on: none") and "\n" not in line


@pytest.mark.slow
def test_passing_compile_probe_turns_megatron_jit_fusions_on_and_they_run(world, tiny_model_dir):
    """The positive path end to end on CPU: the probe passes, megatron's torch.compile'd bias-SwiGLU and
    bias-dropout-add are switched on and compile in a real forward, with the unfused model's logits."""
    from megatron_sortedrl.trainer.model import build_model, read_hf_config
    from megatron_sortedrl.trainer.weights import load_hf_weights

    probes = kernels.run_probes("cpu")
    if not probes.torch_compile.ok:
        pytest.skip(f"torch.compile does not work here: {probes.torch_compile.why}")
    fusions = probes.fusions()
    assert fusions["bias_activation_fusion"] and fusions["bias_dropout_fusion"]
    arch = read_hf_config(tiny_model_dir)
    fused = build_model(arch, torch.float32, fusions=fusions)
    plain = build_model(arch, torch.float32)
    for m in (fused, plain):
        load_hf_weights(m, tiny_model_dir, arch)
    assert fused.config.bias_activation_fusion and not plain.config.bias_activation_fusion
    torch.testing.assert_close(_forward(fused, arch), _forward(plain, arch), rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
def test_probed_fusions_run_on_this_gpu(tmp_path):
    """On a GPU the probes' verdicts hold: the local spec in bf16 with every fusion the probes allow runs a
    forward at a shape that takes Apex's softmax kernel when it is on (key length 64, batch x heads % 4 == 0)
    and compiles the jit fusions when they are on."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_sortedrl.config import TinyModelConfig
    from megatron_sortedrl.tiny_model import build_tiny_model
    from megatron_sortedrl.trainer.model import build_model, read_hf_config

    torch.cuda.set_device(0)
    probes = kernels.probe_kernels("cuda:0")
    print(f"\n{probes.line()}")
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        ps.initialize_model_parallel(1, 1)
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(0)
        arch = read_hf_config(build_tiny_model(tmp_path / "tiny", TinyModelConfig(seed=1)))
        tokens = torch.randint(0, arch.vocab_size, (4, 64), device="cuda")
        positions = torch.arange(64, device="cuda")[None].expand(4, -1)
        for use_te in (False, True) if probes.transformer_engine.ok else (False,):
            model = build_model(arch, torch.bfloat16, use_te=use_te, on_gpu=True, fusions=probes.fusions())
            assert torch.isfinite(model(tokens, positions, None).float()).all(), f"use_te={use_te}"
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()
