"""The NVML sampler: its no-driver path, its sampling loop against a stand-in NVML module, the standalone
recorder, and (marked gpu) plausible readings under a matrix-multiply load.

    python -m pytest tests/test_telemetry_nvml.py -q            # CPU: about 2 s
    python -m pytest tests/test_telemetry_nvml.py -q -m gpu     # on a GPU machine
"""

from __future__ import annotations

import json
import logging
import re
import socket
import statistics
import sys
import time
import types

import pytest

from megatron_sortedrl.telemetry.nodes import gpu_node_ids
from megatron_sortedrl.telemetry.nvml import NvmlSampler, nvml_init, read_samples
from megatron_sortedrl.telemetry.record import main as record_main
from megatron_sortedrl.telemetry.timeline import RunClock

MESSAGE_RE = r"^NVML unavailable: .+; continuing without GPU utilization sampling$"


def fake_nvml(count=2, fail_init=None, power_supported=True):
    """A stand-in for the pynvml module with `count` GPUs whose util is 10 * (index + 1) %."""
    m = types.ModuleType("pynvml")
    m.NVML_CLOCK_SM, m.NVML_TEMPERATURE_GPU = 1, 0
    m.calls = {"shutdown": 0}

    class NVMLError(Exception):
        pass

    def init():
        if fail_init:
            raise NVMLError(fail_init)

    def power(h):
        if not power_supported:
            raise NVMLError("Not Supported")
        return 150_000 + h * 1000

    m.NVMLError = NVMLError
    m.nvmlInit = init
    m.nvmlShutdown = lambda: m.calls.__setitem__("shutdown", m.calls["shutdown"] + 1)
    m.nvmlDeviceGetCount = lambda: count
    m.nvmlDeviceGetHandleByIndex = lambda i: i
    m.nvmlDeviceGetName = lambda h: b"Fake GPU"
    m.nvmlDeviceGetUUID = lambda h: f"GPU-fake-{h}"
    m.nvmlSystemGetDriverVersion = lambda: "999.0"
    m.nvmlDeviceGetUtilizationRates = lambda h: types.SimpleNamespace(gpu=10 * (h + 1), memory=5)
    m.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(used=512 * 1024 * 1024, total=4096 * 1024 * 1024)
    m.nvmlDeviceGetPowerUsage = power
    m.nvmlDeviceGetEnforcedPowerLimit = lambda h: 300_000
    m.nvmlDeviceGetClockInfo = lambda h, kind: 1500
    m.nvmlDeviceGetTemperature = lambda h, kind: 50
    return m


def test_no_driver_gives_one_line_and_the_run_continues(tmp_path, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml(fail_init="NVML Shared Library Not Found"))
    sampler = NvmlSampler(tmp_path / "nvml" / "h.jsonl")
    with caplog.at_level(logging.WARNING):
        assert sampler.start() is False
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["NVML unavailable: NVML Shared Library Not Found; continuing without GPU utilization sampling"]
    assert sampler.stop()["ticks"] == 0
    assert not (tmp_path / "nvml").exists()  # nothing written


def test_this_machines_real_nvml_path(tmp_path, caplog):
    """Whatever this machine has: either NVML starts, or the real failure yields the one line."""
    nvml, reason = nvml_init()
    if nvml is not None:
        nvml.nvmlShutdown()
        pytest.skip("NVML works on this machine; the no-driver path is covered with a stand-in above")
    with caplog.at_level(logging.WARNING):
        assert NvmlSampler(tmp_path / "s.jsonl").start() is False
    assert len(caplog.records) == 1
    assert caplog.records[0].getMessage() == f"NVML unavailable: {reason}; continuing without GPU utilization sampling"
    assert re.match(MESSAGE_RE, caplog.records[0].getMessage())


def test_no_gpu_found_is_also_one_line(tmp_path, monkeypatch, caplog):
    nvml = fake_nvml(count=0)
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    with caplog.at_level(logging.WARNING):
        assert NvmlSampler(tmp_path / "s.jsonl").start() is False
    assert [r.getMessage() for r in caplog.records] == [
        "NVML unavailable: no GPU found by NVML; continuing without GPU utilization sampling"]
    assert nvml.calls["shutdown"] == 1


def test_sampler_writes_meta_rows_and_overhead_on_the_run_clock(tmp_path, monkeypatch):
    nvml = fake_nvml(count=2, power_supported=False)
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    clock = RunClock(epoch=time.time() - 50.0)
    path = tmp_path / "nvml" / "node0.jsonl"
    sampler = NvmlSampler(path, clock=clock, interval_s=0.02, host="node0")
    assert sampler.start() is True
    time.sleep(0.25)
    stats = sampler.stop()
    assert nvml.calls["shutdown"] == 1
    s = read_samples(path)
    assert s.meta[0]["gpus"][1] == {"index": 1, "name": "Fake GPU", "uuid": "GPU-fake-1", "mem_total_mib": 4096.0,
                                    "power_limit_w": 300.0}
    assert s.meta[0]["epoch"] == clock.epoch and s.meta[0]["interval_s"] == 0.02
    # About 0.25 s / 0.02 s = 12 ticks; allow a loaded machine to be slow, but the loop must tick repeatedly.
    assert 4 <= stats["ticks"] <= 14
    assert stats["rows"] == 2 * stats["ticks"] == len(s.rows)
    assert s.overhead == [stats]
    r0, r1 = s.rows[0], s.rows[1]
    assert (r0["gpu"], r0["util"], r1["gpu"], r1["util"]) == (0, 10, 1, 20)
    assert r0["mem_used_mib"] == 512.0 and r0["sm_clock_mhz"] == 1500 and r0["temp_c"] == 50
    assert "power_w" not in r0  # unsupported reading left out, not zero
    assert 50.0 <= r0["t"] < 60.0  # run clock, not wall clock
    ts = [r["t"] for r in s.rows if r["gpu"] == 0]
    # Ticks keep their grid: strictly increasing, about one interval apart. A tick a little late is followed by
    # one on the grid (a shorter gap), so single gaps may be short on a loaded machine; a loop that bursts
    # would make most of them short.
    gaps = [b - a for a, b in zip(ts, ts[1:])]
    assert ts == sorted(ts) and min(gaps) > 0 and statistics.median(gaps) >= 0.015, gaps
    assert stats["ms_per_tick"] < 20 and 0 <= stats["cpu_fraction_of_one_core"] < 0.5


def test_truncated_last_line_of_a_killed_sampler_is_ignored(tmp_path):
    path = tmp_path / "s.jsonl"
    path.write_text('{"t": 0.0, "host": "h", "gpu": 0, "util": 5}\n{"t": 0.1, "host": "h", "gp')
    assert len(read_samples(path).rows) == 1
    path.write_text('{"t": 0.0, "host": "h", "gp\n{"t": 0.1, "host": "h", "gpu": 0, "util": 5}\n')
    with pytest.raises(ValueError, match="s.jsonl:1"):
        read_samples(path)


def test_recorder_runs_the_command_and_keeps_its_exit_status(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml(count=1))
    out = tmp_path / "rec"
    rc = record_main(["-o", str(out), "--interval", "0.02", "--",
                      sys.executable, "-c", "import time, sys; time.sleep(0.2); sys.exit(3)"])
    assert rc == 3
    meta = json.loads((out / "command.json").read_text())
    assert meta["returncode"] == 3 and meta["sampler"]["ticks"] >= 3
    lines = [json.loads(x) for x in (out / "timeline.jsonl").read_text().splitlines()]
    assert [(x["phase"], x["event"]) for x in lines] == [("command", "start"), ("command", "end")]
    assert lines[1]["t"] - lines[0]["t"] >= 0.2
    csv_rows = (out / "nvml_report" / "summary.csv").read_text().splitlines()
    assert any(r.startswith(f"{socket.gethostname()},0,command,") for r in csv_rows)
    assert (out / "nvml_report" / "report.html").exists()


def test_recorder_usage_errors(capsys):
    assert record_main(["echo", "hi"]) == 2
    assert "after `--`" in capsys.readouterr().err
    assert record_main(["--interval", "0", "--", "true"]) == 2


def test_gpu_nodes_are_picked_from_rays_resource_table():
    nodes = [{"NodeID": "a", "Alive": True, "Resources": {"CPU": 16, "GPU": 8}},
             {"NodeID": "b", "Alive": True, "Resources": {"CPU": 64}},
             {"NodeID": "c", "Alive": False, "Resources": {"GPU": 8}}]
    assert gpu_node_ids(nodes) == ["a"]


@pytest.mark.gpu
def test_sampler_sees_a_matmul_load_on_a_real_gpu(tmp_path):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: torch.cuda.is_available() is False")
    nvml, reason = nvml_init()
    if nvml is None:
        pytest.skip(f"NVML cannot start here: {reason}")
    nvml.nvmlShutdown()
    path = tmp_path / "gpu.jsonl"
    clock = RunClock()
    sampler = NvmlSampler(path, clock=clock, interval_s=0.05)
    assert sampler.start()
    time.sleep(1.5)  # idle baseline
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.float16)
    load_start = clock.now()
    while clock.now() - load_start < 3.0:
        for _ in range(20):
            a = (a @ a).clamp_(-1, 1)
        torch.cuda.synchronize()
    load_end = clock.now()
    stats = sampler.stop()
    rows = read_samples(path).rows
    # torch's device 0 may be any NVML index (CUDA_VISIBLE_DEVICES), so take the GPU that was loaded.
    by_gpu: dict[int, list[dict]] = {}
    for r in rows:
        by_gpu.setdefault(r["gpu"], []).append(r)

    def mean(rs, key):
        vals = [r[key] for r in rs if key in r]
        return sum(vals) / max(1, len(vals))

    def window(rs, a, b):
        return [r for r in rs if a <= r["t"] < b]

    loaded = max(by_gpu, key=lambda g: mean(window(by_gpu[g], load_start + 0.5, load_end), "util"))
    busy = window(by_gpu[loaded], load_start + 0.5, load_end)
    idle = window(by_gpu[loaded], 0.2, load_start - 0.2)
    assert len(busy) >= 20 and len(idle) >= 10
    assert mean(busy, "util") > 80 and mean(busy, "util") > mean(idle, "util") + 30
    assert max(r["mem_used_mib"] for r in busy) > max(r["mem_used_mib"] for r in idle) + 100  # the 128 MiB matrix
    if "power_w" in busy[0]:
        assert mean(busy, "power_w") > mean(idle, "power_w")
    assert 0 < mean(busy, "sm_clock_mhz") < 5000 and 10 < mean(busy, "temp_c") < 110
    print(f"sampler cost on GPU: {stats}")
    assert stats["ms_per_tick"] < 25  # well under the 50 ms interval


def test_node_sampler_actor_writes_the_hosts_file_on_the_run_clock(tmp_path, monkeypatch):
    from megatron_sortedrl.telemetry.nodes import SamplerActor

    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml(count=1))
    actor = SamplerActor(str(tmp_path), epoch=time.time() - 10.0, interval_s=0.02)  # what each Ray actor runs
    assert actor.status() == (socket.gethostname(), True, None)
    time.sleep(0.1)
    assert actor.stop()["ticks"] >= 2
    rows = read_samples(tmp_path / "nvml" / f"{socket.gethostname()}.jsonl").rows
    assert rows and all(10.0 <= r["t"] < 20.0 for r in rows)


def test_cpu_only_ray_cluster_starts_no_samplers_and_says_so(monkeypatch, caplog, tmp_path):
    ray = pytest.importorskip("ray")
    from megatron_sortedrl.telemetry.nodes import NodeSamplers

    monkeypatch.setattr(ray, "nodes", lambda: [{"NodeID": "a", "Alive": True, "Resources": {"CPU": 2}}])
    with caplog.at_level(logging.WARNING):
        samplers = NodeSamplers.start(tmp_path, epoch=0.0)
    assert samplers.actors == [] and samplers.stop() == {}
    assert [r.getMessage() for r in caplog.records] == [
        "NVML unavailable: the Ray cluster has no GPU nodes; continuing without GPU utilization sampling"]
