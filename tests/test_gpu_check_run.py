"""gpu-check as the first GPU machine will run it, rehearsed on CPU: a budget it enforces itself, its JSON valid
after every test (and after a kill), results in the folder given, and GPU tests that skip on the bare image.

    python -m pytest tests/test_gpu_check_run.py -q              # CPU, about a minute
    python -m pytest tests/test_gpu_check_run.py -q -m slow      # + the whole documented command, --cpu-smoke

The tests it runs here are small files written by the test (one passes, one hangs), so the budget and the kill
are exercised in seconds; `--tests` points the check at them. The rehearsal (slow) is the documented command
itself with its default budget.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
CHECK = REPO / "tools" / "gpu_check.py"

TESTS = '''
import json, os, time
import pytest

pytestmark = pytest.mark.gpu

def test_quick():
    pass

def test_sees_the_record_so_far():
    data = json.loads(open(os.environ["MSRL_GPU_CHECK_JSON"]).read())
    assert data["running"].endswith("::test_sees_the_record_so_far")
    assert [t["test"] for t in data["tests"] if t["test"].startswith("test_fake_gpu")] == ["test_fake_gpu::test_quick"]

def test_hangs():
    time.sleep(300)

def test_never_reached():
    pass
'''


SKIPPED_FILE = '''
import pytest

pytestmark = pytest.mark.gpu
ray = pytest.importorskip("no_such_engine_stack")

def test_needs_it():
    pass
'''
BROKEN_FILE = "import no_such_module_at_all\n"


def _check(tmp_path, *args, timeout=120, **popen):
    (tmp_path / "test_fake_gpu.py").write_text(TESTS)
    (tmp_path / "test_fake_skip.py").write_text(SKIPPED_FILE)
    (tmp_path / "test_fake_broken.py").write_text(BROKEN_FILE)
    out = tmp_path / "out"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    env.pop("OUT", None)
    cmd = [sys.executable, str(CHECK), "--cpu-smoke", "--skip-bench", "--out-dir", str(out),
           "--tests", *(str(tmp_path / f"test_fake_{n}.py") for n in ("broken", "skip", "gpu")), *args]
    if popen:
        return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True), out
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout), out


def test_the_budget_is_enforced_and_the_json_names_the_test_that_hung(tmp_path):
    t0 = time.monotonic()
    res, out = _check(tmp_path, "--budget-s", "25")
    assert time.monotonic() - t0 < 60, "the check outlived its budget"
    assert res.returncode == 1, res.stdout[-2000:]
    data = json.loads((out / "gpu_check.json").read_text())
    assert data["status"] == "done" and data["cpu_smoke"] and data["budget_s"] == 25
    got = {t["test"]: t["outcome"] for t in data["tests"]}
    # a file skipped or broken at import is listed under its name, and the files after it still run
    assert got == {"test_fake_broken": "failed", "test_fake_skip": "skipped",
                   "test_fake_gpu::test_quick": "passed", "test_fake_gpu::test_sees_the_record_so_far": "passed",
                   "test_fake_gpu::test_hangs": "failed"}  # the one after it never ran
    details = {t["test"]: t["detail"] for t in data["tests"]}
    assert "no_such_engine_stack" in details["test_fake_skip"] and "no_such_module_at_all" in details["test_fake_broken"]
    assert "killed at the check's budget" in details["test_fake_gpu::test_hangs"]
    assert (out / "gpu_tests.log").is_file() and len(list(out.iterdir())) <= 8
    assert 0 < data["carried_mib"] < 64


def test_a_check_killed_from_outside_leaves_valid_json(tmp_path):
    """The machine's own limit may kill the check mid-test: the JSON on disk is whole and says how far it got."""
    proc, out = _check(tmp_path, "--budget-s", "300", popen=True)
    path = out / "gpu_check.json"
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            data = json.loads(path.read_text()) if path.is_file() else {}
            if (data.get("running") or "").endswith("::test_hangs"):
                break
            time.sleep(0.2)
        else:
            pytest.fail("the check never reached test_hangs")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    data = json.loads(path.read_text())
    assert data["status"] == "running" and data["running"] == "test_fake_gpu::test_hangs"
    assert [t["outcome"] for t in data["tests"]] == ["failed", "skipped", "passed", "passed"]


def test_results_go_to_OUT_when_it_is_set(tmp_path, monkeypatch):
    sys.path.insert(0, str(REPO / "tools"))
    try:
        import gpu_check
    finally:
        sys.path.remove(str(REPO / "tools"))
    monkeypatch.setenv("OUT", str(tmp_path / "handed_back"))
    assert gpu_check.default_out_dir() == tmp_path / "handed_back"
    monkeypatch.delenv("OUT")
    assert gpu_check.default_out_dir() == REPO / "docs" / "benchmarks"


FAKE_IMAGE = '''
"""The GPU image as the tests see it: CUDA present, no Ray, vLLM or Transformer Engine installed."""
import sys

import torch

torch.cuda.is_available = lambda: True


class _NotInstalled:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("ray", "vllm", "transformer_engine"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, _NotInstalled())
'''


def test_colocated_gpu_tests_skip_on_an_image_without_ray_or_vllm(tmp_path):
    (tmp_path / "fake_image.py").write_text(FAKE_IMAGE)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])}
    res = subprocess.run([sys.executable, "-m", "pytest", "-p", "fake_image", "tests/test_colocate_gpu.py", "-m", "gpu",
                          "-k", "engine or colocated", "-q", "-rA", "-p", "no:cacheprovider"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=300)
    assert "3 skipped" in res.stdout and "failed" not in res.stdout, res.stdout[-3000:]
    assert "SKIPPED [3] tests/test_colocate_gpu.py" in res.stdout and "needs CUDA vLLM" in res.stdout


@pytest.mark.slow
def test_the_documented_command_rehearsed_on_cpu(tmp_path):
    """`python tools/gpu_check.py --cpu-smoke --out-dir DIR`: every gpu test file, the benchmark at a tiny size,
    inside the default budget, with at most 8 files to bring back."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    t0 = time.monotonic()
    res = subprocess.run([sys.executable, str(CHECK), "--cpu-smoke", "--out-dir", str(tmp_path)], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=600)
    data = json.loads((tmp_path / "gpu_check.json").read_text())
    assert res.returncode == 0, res.stdout[-3000:]
    assert data["status"] == "done" and time.monotonic() - t0 < data["budget_s"]
    assert data["benchmark"]["outcome"] == "passed" and {t["outcome"] for t in data["tests"]} == {"skipped"}
    assert len(data["tests"]) >= 7 and len(list(tmp_path.iterdir())) <= 8
