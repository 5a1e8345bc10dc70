"""The launch planner: engine weights and KV capacity, weight-sync bytes, recompute auto, the `plan` CLI and
the check `train` runs at start. CPU only; the model shapes are config.json files (no weights).

    python -m pytest tests/test_plan.py -q
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_sortedrl.config import load_config
from megatron_sortedrl.errors import UserError
from megatron_sortedrl.plan.arch import Arch
from megatron_sortedrl.plan.engine import BUCKET_BYTES, BUCKETS_IN_FLIGHT, engine_memory, weight_sync_estimate
from megatron_sortedrl.plan.planner import _candidates, check_plan, make_plan, resolve_recompute

REPO = Path(__file__).resolve().parent.parent
SHAPES = REPO / "configs" / "model_shapes"
GIB = 2**30
# Every shipped recipe that launches a run (sim_* are simulator scenarios) and the model shape it plans with.
RECIPES = {
    "tiny_cpu.yaml": None,
    "longtail_cpu.yaml": None,
    "code_cpu.yaml": None,
    "elastic_cpu.yaml": None,
    "learning_cpu.yaml": None,
    "tiny_moe_cpu.yaml": None,
    "tools_cpu.yaml": None,
    "qwen7b_16gpu.yaml": "qwen2.5-7b-instruct",
    "qwen32b_128gpu.yaml": "qwen2.5-32b-instruct",
    "dapo_qwen32b_128gpu.yaml": "qwen2.5-32b-instruct",
    "llama8b_logic_8gpu.yaml": "llama-3.1-8b-instruct",
    "qwen3_8b_8gpu.yaml": "qwen3-8b",
    "qwen3_30b_a3b_32gpu.yaml": "qwen3-30b-a3b",
    "qwen3_235b_a22b_128gpu.yaml": "qwen3-235b-a22b",
}
ENV = {"MSRL_MODEL_DIR": "/unset/model", "MSRL_DATA_DIR": "/unset/data", "MSRL_RUN_DIR": "/unset/run"}

SMALL = {"model_type": "qwen2", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 100, "max_position_embeddings": 512,
         "tie_word_embeddings": False}


def _cfg(overrides=(), path=None):
    return load_config(path, ["model.path=/nonexistent/plan-test", *overrides])


def _recipe(name: str, overrides=()):
    old = {k: os.environ.get(k) for k in ENV}
    os.environ.update({k: v for k, v in ENV.items() if k not in os.environ or not os.environ[k]})
    try:
        return load_config(REPO / "configs" / name, list(overrides))
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)


def test_recipe_list_covers_every_shipped_run_recipe():
    from test_plan_colocated import COLOCATED  # planned there while cluster.colocate is refused at load

    shipped = {p.name for p in (REPO / "configs").glob("*.yaml") if not p.name.startswith("sim_")}
    assert shipped == set(RECIPES) | set(COLOCATED)


# ------------------------------------------------------------------------------------------- shapes


def test_param_count_by_hand():
    arch = Arch.from_dict(SMALL)
    # embedding 100x64; per layer q,k,v 64x(64+32+32) + bias 128, o 64x64, gate/up/down 3x64x128, 2 norms x 64
    layer = 64 * 128 + 128 + 64 * 64 + 3 * 64 * 128 + 2 * 64
    assert layer == 37_120
    assert arch.num_params == 6_400 + 2 * layer + 64 + 6_400
    assert sum(arch.stage_params(s, 2) for s in range(2)) == arch.num_params


@pytest.mark.parametrize("name", sorted(set(RECIPES.values()) - {None}))
def test_param_count_matches_transformers(name):
    """Our count from the shapes equals the parameters transformers builds for the same config.json."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    hf = AutoConfig.from_pretrained(SHAPES / name)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf)
    assert Arch.from_path(SHAPES / name).num_params == sum(p.numel() for p in model.parameters())


# ------------------------------------------------------------------------------------------- engines


def test_engine_weights_and_kv_capacity_by_hand():
    arch = Arch.from_dict(SMALL)
    cfg = _cfg(["model.dtype=bfloat16", "cluster.gpu_memory_gib=1", "rollout.gpu_memory_utilization=0.5",
                "plan.engine_reserve_gib=0.25", "data.max_prompt_length=100", "rollout.max_response_length=412"])
    em = engine_memory(cfg, arch, tp=2, device="gpu")
    assert em["weights"] == arch.num_params * 2 / 2 == 87_104
    assert em["kv_bytes_per_token"] == 2 * 2 * 1 * 16 * 2 == 128  # k and v, 2 layers, 1 kv head per rank, dim 16, bf16
    assert em["kv_bytes"] == 0.5 * GIB - 87_104 - 0.25 * GIB
    assert em["kv_tokens"] == (GIB // 4 - 87_104) // 128 == 2_096_471
    assert em["full_sequences"] == 2_096_471 // 512
    # TP=4 > 2 kv heads: vLLM replicates heads, so a rank still holds one head's KV per token.
    assert engine_memory(cfg, arch, tp=4, device="gpu")["kv_bytes_per_token"] == 128
    assert engine_memory(cfg, arch, tp=1, device="gpu")["kv_bytes_per_token"] == 256


def test_engine_memory_follows_the_engine_dtype():
    """bfloat16 engines beside a float32 trainer (`rollout.dtype`): weights and KV per token in 2 bytes."""
    arch = Arch.from_dict(SMALL)
    own = engine_memory(_cfg(["model.dtype=float32"]), arch, tp=1, device="gpu")
    bf16 = engine_memory(_cfg(["model.dtype=float32", "rollout.dtype=bfloat16"]), arch, tp=1, device="gpu")
    assert bf16["weights"] * 2 == own["weights"] == arch.num_params * 4
    assert bf16["kv_bytes_per_token"] * 2 == own["kv_bytes_per_token"]


def test_cpu_engine_kv_is_whole_gib():
    em = engine_memory(_cfg(["rollout.kv_cache_gib=1.5"]), Arch.from_dict(SMALL), tp=1, device="cpu")
    assert em["kv_bytes"] == 2 * GIB and em["kv_tokens"] == 2 * GIB // (2 * 2 * 2 * 16 * 4)


def test_qwen32b_kv_per_token_matches_the_simulator_scenario():
    # configs/sim_qwen32b_128gpu.yaml states 262,144 B/token for the whole model (64 x 8 x 128 x 2 x bf16).
    arch = Arch.from_path(SHAPES / "qwen2.5-32b-instruct")
    assert arch.kv_bytes_per_token(2, tp=1) == 262_144 and arch.kv_bytes_per_token(2, tp=2) == 131_072


# ------------------------------------------------------------------------------------------- weight sync


@pytest.mark.parametrize("tied", [True, False])
def test_sync_bytes_equal_the_saved_model_bytes(tmp_path, tied):
    """The bytes one sync moves equal the tensor bytes of the model's safetensors files (tied output once)."""
    from safetensors import safe_open

    from megatron_sortedrl.tiny_model import build_tiny_model, qwen2_config

    cfg = _cfg([f"model.tiny.tie_word_embeddings={tied}", "parallel.pipeline_model_parallel_size=2"])
    model_dir = build_tiny_model(tmp_path / "m", cfg.model.tiny)
    saved = 0
    for f in model_dir.glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as st:
            saved += sum(st.get_tensor(k).numel() * st.get_tensor(k).element_size() for k in st.keys())
    arch = Arch.from_dict(qwen2_config(cfg.model.tiny))
    est = weight_sync_estimate(cfg, arch, device="cpu")
    assert est["bytes"] == saved == sum(est["stage_bytes"])
    assert est["senders"] == 2
    # every engine receives the whole model, whatever the senders: 1 GB/s CPU default
    assert est["seconds"] == pytest.approx(est["bytes"] / 1e9) and est["send_seconds"] < est["seconds"]


def test_sync_estimate_for_32b():
    cfg = _recipe("qwen32b_128gpu.yaml", ["plan.sync_bandwidth_gbs=25"])
    arch = Arch.from_path(SHAPES / "qwen2.5-32b-instruct")
    est = weight_sync_estimate(cfg, arch)
    assert est["bytes"] == arch.num_params * 2 and est["senders"] == 2
    # the senders need half of it (two stages at once); each engine GPU takes all 65.5 GB at 25 GB/s
    assert est["send_seconds"] == pytest.approx(max(est["stage_bytes"]) / 25e9)
    assert est["seconds"] == est["receive_seconds"] == pytest.approx(est["bytes"] / 25e9) == pytest.approx(2.62, abs=0.01)


def test_bucket_constants_match_the_weight_sync():
    from megatron_sortedrl.rollout import weight_sync

    assert BUCKET_BYTES == weight_sync.DEFAULT_BUCKET_BYTES
    assert BUCKETS_IN_FLIGHT == weight_sync.sync_cpu.__kwdefaults__["max_buckets_in_flight"]


# ------------------------------------------------------------------------------------------- recipes


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_every_shipped_recipe_fits(recipe):
    cfg = _recipe(recipe, ["cluster.host_memory_gib=24"] if RECIPES[recipe] is None else [])
    arch = Arch.from_path(SHAPES / RECIPES[recipe]) if RECIPES[recipe] else None
    plan = make_plan(cfg, arch)
    assert plan.fits, [c.line() for c in plan.failures()]
    if plan.device == "gpu":
        assert {c.what.split(" ")[0] for c in plan.checks} >= {"trainer", "short-round", "long-round", "host"}


def test_auto_recompute_picks_the_least_that_fits():
    arch = Arch.from_path(SHAPES / "qwen2.5-32b-instruct")
    cfg = _recipe("qwen32b_128gpu.yaml", ["parallel.recompute.granularity=auto"])
    chosen = resolve_recompute(cfg, arch)
    order = list(_candidates(cfg, arch))
    trainer_fits = [all(c.fits for c in make_plan(cfg, arch, cand).checks if c.what.startswith("trainer"))
                    for cand in order]
    assert trainer_fits[order.index(chosen)] and not any(trainer_fits[:order.index(chosen)])
    assert chosen["granularity"] == "full"  # 65,536-token micro-batches of 32B never fit without recompute
    # A small micro-batch needs none.
    small = _recipe("qwen32b_128gpu.yaml", ["trainer.micro_batch_tokens=2048", "rollout.max_response_length=2048"])
    assert resolve_recompute(small, arch)["granularity"] == "none"
    # check_plan writes the choice into the config before anything is built.
    logged: list[str] = []
    check_plan(cfg, arch, log=logged.append)
    assert cfg.parallel.recompute.granularity == "full" and "auto -> full" in logged[0]


def test_check_modes(tmp_path):
    arch = Arch.from_path(SHAPES / "qwen2.5-32b-instruct")
    cfg = _recipe("qwen32b_128gpu.yaml", ["parallel.recompute.granularity=none"])
    with pytest.raises(UserError, match=r"trainer stage 0 per GPU needs .* GiB \(activations .* at "
                                        r"trainer.micro_batch_tokens=65536, parallel.recompute.granularity=none\)"):
        check_plan(cfg, arch)
    warned: list[str] = []
    cfg = _recipe("qwen32b_128gpu.yaml", ["parallel.recompute.granularity=none", "plan.check=warn"])
    assert not check_plan(cfg, arch, log=warned.append).fits and "plan.check=warn" in warned[0]
    cfg = _recipe("qwen32b_128gpu.yaml", ["plan.check=skip", "parallel.recompute.granularity=auto"])
    assert check_plan(cfg, arch, log=warned.append) is None and cfg.parallel.recompute.granularity == "none"


def test_silly_cpu_config_is_refused():
    cfg = _cfg(["cluster.device=cpu", "cluster.host_memory_gib=16", "rollout.kv_cache_gib=64"])
    with pytest.raises(UserError, match=r"host memory of node 0 needs .* \(rollout engines .*\) > 14.4 GiB usable "
                                        r"of 16 GiB; lower rollout.kv_cache_gib"):
        check_plan(cfg)


# ------------------------------------------------------------------------------------------- CLI


def _cli(*args, env=None):
    full_env = {**os.environ, **(env or {})}
    for k in ENV:
        if env is None or k not in env:
            full_env.pop(k, None)
    return subprocess.run([sys.executable, "-m", "megatron_sortedrl", *args], capture_output=True, text=True,
                          cwd=REPO, env=full_env, timeout=120)


def test_cli_plan_prints_and_writes_json(tmp_path):
    out = tmp_path / "plan.json"
    r = _cli("plan", "configs/qwen32b_128gpu.yaml", "--model-config", str(SHAPES / "qwen2.5-32b-instruct"),
             "--json", str(out), "--explain")
    assert r.returncode == 0, r.stderr
    assert "placeholders used" in r.stderr and "trainer per GPU" in r.stdout and "KV bytes/token" in r.stdout
    assert "fits: every trainer GPU" in r.stdout
    data = json.loads(out.read_text())
    assert data["fits"] and data["weight_sync"]["senders"] == 2 and len(data["trainer_stages"]) == 2
    assert data["engines"]["short"]["kv_bytes_per_token"] == 131_072
    r = _cli("plan", "configs/tiny_cpu.yaml", "cluster.device=cpu", "--json", "-")  # cpu: no torch import
    assert r.returncode == 0 and json.loads(r.stdout)["device"] == "cpu"


def test_cli_plan_exit_codes():
    shapes = str(SHAPES / "qwen2.5-32b-instruct")
    r = _cli("plan", "configs/qwen32b_128gpu.yaml", "--model-config", shapes, "parallel.recompute.granularity=none")
    assert r.returncode == 1 and "plan: trainer stage 0 per GPU needs" in r.stdout
    r = _cli("plan", "configs/qwen32b_128gpu.yaml")  # env paths unset and no --model-config
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "--model-config" in r.stderr
    r = _cli("plan", "configs/qwen32b_128gpu.yaml", "--model-config", "/nonexistent/shape")
    assert r.returncode == 2 and "does not exist" in r.stderr and "Traceback" not in r.stderr


def test_train_refuses_the_32b_recipe_as_it_stood(tmp_path):
    """Recompute none at 65,536-token micro-batches: one line, exit 2, before Ray or the run directory exist."""
    run_dir = tmp_path / "run"
    env = {"MSRL_MODEL_DIR": str(SHAPES / "qwen2.5-32b-instruct"), "MSRL_DATA_DIR": str(tmp_path / "data"),
           "MSRL_RUN_DIR": str(run_dir), "RAY_ADDRESS": "127.0.0.1:1"}  # a Ray start would fail differently
    r = _cli("train", "configs/qwen32b_128gpu.yaml", "parallel.recompute.granularity=none",
             "trainer.micro_batch_tokens=65536", env=env)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: plan: trainer stage 0 per GPU needs")
    assert "of 80 GiB; set parallel.recompute.granularity=full" in lines[0]
    assert not run_dir.exists()


def test_train_refuses_a_silly_cpu_config(tmp_path):
    run_dir = tmp_path / "run"
    r = _cli("train", "configs/tiny_cpu.yaml", "cluster.device=cpu", "rollout.kv_cache_gib=4096",
             f"logging.run_dir={run_dir}", f"model.path={tmp_path / 'model'}")
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "host memory of node 0 needs" in lines[0] and "rollout.kv_cache_gib" in lines[0]
    assert not run_dir.exists() and not (tmp_path / "model").exists()  # refused before building anything


@pytest.mark.parametrize("recipe", sorted(r for r, shape in RECIPES.items() if shape))
def test_scaling_doc_shows_the_current_plan(recipe):
    """docs/scaling.md pastes `plan` output of the GPU recipes; regenerate it when a recipe or formula changes."""
    from megatron_sortedrl.commands.plan import render

    cfg = _recipe(recipe)
    text = render(make_plan(cfg, Arch.from_path(SHAPES / RECIPES[recipe])), cfg)
    assert text in (REPO / "docs" / "scaling.md").read_text()


def test_host_memory_per_node_of_the_32b_layout():
    """Nodes 0-7 hold 8 trainer ranks each, nodes 8-15 four TP=2 engines (an actor and two workers each); the
    senders of stages 0 and 1 (TP rank 0 of DP replica 0: ranks 0 and 32) pin two buckets on nodes 0 and 4."""
    arch = Arch.from_path(SHAPES / "qwen2.5-32b-instruct")
    plan = make_plan(_recipe("qwen32b_128gpu.yaml", ["plan.process_host_gib=2"]), arch)
    nodes = {n["node"]: n["items"] for n in plan.host}
    assert len(nodes) == 16
    assert all(nodes[i]["trainer ranks"] == 8 * 2 * GIB for i in range(8))
    assert all(nodes[i]["engine processes"] == 4 * 3 * 2 * GIB for i in range(8, 16))
    assert [i for i in nodes if nodes[i].get("pinned weight-sync buckets")] == [0, 4]
    assert nodes[0]["pinned weight-sync buckets"] == 2 * 256 * 2**20
    assert nodes[0]["kept weight buckets (object store, for relayout)"] == arch.num_params * 2


def _main_lines(argv: list[str]) -> tuple[int, list[str]]:
    import contextlib
    import io

    from megatron_sortedrl.cli import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = main(argv)
    return rc, err.getvalue().strip().splitlines()


@pytest.mark.parametrize("change", [
    {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "n_routed_experts": 256},
    {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen3"},  # a class that does not match the model_type
    {"num_experts": 64},  # a dense name with experts on
    {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "use_sliding_window": True},
])
def test_plan_train_and_convert_refuse_an_unmodelled_architecture_alike(tmp_path, monkeypatch, change):
    """`plan` used to plan a Qwen3 config.json as Qwen2 (its head_dim ignored) while `convert` refused it: all
    three commands now share convert's check and print the same line, exit 2, before anything starts."""
    import ray

    monkeypatch.setattr(ray, "init", lambda *a, **k: pytest.fail("an unmodelled architecture reached ray.init"))
    monkeypatch.chdir(tmp_path)
    d = tmp_path / "qwen3"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({**json.loads((SHAPES / "qwen2.5-7b-instruct" / "config.json")
                                                            .read_text()), **change}))
    (d / "tokenizer.json").write_text("{}")
    outputs = [_main_lines(["plan", f"model.path={d}", "rollout.max_response_length=64"]),
               _main_lines(["train", f"model.path={d}", "plan.check=skip"]),
               _main_lines(["convert", "hf-to-mcore", "--hf", str(d), "--out", str(tmp_path / "out")])]
    for rc, lines in outputs:
        assert rc == 2 and len(lines) == 1 and "is not supported" in lines[0], lines
    assert outputs[0][1] == outputs[1][1] == outputs[2][1]
    assert f"{d}/config.json: architecture" in outputs[0][1][0]
    with pytest.raises(UserError, match="is not supported"):
        Arch.from_path(d)
