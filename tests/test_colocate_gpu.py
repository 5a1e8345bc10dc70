"""Colocated layout on a GPU: the memory effect of each transition (megatron_sortedrl/colocate/).

    .venv/bin/python -m pytest tests/test_colocate_gpu.py -q -m gpu        # on a machine with CUDA vLLM

* `HostOffload` of CUDA tensors: the device's free memory (`mem_get_info`, what another process such as a
  colocated engine can take) rises by the bytes moved, and they return after the reload, values intact (pinned
  host buffers, non-blocking copies). `memory_allocated` alone cannot see blocks the caching allocator keeps.
* A CUDA vLLM engine built with sleep mode: the device's free memory rises by at least the KV cache after
  `sleep(2)`, falls again after waking weights then KV cache, and the engine still generates.
* A colocated tiny run on one GPU: every offload/reload and sleep/wake of the timeline has bytes, the weights
  are handed over by CUDA IPC, and the trainer rank's allocated memory after an offload is below that after a
  reload.
* A colocated relayout at a size where the trainer's state is more than 1 - gpu_memory_utilization of the device:
  the new engines start beside the offloaded trainer (vLLM's start-up check of free memory passes) and serve.

Skipped without a GPU (conftest), and the engine tests without Ray or vLLM (a bare GPU image has neither);
never run on the CPU machines this was written on.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs an NVIDIA GPU and CUDA vLLM", allow_module_level=True)

from megatron_sortedrl.trainer.offload import HostOffload  # noqa: E402


def test_offload_frees_device_memory_and_reload_restores_it():
    tensors = [torch.randn(1024, 1024, device="cuda") for _ in range(8)]  # 32 MiB
    before = [t.clone().cpu() for t in tensors]
    torch.cuda.synchronize()
    resident, free_resident = torch.cuda.memory_allocated(), torch.cuda.mem_get_info()[0]
    off = HostOffload(tensors, pin=True)
    out = off.offload()
    assert out["bytes"] == 8 * 1024 * 1024 * 4
    assert resident - torch.cuda.memory_allocated() >= out["bytes"]
    assert torch.cuda.mem_get_info()[0] - free_resident >= out["bytes"]  # given back to the device, not cached
    off.reload()
    assert torch.cuda.memory_allocated() >= resident
    assert all(torch.equal(t.cpu(), b) for t, b in zip(tensors, before))


def _engine_stack():
    """Ray and CUDA vLLM, or a skip naming the missing one (a bare GPU image has neither)."""
    pytest.importorskip("vllm", reason="needs CUDA vLLM")
    return pytest.importorskip("ray", reason="needs Ray")


def test_engine_sleep_frees_and_wake_restores_device_memory(tmp_path):
    ray = _engine_stack()

    from megatron_sortedrl.colocate.engines import ready_engines, sleep_engines, wake_engines
    from megatron_sortedrl.rollout import GenRequest, PoolOptions, RolloutPool
    from megatron_sortedrl.tiny_model import build_tiny_model

    model_dir = build_tiny_model(tmp_path / "tiny")
    ray.init(address="local", include_dashboard=False, ignore_reinit_error=True)
    pool = RolloutPool(PoolOptions(model_path=str(model_dir), device="gpu", max_model_len=512,
                                   gpu_memory_utilization=0.3, engine_extra={"enable_sleep_mode": True}))
    try:
        keys = list(ready_engines(pool))
        awake_free = torch.cuda.mem_get_info()[0]
        (report,) = sleep_engines(pool, 2).values()
        asleep_free = torch.cuda.mem_get_info()[0]
        assert report["freed"] and report["kv_cache"] > 0
        assert asleep_free - awake_free >= 0.9 * report["kv_cache"]
        wake_engines(pool, ["weights"], keys)
        wake_engines(pool, ["kv_cache"], keys)
        assert torch.cuda.mem_get_info()[0] <= awake_free + 0.1 * report["kv_cache"]
        pool.submit(GenRequest("r", [40, 41, 42], {"max_tokens": 8, "ignore_eos": True}), worker=0)
        (c,) = list(pool.completions(timeout_s=120))
        assert len(c.tokens) == 8
    finally:
        pool.shutdown()
        ray.shutdown()


def _colocated_run(tmp_path, *overrides):
    """Runs the tiny recipe colocated on this GPU; returns (metrics rows, timeline phase ends)."""
    _engine_stack()
    from megatron_sortedrl.config import load_config
    from megatron_sortedrl.driver import Driver
    from megatron_sortedrl.telemetry.timeline import read_timeline
    from megatron_sortedrl.tiny_model import build_tiny_model

    model_dir = build_tiny_model(tmp_path / "tiny")
    cfg = load_config("configs/tiny_cpu.yaml", [
        f"model.path={model_dir}", f"logging.run_dir={tmp_path / 'run'}", "trainer.total_steps=2",
        "trainer.warmup_sft_steps=2", "trainer.eval_interval=0", "checkpoint.save_interval=0",
        "rollout.max_response_length=48", "data.num_eval_prompts=4", "logging.tensorboard=false",
        "cluster.device=gpu", "cluster.colocate=true", "rollout.gpu_memory_utilization=0.3", *overrides])
    driver = Driver(cfg, printer=print)
    rows = []
    try:
        driver.run(on_step=lambda r: rows.append(r.metrics))
    finally:
        driver.close()
    return rows, [e for e in read_timeline(tmp_path / "run" / "timeline.jsonl") if e.kind == "phase" and e.event == "end"]


def test_colocated_run_moves_memory_per_phase(tmp_path):
    rows, ends = _colocated_run(tmp_path)
    for phase in ("offload", "reload", "sleep", "wake", "handoff"):
        assert any(e.phase == phase and e.bytes for e in ends), phase
    assert all(e.detail and "not freed" not in e.detail for e in ends if e.phase == "sleep")
    assert {e.detail for e in ends if e.phase == "handoff"} == {"ipc"}  # one node: the stage sender's CUDA IPC
    for row in rows:
        assert row["colocate/offload_device_allocated"] < row["colocate/reload_device_allocated"]


def test_colocated_relayout_starts_engines_beside_an_offloaded_trainer(tmp_path):
    """An engine rebuild (what a relayout and the HistoSpec switch do) on a colocated driver: the trainer's state
    leaves before the new engine starts, so vLLM's start-up check sees the device's free memory without it; the
    new engine sleeps, the trainer comes back, and after the hand-off the engine serves the current version."""
    _engine_stack()
    from megatron_sortedrl.config import load_config
    from megatron_sortedrl.driver import Driver
    from megatron_sortedrl.rollout import GenRequest
    from megatron_sortedrl.tiny_model import build_tiny_model

    model_dir = build_tiny_model(tmp_path / "tiny")
    utilization = 0.3
    cfg = load_config("configs/tiny_cpu.yaml", [
        f"model.path={model_dir}", f"logging.run_dir={tmp_path / 'run'}", "trainer.total_steps=1",
        "trainer.warmup_sft_steps=0", "trainer.eval_interval=0", "checkpoint.save_interval=0",
        "logging.tensorboard=false", "cluster.device=gpu", "cluster.colocate=true",
        f"rollout.gpu_memory_utilization={utilization}"])
    driver = Driver(cfg, printer=print)
    try:
        colo, pool = driver.colo, driver.pool
        colo.hand_off(driver.version)
        free_at_start = []
        start = pool.set_layout

        def set_layout(n, tp, reload=True):
            free_at_start.append(torch.cuda.mem_get_info()[0])  # what the new engines' start-up check sees
            return start(n, tp, reload=reload)

        pool.set_layout = set_layout
        colo.replace_engines(lambda reload: pool.set_layout(*pool.layout, reload=reload))
        row = colo.step_row()
        assert row["colocate/offload_count"] == 1 and row["colocate/reload_count"] == 1
        assert free_at_start[0] >= utilization * torch.cuda.get_device_properties(0).total_memory
        assert colo.trainer_resident and {w.version for w in pool.load()} == {driver.version}
        colo.to_rollout()
        pool.submit(GenRequest("r", [40, 41, 42], {"max_tokens": 8, "ignore_eos": True}), worker=0)
        (c,) = list(pool.completions(timeout_s=120))
        assert len(c.tokens) == 8
        colo.to_train()
    finally:
        driver.close()
