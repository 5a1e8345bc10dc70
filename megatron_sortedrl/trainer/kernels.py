"""Which fused kernels this process can actually run: probed once at trainer start, not assumed from the device.

    from megatron_sortedrl.trainer.kernels import probe_transformer_engine, probe_kernels
    te = probe_transformer_engine()          # before the first megatron import of the process (see below)
    probes = probe_kernels("cuda:0", te=te)  # after torch.cuda.set_device; cached per device
    print(probes.line())                     # one line: what was found, why not, which fusions are on
    fusions = probes.fusions()               # TransformerConfig flags (trainer/model.py)

Each megatron-core fusion needs something a GPU image may lack, and megatron finds out only at first use,
mid-step, with an error far from the cause:

* Transformer Engine spec: `transformer_engine.pytorch` must import. The top-level `transformer_engine`
  package swallows a failed `.pytorch` import, so importing it proves nothing: a detection that did so chose
  the TE spec while megatron, whose own TE import had failed, could not build it
  (`NameError: TESpecProvider` in `get_gpt_layer_with_transformer_engine_spec`). The probe imports
  `transformer_engine.pytorch` and builds megatron's TE layer spec. When the import fails it also makes every
  later `import transformer_engine` raise ImportError (a `None` entry in `sys.modules`), because megatron's
  guards catch only ImportError: a TE whose extension fails with OSError would otherwise break megatron's
  own imports, and with them the local spec the trainer falls back to. So it must run before megatron is
  first imported in the process.
* masked_softmax_fusion: megatron's `FusedScaleMaskSoftmax` calls Apex's `scaled_*_softmax_cuda` extensions
  for bf16/fp16 scores with 16 < key length <= 4096 and batch x heads % 4 == 0 (ModuleNotFoundError without
  Apex); the probe imports the three extensions.
* bias_activation_fusion (SwiGLU) and bias_dropout_fusion: megatron-core 0.16 wraps them in `torch.compile`,
  whose first call needs a C compiler and Python's headers (Triton builds a launcher; inductor on CPU a C++
  module). The probe looks for both, then compiles and runs a throwaway function on the device.
* apply_rope_fusion (TE's fused RoPE) and gradient_accumulation_fusion (Apex's
  `fused_weight_gradient_mlp_cuda`): megatron's own availability flags, which it checks at config time.

On CPU nothing is probed and every fusion stays off: the kernels are CUDA kernels, and compiling the jit
fusions there would recompile for every micro-batch shape for no gain. Left out: persist_layer_norm (Apex's
LayerNorm only; these models use RMSNorm) and cross_entropy_loss_fusion (the trainer computes its own
log-probs from the logits).
"""

from __future__ import annotations

import functools
import importlib
import os
import shutil
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

APEX_SOFTMAX_MODULES = ("scaled_upper_triang_masked_softmax_cuda", "scaled_masked_softmax_cuda", "scaled_softmax_cuda")
FUSION_FLAGS = ("bias_activation_fusion", "bias_dropout_fusion", "masked_softmax_fusion", "apply_rope_fusion",
                "gradient_accumulation_fusion", "persist_layer_norm", "cross_entropy_loss_fusion")


@dataclass(frozen=True)
class Probe:
    ok: bool
    why: str = ""  # when not ok: one line, the cause; when ok: optional detail (a version)

    def show(self) -> str:
        if self.ok:
            return f"yes ({self.why})" if self.why else "yes"
        return f"no ({self.why})"


NOT_PROBED = Probe(False, "cpu")


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:160]}" if text else type(exc).__name__


def block_transformer_engine() -> None:
    """Makes every later `import transformer_engine[.pytorch]` raise ImportError, the only error megatron's
    guards handle, so megatron imports cleanly without TE and the local spec can be built."""
    for name in [m for m in sys.modules if m == "transformer_engine" or m.startswith("transformer_engine.")]:
        del sys.modules[name]
    sys.modules["transformer_engine"] = None  # type: ignore[assignment]
    sys.modules["transformer_engine.pytorch"] = None  # type: ignore[assignment]


def probe_transformer_engine(block_if_broken: bool = True) -> Probe:
    """Whether megatron's Transformer Engine layer spec can be used here (see the module docstring)."""
    try:
        te_pytorch = importlib.import_module("transformer_engine.pytorch")
    except Exception as exc:  # ImportError, but also OSError / RuntimeError from TE's extension loader
        if block_if_broken:
            block_transformer_engine()
        return Probe(False, f"transformer_engine.pytorch does not import: {_one_line(exc)}")
    try:
        from megatron.core.models.gpt import gpt_layer_specs

        if not getattr(gpt_layer_specs, "HAVE_TE", False):
            return Probe(False, "megatron-core could not import its Transformer Engine extension "
                                "(megatron.core.extensions.transformer_engine)")
        gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec()
    except Exception as exc:
        return Probe(False, f"megatron-core's Transformer Engine spec fails: {_one_line(exc)}")
    version = getattr(sys.modules.get("transformer_engine"), "__version__", None) or getattr(
        te_pytorch, "__version__", "")
    return Probe(True, str(version))


def probe_apex_softmax() -> Probe:
    """Apex's fused masked-softmax extensions, which megatron's FusedScaleMaskSoftmax imports at first use."""
    for name in APEX_SOFTMAX_MODULES:
        try:
            importlib.import_module(name)
        except Exception as exc:
            return Probe(False, f"{name}: {_one_line(exc)}")
    return Probe(True)


def c_compiler() -> str | None:
    """The C compiler Triton (and inductor) would use: $CC, else gcc, else clang, else cc."""
    for name in (os.environ.get("CC"), "gcc", "clang", "cc"):
        if name and (found := shutil.which(name)):
            return found
    return None


def python_headers() -> Path | None:
    """Python.h of this interpreter, which the compiled launchers include."""
    for key in ("include", "platinclude"):
        path = sysconfig.get_paths().get(key)
        if path and (Path(path) / "Python.h").is_file():
            return Path(path) / "Python.h"
    return None


def probe_torch_compile(device: str = "cuda") -> Probe:
    """torch.compile's first use on `device`: a C compiler, Python's headers, then a throwaway compile."""
    cc = c_compiler()
    if cc is None:
        return Probe(False, "no C compiler (install gcc or set CC)")
    if python_headers() is None:
        return Probe(False, f"no Python.h under {sysconfig.get_paths().get('include')} (install python3-dev)")
    import torch

    if device.startswith("cuda") and not torch.cuda.is_available():
        # (cpu_compat would send the throwaway tensors to the CPU and prove nothing about the GPU)
        return Probe(False, "no CUDA device")
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32

    def throwaway(x):  # a fresh function each probe: nothing cached stands in for the compile
        return torch.nn.functional.silu(x) * x + 1.0

    try:
        x = torch.linspace(-2, 2, 64, device=device, dtype=dtype)
        got = torch.compile(throwaway, fullgraph=True)(x)
        if not torch.allclose(got.float(), throwaway(x).float(), rtol=1e-2, atol=1e-2):
            return Probe(False, "torch.compile ran but computed a different result")
    except Exception as exc:
        return Probe(False, f"torch.compile failed: {_one_line(exc)}")
    return Probe(True, Path(cc).name)


def _megatron_flag(module: str, attr: str, what: str) -> Probe:
    try:
        value = getattr(importlib.import_module(module), attr)
    except Exception as exc:
        return Probe(False, _one_line(exc))
    return Probe(True) if (value is not None and value is not False) else Probe(False, f"{what} not installed")


@dataclass(frozen=True)
class KernelProbes:
    transformer_engine: Probe
    apex_softmax: Probe
    torch_compile: Probe
    te_rope: Probe
    apex_grad_accum: Probe

    def fusions(self) -> dict[str, bool]:
        """Megatron's TransformerConfig fusion flags: each on exactly when its kernel was found to work."""
        compiled = self.torch_compile.ok
        return {
            "bias_activation_fusion": compiled,
            "bias_dropout_fusion": compiled,
            "masked_softmax_fusion": self.apex_softmax.ok,
            "apply_rope_fusion": self.te_rope.ok,
            "gradient_accumulation_fusion": self.apex_grad_accum.ok,
            "persist_layer_norm": False,
            "cross_entropy_loss_fusion": False,
        }

    def line(self) -> str:
        """The one line printed at trainer start."""
        on = [k.removesuffix("_fusion") for k, v in self.fusions().items() if v]
        probes = [getattr(self, name) for name in self.__dataclass_fields__]
        if all(p is NOT_PROBED for p in probes):
            return "kernels: not probed on CPU -> layer spec local, fusions on: none"
        found = ", ".join(f"{name}={p.show()}" for name, p in zip(self.__dataclass_fields__, probes))
        spec = "transformer_engine" if self.transformer_engine.ok else "local"
        return f"kernels: {found} -> layer spec {spec}, fusions on: {', '.join(on) or 'none'}"


def cpu_probes() -> KernelProbes:
    return KernelProbes(*(NOT_PROBED,) * 5)


def run_probes(device: str = "cuda", te: Probe | None = None) -> KernelProbes:
    """Runs every probe for `device` now (tests call this with "cpu" to exercise the probes themselves).
    `te`: an earlier `probe_transformer_engine()` result (the trainer's, taken before megatron's import)."""
    return KernelProbes(
        transformer_engine=te or probe_transformer_engine(block_if_broken=False),
        apex_softmax=probe_apex_softmax(),
        torch_compile=probe_torch_compile(device),
        te_rope=_megatron_flag("megatron.core.models.common.embeddings.rope_utils", "fused_apply_rotary_pos_emb",
                               "Transformer Engine's fused RoPE (TE >= 1.4)"),
        apex_grad_accum=_megatron_flag("megatron.core.tensor_parallel.layers", "_grad_accum_fusion_available",
                                       "Apex's fused_weight_gradient_mlp_cuda"),
    )


@functools.lru_cache(maxsize=None)
def probe_kernels(device: str = "cuda", te: Probe | None = None) -> KernelProbes:
    """The probes for `device`, run once per process (cached). CPU: nothing probed, everything off."""
    if not device.startswith("cuda"):
        return cpu_probes()
    return run_probes(device, te)
