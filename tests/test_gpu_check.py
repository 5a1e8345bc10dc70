"""`make gpu-check` where there is no GPU, and the parts of it that need none: the page it rewrites and the
model arithmetic of its benchmark.

    .venv/bin/python -m pytest tests/test_gpu_check.py -q        # CPU, a few seconds

The GPU run itself is `make gpu-check` on a machine with an NVIDIA GPU (docs/gpu.md).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = sys.modules.setdefault(name, importlib.util.module_from_spec(spec))
    spec.loader.exec_module(mod)
    return mod


gpu_check = _load("gpu_check", REPO / "tools" / "gpu_check.py")
gpu_trainer = _load("gpu_trainer_bench", REPO / "benchmarks" / "gpu_trainer.py")


def test_make_gpu_check_without_a_gpu_says_so_in_one_line():
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    res = subprocess.run(["make", "--no-print-directory", "gpu-check", f"GPU_PY={sys.executable}"], cwd=REPO,
                         env=env, capture_output=True, text=True, timeout=120, check=False)
    assert res.returncode == 2
    assert res.stdout.splitlines() == [
        "gpu-check: no NVIDIA GPU visible (torch.cuda.is_available() is False); nothing to check on this machine"]
    assert "Traceback" not in res.stderr
    assert not (REPO / ".gpu-check").exists()  # nothing installed, nothing written


def test_the_doc_section_is_rewritten_in_place(tmp_path):
    doc = tmp_path / "gpu.md"
    original = (REPO / "docs" / "gpu.md").read_text()
    doc.write_text(original)
    result = {
        "environment": {"time_utc": "2026-01-01 00:00", "device": "NVIDIA H100 80GB HBM3", "device_count": 1,
                        "memory_gib": 79.1, "driver": "560.35", "cuda_runtime": "12.8", "python": "3.11.9",
                        "versions": {"torch": "2.9.0", "megatron-core": "0.16.1", "vllm": None}},
        "tests": [{"test": "test_trainer_gpu::test_x", "outcome": "passed", "seconds": 3.2, "detail": ""},
                  {"test": "test_rollout_gpu::test_y", "outcome": "skipped", "seconds": 0.0,
                   "detail": "could not import 'ray'"}],
        "benchmark": {"outcome": "passed", "tokens_per_s": {"megatron": 51234.5}, "mfu": {"megatron": 0.3512},
                      "speedup_vs_baseline": 1.31, "layer_spec": "local", "nvml_ms_per_sample": 0.42},
    }
    gpu_check.update_doc(result, doc)
    once = doc.read_text()
    gpu_check.update_doc(result, doc)
    assert doc.read_text() == once  # idempotent: the section is replaced, not appended
    head, _, rest = once.partition(gpu_check.BEGIN)
    section, _, tail = rest.partition(gpu_check.END)
    assert head == original.partition(gpu_check.BEGIN)[0] and tail == original.partition(gpu_check.END)[2]
    assert "NVIDIA H100 80GB HBM3" in section and "megatron-core 0.16.1" in section and "vllm" not in section
    assert "| `test_rollout_gpu::test_y` | skipped | 0.0 | could not import 'ray' |" in section
    assert "51234 tokens/s, MFU 35.1 %, 1.31x a transformers + AdamW loop" in section


def _probe_wheel(dest: Path, name: str = "msrl_carried_probe") -> Path:
    """A minimal pure-Python wheel (what `pip install --no-index` accepts offline)."""
    import zipfile

    whl = dest / f"{name}-1.0-py3-none-any.whl"
    info = f"{name}-1.0.dist-info"
    files = {f"{name}.py": "VALUE = 42\n",
             f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n",
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    files[f"{info}/RECORD"] = "".join(f"{k},,\n" for k in files) + f"{info}/RECORD,,\n"
    with zipfile.ZipFile(whl, "w") as z:
        for k, v in files.items():
            z.writestr(k, v)
    return whl


def test_carried_wheels_fill_only_what_is_missing(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
    wheels, site = tmp_path / "wheels", tmp_path / "site"
    wheels.mkdir()
    _probe_wheel(wheels)
    # A wheel of an installed distribution is left alone (here: the pytest that runs this test).
    (wheels / f"pytest-{pytest.__version__}-py3-none-any.whl").write_bytes(b"not read")
    assert gpu_check.install_carried(wheels, site) == ["msrl-carried-probe"]
    assert (site / "msrl_carried_probe.py").is_file() and not (site / "pytest").exists()
    assert sys.path[0] == str(site) and str(site) in os.environ["PYTHONPATH"].split(os.pathsep)
    assert gpu_check.install_carried(wheels, site) == []  # now installed (in site): nothing to do


def test_a_run_records_each_gpu_test_and_its_outcome(tmp_path, monkeypatch):
    """The whole command past the GPU probe, here where every gpu test skips: the JSON lists each test
    with its outcome and reason, the page gets the table, and skips alone are not a failure."""
    import json

    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # only the probe in this process
    monkeypatch.setattr(gpu_check, "environment", lambda: {"time_utc": "t", "python": "3", "versions": {}})
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # the pytest it starts sees no GPU
    # no carried wheels (a checkout may hold some fetched for another Python)
    monkeypatch.setattr(gpu_check.install_carried, "__defaults__", (tmp_path / "wheels", tmp_path / "site"))
    doc = tmp_path / "gpu.md"
    doc.write_text((REPO / "docs" / "gpu.md").read_text())
    rc = gpu_check.main(["--skip-bench", "--out-dir", str(tmp_path), "--doc", str(doc)])
    assert rc == 0
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    tests = result["tests"]
    assert {t["outcome"] for t in tests} == {"skipped"} and all(t["detail"] for t in tests)
    names = {t["test"] for t in tests}
    assert "test_trainer_gpu::test_single_rank_bf16_logprobs_match_transformers" in names
    assert "test_telemetry_nvml::test_sampler_sees_a_matmul_load_on_a_real_gpu" in names
    assert len(tests) >= 7 and "| skipped |" in doc.read_text()


def test_every_file_with_gpu_tests_is_run():
    """Found by scanning, so a GPU test added to any file is run: every file that marks a test `gpu`."""
    found = gpu_check.gpu_test_files()
    marked = sorted(f"tests/{p.name}" for p in (REPO / "tests").glob("test_*.py")
                    if "mark.gpu" in p.read_text())
    assert found == marked
    assert {"tests/test_rollout_gpu.py", "tests/test_telemetry_nvml.py", "tests/test_trainer_gpu.py",
            "tests/test_trainer_recompute.py", "tests/test_weight_sync_gpu.py"} <= set(found)


def test_benchmark_model_is_the_05b_shape_and_flops_follow_the_formula():
    cfg = gpu_trainer.QWEN2_05B
    assert gpu_trainer.num_params(cfg) == 494_032_768  # Qwen2.5-0.5B's published parameter count
    tiny = {**cfg, "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
            "num_key_value_heads": 1, "vocab_size": 10}
    # linear weights: q 8x8, k/v 8x4 each, o 8x8, mlp 3x8x16, output 10x8 = 64+64+64+384+80 = 656
    # attention per token (causal forward): 2 x seq(4) x q(8) = 64; training = 3 x forward
    assert gpu_trainer.flops_per_step(tiny, seqs=2, seq_len=4) == 3 * 2 * 4 * (2 * 656 + 64)
    assert gpu_trainer.peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert gpu_trainer.peak_flops("NVIDIA H100 PCIe") == 756e12 and gpu_trainer.peak_flops("Some GPU") is None


@pytest.mark.slow
def test_the_gpu_benchmark_script_runs_end_to_end_on_cpu(tmp_path):
    """`--cpu-smoke`: the whole script (model, our trainer vs the baseline, sampled loop, JSON, figure) at a
    tiny size, so a broken script is not first found on a lent GPU. Measures nothing."""
    res = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_trainer.py"), "--cpu-smoke",
                          "--out-dir", str(tmp_path)], env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
                         capture_output=True, text=True, timeout=600, check=False)
    assert res.returncode == 0, res.stderr[-3000:]
    import json

    data = json.loads((tmp_path / "gpu_trainer.json").read_text())
    assert data["cpu_smoke"] and data["trainer"]["device"] == "cpu" and data["mfu"] is None
    assert all(x > 0 for x in data["tokens_per_s"].values())
    assert data["losses"]["megatron"][0] > 1.0  # log(512) = 6.2 for a random model: the loss covers tokens
    assert data["nvml"]["report"]["sampled"] is False and data["nvml"]["report"]["reason"]
    assert (tmp_path / "gpu_trainer.png").stat().st_size > 10_000


def test_wheels_fetched_for_another_python_are_refused_in_one_line(tmp_path, monkeypatch, capsys):
    """--fetch-wheels records the Python it resolved for; cp312 wheels would not install on 3.11 (and pip's
    error would come as a traceback of the check), so the check names both versions and the command."""
    import torch

    wheels, site = tmp_path / "wheels", tmp_path / "site"
    wheels.mkdir()
    _probe_wheel(wheels)
    (wheels / "PYTHON").write_text("2.7\n")
    with pytest.raises(gpu_check.WheelsMismatch, match="for Python 2.7"):
        gpu_check.install_carried(wheels, site)
    assert not site.exists()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gpu_check, "WHEELS", wheels)
    monkeypatch.setattr(gpu_check.install_carried, "__defaults__", (wheels, site))
    assert gpu_check.main(["--skip-bench", "--out-dir", str(tmp_path)]) == 2
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 1 and "--fetch-wheels --python-version" in out[0]
