"""A benchmark's own Ray head ends with its bootstrap file (benchmarks/ray_head.py).

    pytest tests/test_ray_head.py -q          # CPU, no Ray started: a stand-in process and a temporary file

A head left in Ray's bootstrap file makes every later `ray.init()` without an address join the dead head and
wait forever, so `stop_ray_head` ends the process and removes the file when it names this head (by port: Ray
writes the node's IP there), and leaves it when another head wrote it since.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from benchmarks.ray_head import stop_ray_head


@pytest.fixture
def address_file(tmp_path, monkeypatch):
    import ray._common.utils as ru

    path = tmp_path / "ray_current_cluster"
    monkeypatch.setattr(ru, "get_ray_address_file", lambda temp_dir: str(path))
    return path


def _sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])


def test_stopping_this_head_ends_it_and_removes_its_address(address_file):
    address_file.write_text("192.0.2.2:50617")
    proc = _sleeper()
    stop_ray_head(proc, "127.0.0.1:50617", timeout=30)
    assert proc.poll() is not None and not address_file.exists()


def test_another_heads_address_stays(address_file):
    address_file.write_text("192.0.2.2:6379")
    proc = _sleeper()
    stop_ray_head(proc, "127.0.0.1:50617", timeout=30)
    assert proc.poll() is not None and address_file.read_text() == "192.0.2.2:6379"


def test_no_address_file_is_fine(address_file):
    proc = _sleeper()
    stop_ray_head(proc, "127.0.0.1:50617", timeout=30)
    assert proc.poll() is not None and not address_file.exists()
