"""The GPU path's contract with the exact CUDA packages it runs with, checked on CPU by reading their source.

    .venv/bin/python -m pytest tests/test_gpu_contract.py -q          # first run downloads ~340 MB (cached)

`tools/gpu_contract.py` derives every vLLM / Transformer Engine / megatron-core name our code uses from
our own modules and looks each up in the pinned wheels (pip download into $MSRL_CONTRACT_CACHE, never
installed or imported). Here: our code passes against the pins; a new call is checked without listing it
anywhere; and a deliberately altered copy of one module (a removed function, method, field, literal or
class) makes the check fail naming the missing name and our call site. Skipped only when the package
index cannot be reached.
"""

from __future__ import annotations

import ast
import importlib.util
import re
import shutil
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("gpu_contract", REPO / "tools" / "gpu_contract.py")
gc = sys.modules.setdefault("gpu_contract", importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(gc)


@pytest.fixture(scope="module")
def roots():
    try:
        return gc.default_roots()
    except gc.RegistryUnreachable as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def report(roots):
    return gc.check(roots)


def test_our_gpu_code_matches_the_pinned_packages(report):
    assert report.problems == []
    # Line numbers move with every edit of our files; the sample below names the file and the use.
    uses = re.sub(r"\.py:\d+:", ".py:", "\n".join(report.uses))
    # Each kind of use is found in our code, not listed by hand: a sample of each.
    for expected in [
        "weight_sync_gpu.py: from vllm.distributed.weight_transfer.nccl_common import trainer_init",
        "collective_rpc('init_weight_transfer_engine') -> vLLM Worker.init_weight_transfer_engine",
        "collective_rpc('update_weights') -> vLLM Worker.update_weights",
        "AsyncEngineArgs(weight_transfer_config=...)",
        "AsyncEngineArgs.weight_transfer_config['backend']",
        "SpeculativeConfig(method=...)",
        ("transfer_init payload ['master_address', 'master_port', 'packed', 'rank_offset', 'world_size'] -> "
         "vllm.distributed.weight_transfer.nccl_common.NCCLWeightTransferInitInfo (nccl)"),
        ("transfer_update payload ['dtype_names', 'ipc_handles', 'names', 'shapes'] -> "
         "vllm.distributed.weight_transfer.ipc_engine.IPCWeightTransferUpdateInfo (ipc)"),
        "call vllm.v1.engine.async_llm.AsyncLLM.pause_generation",
        "vllm.v1.worker.gpu_worker.Worker.model_runner",
        "HistoSpecProposer.propose called by vllm:vllm.v1.worker.gpu_model_runner",
        "HistoSpecProposer(...) built by vllm.v1.spec_decode.custom_class_proposer.create_custom_proposer",
        "megatron.core.models.gpt.gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec",
        "TELayerNormColumnParallelLinear subclasses te.pytorch.LayerNormLinear",
    ]:
        assert expected in uses, expected
    assert len(report.uses) > 150


def test_a_new_call_is_checked_without_listing_it(roots):
    """Code added later is checked too: a misspelled keyword in a new module and a new engine argument."""
    files = gc.our_files()
    files["megatron_sortedrl/rollout/new_gpu_code.py"] = ast.parse(
        "from vllm.sampling_params import SamplingParams\n"
        "from megatron_sortedrl.rollout.engine_worker import engine_kwargs\n"
        "def f():\n"
        "    return SamplingParams(temprature=1.0), engine_kwargs('m', enable_prefix_cachin=True)\n")
    problems = gc.check(roots, files=files).problems
    assert any(p.startswith("megatron_sortedrl/rollout/new_gpu_code.py:4: vllm.sampling_params.SamplingParams"
                            "(temprature=...)") for p in problems), problems
    assert any("new_gpu_code.py:4: AsyncEngineArgs(enable_prefix_cachin=...)" in p for p in problems), problems
    assert len(problems) == 2


# (module, text in it, replacement, what the failure names, our call site)
ALTERATIONS = {
    "removed function": ("vllm.distributed.weight_transfer.nccl_common", "def trainer_init(", "def trainer_init_v2(",
                         "nccl_common has no trainer_init", "megatron_sortedrl/rollout/weight_sync_gpu.py:"),
    "removed worker method": ("vllm.v1.worker.gpu_worker", "def update_weights(", "def apply_weights(",
                              "collective_rpc('update_weights')", "megatron_sortedrl/rollout/engine_worker.py:"),
    "removed engine argument": ("vllm.engine.arg_utils", "    weight_transfer_config: WeightTransferConfig | None",
                                "    weight_sync_config: WeightTransferConfig | None",
                                "AsyncEngineArgs(weight_transfer_config=...)",
                                "megatron_sortedrl/rollout/engine_worker.py:"),
    "renamed payload field": ("vllm.distributed.weight_transfer.nccl_common", "    rank_offset: int\n",
                              "    rank_start: int\n", "NCCLWeightTransferInitInfo requires ['rank_start']",
                              "megatron_sortedrl/rollout/weight_sync_gpu.py:"),
    "dropped literal": ("vllm.v1.engine", 'PauseMode = Literal["abort", "wait", "keep"]',
                        'PauseMode = Literal["abort", "wait"]', "pause_generation(mode='keep')",
                        "megatron_sortedrl/rollout/engine_worker.py:"),
    "changed proposer call": ("vllm.v1.worker.gpu_model_runner", "cast(Any, self.drafter).propose(\n",
                              "cast(Any, self.drafter).propose(\n                num_spec_tokens_to_schedule,\n",
                              "HistoSpecProposer.propose(slot_mappings=...) - got multiple values",
                              "speculative/proposer.py:"),
    "removed TE class": ("transformer_engine.pytorch",
                         "from transformer_engine.pytorch.module import LayerNormLinear\n", "",
                         "TELayerNormColumnParallelLinear(te.pytorch.LayerNormLinear)",
                         "megatron:megatron.core.extensions.transformer_engine:"),
}


@pytest.mark.parametrize("case", list(ALTERATIONS))
def test_an_altered_module_fails_naming_the_name_and_our_call_site(roots, tmp_path, case):
    module, old, new, names, site = ALTERATIONS[case]
    tree = gc.SourceTree(roots)
    text = tree.path(module).read_text()
    assert old in text, f"{module} changed; update this test's alteration"
    altered = tmp_path / f"{module.rpartition('.')[2]}.py"
    altered.write_text(text.replace(old, new, 1))
    problems = gc.check(roots, overlay={module: altered}).problems
    hits = [p for p in problems if names in p and p.startswith(site)]
    assert hits, f"expected a problem naming {names!r} at {site}; got {problems}"


def test_the_gpu_extra_pins_what_is_checked():
    text = (REPO / "pyproject.toml").read_text()
    gpu = re.search(r"^gpu = \[(.*)\]$", text, re.MULTILINE).group(1)
    assert f'"vllm=={gc.PINS["vllm"]}"' in gpu
    assert f'"transformer-engine[pytorch]=={gc.PINS["transformer-engine"]}"' in gpu


def test_the_download_is_cached_by_version(roots, tmp_path, monkeypatch):
    """A second fetch of a cached version runs no pip; an unreachable index is the one reason to skip."""
    cache = tmp_path / "cache"
    src = cache / "vllm-0.0.0" / "src"
    src.mkdir(parents=True)
    (cache / "vllm-0.0.0" / "COMPLETE").write_text("vllm==0.0.0\n")
    monkeypatch.setattr(gc.subprocess, "run", lambda *a, **k: pytest.fail("pip ran for a cached version"))
    assert gc.fetch_sources("vllm", "0.0.0", cache) == src
    monkeypatch.setattr(gc.subprocess, "run", lambda *a, **k: type("R", (), {"returncode": 1, "stderr": "x"})())
    monkeypatch.setattr(gc, "_registry_reachable", lambda host="pypi.org": False)
    with pytest.raises(gc.RegistryUnreachable, match="unreachable"):
        gc.fetch_sources("vllm", "0.0.1", cache)
    shutil.rmtree(cache)
