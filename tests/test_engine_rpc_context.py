"""What a weight update needs from vLLM's worker plumbing, checked against the installed vLLM on CPU.

    python -m pytest tests/test_engine_rpc_context.py -q        # CPU, a few seconds

* A CUDA IPC hand-off's handle (`weight_sync_gpu.ipc_handle`: torch's `reduce_tensor` arguments, which hold
  classes and a torch.dtype) crosses `collective_rpc`, whose msgpack encoder refuses such objects unless
  `VLLM_ALLOW_INSECURE_SERIALIZATION=1`: a GPU engine's environment (`engine_env`) sets it. The handle here has the
  layout torch gives a CUDA tensor (no CUDA on this machine); a GPU confirms the hand-off itself.
* The worker extension's reload steps run inside `set_current_vllm_config` (vLLM wraps its own weight-update entry
  points so; `get_current_vllm_config` raises when unset). The model and vLLM's reload functions are stand-ins
  that read the current config, as the layers vLLM's reload rebuilds do.
"""

from __future__ import annotations

import json

import pytest
import torch

from megatron_sortedrl.rollout.engine_worker import engine_env


def _cuda_handle() -> dict:
    """{gpu uuid: args} as `weight_sync_gpu.ipc_handle` builds it: `reduce_tensor(t)[1]` of a CUDA uint8 tensor."""
    args = (torch.Tensor, (4096,), (1,), 0, torch.storage.UntypedStorage, torch.uint8, 0, b"\x01" * 64, 4096, 0,
            False, b"\x02" * 64, 0, b"\x03" * 64, True)
    return {"GPU-5f2c0c1e-0000-0000-0000-000000000000": args}


def _encode_under(monkeypatch, env: dict, payload):
    import vllm.envs as envs
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    if hasattr(envs, "disable_envs_cache"):
        envs.disable_envs_cache()
    monkeypatch.delenv("VLLM_ALLOW_INSECURE_SERIALIZATION", raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return MsgpackDecoder().decode(MsgpackEncoder().encode(payload))


def test_gpu_engines_can_receive_a_cuda_ipc_handle_through_collective_rpc(monkeypatch):
    meta = [["model.embed_tokens.weight", "bfloat16", [16, 64], 0]]
    payload = (_cuda_handle(), 4096, meta)  # msrl_load_ipc's arguments
    decoded = _encode_under(monkeypatch, engine_env(device="gpu"), payload)
    (uuid, args), = decoded[0].items()
    # msgpack gives tuples back as lists (sizes and strides too, which torch's rebuild accepts)
    assert uuid in _cuda_handle()
    assert [tuple(a) if isinstance(a, list) else a for a in args] == list(next(iter(_cuda_handle().values())))
    assert args[0] is torch.Tensor and args[5] is torch.uint8
    with pytest.raises(TypeError, match="VLLM_ALLOW_INSECURE_SERIALIZATION"):  # what a CPU engine's env gives
        _encode_under(monkeypatch, engine_env(device="cpu"), payload)


class _Model(torch.nn.Module):
    """Reads vLLM's current config while loading, as the layers a layerwise reload rebuilds do."""

    def __init__(self, seen: list):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(2, 2))
        self.seen = seen

    def load_weights(self, weights):
        from vllm.config import get_current_vllm_config

        self.seen.append(("load", get_current_vllm_config()))
        for _, t in weights:
            self.w.data.copy_(t)


def test_every_reload_step_runs_under_the_workers_vllm_config(monkeypatch, tmp_path):
    from safetensors.torch import save_file
    from vllm.config import get_current_vllm_config
    from vllm.model_executor.model_loader import reload

    from megatron_sortedrl.rollout.worker_extension import WeightSyncExtension

    seen: list = []
    monkeypatch.setattr(reload, "initialize_layerwise_reload", lambda m: seen.append(("begin", get_current_vllm_config())))
    monkeypatch.setattr(reload, "finalize_layerwise_reload",
                        lambda m, mc: seen.append(("finish", get_current_vllm_config())))
    model = _Model(seen)
    config = type("Cfg", (), {"model_config": None, "compilation_config": None})()  # the worker's (a stand-in)

    class Worker(WeightSyncExtension):
        model_runner = type("Runner", (), {"get_model": staticmethod(lambda: model)})()
        vllm_config = config

    path = tmp_path / "bucket.safetensors"
    save_file({"w": torch.ones(2, 2)}, str(path))
    worker = Worker()
    worker.msrl_begin_weight_update()
    assert worker.msrl_load_weights_file(str(path)) == 1
    worker.msrl_finish_weight_update()
    assert [step for step, _ in seen] == ["begin", "load", "finish"]
    assert all(cfg is config for _, cfg in seen)
    assert torch.equal(model.w, torch.ones(2, 2))
    with pytest.raises(AssertionError, match="not set"):  # outside the steps nothing is set, as in vLLM
        get_current_vllm_config()
    json.dumps(worker.msrl_reload_stats())  # the stats still come back as plain values
