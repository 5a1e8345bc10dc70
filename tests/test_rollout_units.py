"""Rollout pieces that need no engine: buckets, records, engine arguments, speculative config mapping.

    .venv/bin/python -m pytest tests/test_rollout_units.py -q
"""

from __future__ import annotations

import pytest
import torch

from megatron_sortedrl.rollout import Completion, GenRequest, iter_buckets, speculative_config_from
from megatron_sortedrl.rollout.engine_worker import engine_env, engine_kwargs
from megatron_sortedrl.rollout.weight_sync import bucket_nbytes
from megatron_sortedrl.sample import Sample
from speculative.config import SpeculativeConfig


def tensors(sizes):
    return [(f"w{i}", torch.full((n,), float(i))) for i, n in enumerate(sizes)]


def test_buckets_keep_order_and_bound_size():
    pairs = tensors([10, 20, 30, 300, 5, 5, 5])
    buckets = list(iter_buckets(iter(pairs), bucket_bytes=40 * 4))
    assert [list(b) for b in buckets] == [["w0", "w1"], ["w2"], ["w3"], ["w4", "w5", "w6"]]
    for b in buckets:
        assert len(b) == 1 or bucket_nbytes(b) <= 40 * 4  # only a single oversized tensor exceeds the bound
    flat = [(n, t) for b in buckets for n, t in b.items()]
    assert all(n == m and torch.equal(t, u) for (n, t), (m, u) in zip(flat, pairs))


def test_buckets_from_directory_and_duplicate_names(tmp_path):
    from safetensors.torch import save_file

    save_file(dict(tensors([3, 4])), str(tmp_path / "a.safetensors"))
    save_file({"w9": torch.ones(2)}, str(tmp_path / "b.safetensors"))
    (bucket,) = list(iter_buckets(tmp_path))
    assert list(bucket) == ["w0", "w1", "w9"] and torch.equal(bucket["w1"], torch.ones(4))
    with pytest.raises(ValueError, match="twice"):
        list(iter_buckets(iter(tensors([1]) * 2)))
    with pytest.raises(FileNotFoundError):
        list(iter_buckets(tmp_path / "missing"))


def test_buckets_detach_and_copy_to_host():
    p = torch.nn.Parameter(torch.arange(6.0).view(2, 3).t())  # non-contiguous, requires grad
    (bucket,) = list(iter_buckets(iter([("p", p)])))
    assert bucket["p"].is_contiguous() and not bucket["p"].requires_grad and torch.equal(bucket["p"], p.detach())


def test_request_validation():
    with pytest.raises(ValueError, match="unknown sampling keys"):
        GenRequest("r", [1, 2], {"max_token": 3})
    with pytest.raises(ValueError, match="empty prompt"):
        GenRequest("r", [], {})


def test_completion_versions_flow_into_sample():
    c = Completion("p/e0/0", worker_id=1)
    c.append([5, 6], [-0.1, -0.2], version=2)
    c.append([7], [-0.3], version=2)
    c.append([8, 9], [-0.4, -0.5], version=3)  # weights changed while the request was paused in the engine
    assert c.version_spans == [(0, 2), (3, 3)]
    s = Sample("p", 0, response_tokens=[1], rollout_logprobs=[-1.0], version_spans=[(0, 1)])  # a resumed partial
    c.finish_reason, c.first_token_time, c.finish_time = "stop", 1.0, 2.0
    c.to_sample(s)
    assert s.response_tokens == [1, 5, 6, 7, 8, 9] and s.rollout_logprobs == [-1.0, -0.1, -0.2, -0.3, -0.4, -0.5]
    assert s.token_versions() == [1, 2, 2, 2, 3, 3] and s.finished and s.worker_id == 1
    shifted = c.shifted(10.0)
    assert (shifted.submit_time, shifted.first_token_time, shifted.finish_time) == (0.0, 11.0, 12.0)
    assert c.finish_time == 2.0


def test_engine_arguments():
    kw = engine_kwargs("m", tp=2, load_format="dummy", speculative_config={"method": "ngram"}, enable_prefix_caching=True)
    assert kw["tensor_parallel_size"] == 2 and kw["skip_tokenizer_init"] and kw["load_format"] == "dummy"
    assert kw["worker_extension_cls"].endswith("RolloutWorkerExtension") and kw["enable_prefix_caching"]
    assert kw["distributed_executor_backend"] == "mp" and "weight_transfer_config" not in kw
    assert engine_kwargs("m", weight_transfer_backend="nccl")["weight_transfer_config"] == {"backend": "nccl"}
    assert engine_kwargs("m", tp=1, executor="uni")["distributed_executor_backend"] == "uni"
    with pytest.raises(ValueError, match="TP 1"):
        engine_kwargs("m", tp=2, executor="uni")


def test_executor_choice_per_engine():
    from megatron_sortedrl.config import load_config
    from megatron_sortedrl.errors import ConfigError
    from megatron_sortedrl.rollout.pool_options import executor_for

    # auto: one process for a CPU engine of TP 1; a worker per rank on GPUs and for every TP > 1 layout
    assert [executor_for("auto", d, tp) for d, tp in (("cpu", 1), ("cpu", 2), ("gpu", 1))] == ["uni", "mp", "mp"]
    # an explicit uni still runs an elastic long round of TP 2 (mp is the only executor that can)
    assert [executor_for("uni", "cpu", tp) for tp in (1, 2)] == ["uni", "mp"]
    assert executor_for("mp", "cpu", 1) == "mp"
    with pytest.raises(ConfigError, match="rollout.executor"):
        load_config(None, ["model.path=/nonexistent/tiny", "rollout.executor=threads"])
    env = engine_env(device="cpu", kv_cache_gib=1.5, cpu_ids=[[0], [1, 2]])
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "2" and env["VLLM_CPU_OMP_THREADS_BIND"] == "0|1,2"
    assert "VLLM_CPU_KVCACHE_SPACE" not in engine_env(device="gpu")


def test_speculative_config_mapping():
    assert speculative_config_from(SpeculativeConfig(enabled=False)) is None
    spec = speculative_config_from(SpeculativeConfig(method="histospec", max_draft_tokens=4))
    assert spec == {"method": "custom_class", "model": "speculative.proposer.HistoSpecProposer",
                    "num_speculative_tokens": 4}
    assert speculative_config_from(SpeculativeConfig(method="ngram", max_draft_tokens=8))["method"] == "ngram"


def test_worker_extension_composes_optional_mixins():
    from megatron_sortedrl.rollout import worker_extension as we

    assert issubclass(we.RolloutWorkerExtension, we.WeightSyncExtension)
    from speculative.vllm_extension import HistoSpecWorkerMixin

    assert we._optional_mixins() == (HistoSpecWorkerMixin,)
    assert issubclass(we.RolloutWorkerExtension, HistoSpecWorkerMixin)
    tied = torch.nn.Module()
    tied.embed = torch.nn.Embedding(4, 2)
    tied.head = torch.nn.Linear(2, 4, bias=False)
    tied.head.weight = tied.embed.weight
    assert we._tied_aliases(tied) == {"embed.weight": ["head.weight"]}
