"""The mismatch benchmark's bookkeeping (benchmarks/moe_mismatch.py): what it reads from a step row, how a run and
a variant are summarised, and the verdict "R3 MoE mismatch <= dense" computed from the figures; plus the
`rollout.dtype` key it runs the engines with. No engines, no trainer: fast.

    python -m pytest tests/test_moe_mismatch_bench.py -q
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks import moe_mismatch as mm  # noqa: E402


def _step(lad, k3, out, n, entropy=1.0):
    return {"logp_abs_diff": lad, "k3_kl": k3, "ratio_out_of_band": out, "n_tokens": n, "entropy": entropy}


def _run(variant, dtype, rep, lad, k3=None, out=0.0):
    s = _step(lad, lad ** 2 / 2 if k3 is None else k3, out, 100)
    return {"variant": variant, "engine_dtype": dtype, "repeat": rep, "summary": mm.run_summary([s])}


def test_step_figures_reads_the_names_the_loss_logs():
    """The trainer's mismatch terms (algorithms.py), logged with the driver's `train/` prefix, are what the
    benchmark reads; a renamed metric would leave the figures None and fail here."""
    from megatron_sortedrl.algorithms import mismatch_terms

    old = torch.tensor([-1.0, -2.0, -0.5, -3.0])
    rollout = torch.tensor([-1.1, -2.0, -0.5, -1.0])  # the last token's ratio exp(-2) leaves [0.5, 2]
    row = {f"train/{k}": float(v.mean()) for k, v in mismatch_terms(old, rollout).items()}
    row.update({"step": 3, "train/n_tokens": 4.0, "train/entropy": 0.7, "reward/mean": 0.25})
    fig = mm.step_figures(row)
    assert fig["logp_abs_diff"] == pytest.approx((0.1 + 2.0) / 4)
    assert fig["ratio_out_of_band"] == pytest.approx(0.25)
    d = torch.tensor([0.1, 0.0, 0.0, -2.0])  # log rho = trainer - engine per token: k3 = rho - 1 - log rho
    assert fig["k3_kl"] == pytest.approx(float((d.exp() - d - 1).mean()), rel=1e-5)
    assert (fig["step"], fig["n_tokens"], fig["entropy"], fig["reward"]) == (3, 4.0, 0.7, 0.25)


def test_run_summary_weights_steps_by_tokens():
    steps = [_step(0.01, 1e-4, 0.0, 300, entropy=2.0), _step(0.05, 1e-3, 0.1, 100, entropy=1.0),
             {"logp_abs_diff": None, "n_tokens": 50}]  # a step without the metric is left out of its mean
    s = mm.run_summary(steps)
    assert s["logp_abs_diff"] == pytest.approx((0.01 * 300 + 0.05 * 100) / 400)
    assert s["k3_kl"] == pytest.approx((1e-4 * 300 + 1e-3 * 100) / 400)
    assert s["ratio_out_of_band"] == pytest.approx(0.1 * 100 / 400)
    assert s["entropy"] == pytest.approx(1.75)
    assert (s["steps"], s["tokens"], s["routed_share"]) == (3, 450, None)


def test_summarize_median_min_max_per_dtype_and_variant():
    runs = [_run("dense", "bfloat16", r, v) for r, v in enumerate([3e-3, 1e-3, 2e-3])]
    runs += [_run("moe", "bfloat16", r, v) for r, v in enumerate([9e-3, 7e-3, 8e-3])]
    runs += [_run("dense", "float32", r, v) for r, v in enumerate([1e-7, 3e-7, 2e-7])]
    rows = mm.summarize(runs)
    assert [(r["engine_dtype"], r["variant"]) for r in rows] == [("bfloat16", "dense"), ("bfloat16", "moe"),
                                                                  ("float32", "dense")]
    lad = rows[1]["logp_abs_diff"]
    assert (lad["median"], lad["min"], lad["max"]) == pytest.approx((8e-3, 7e-3, 9e-3))
    assert lad["per_repeat"] == pytest.approx([9e-3, 7e-3, 8e-3])  # in repeat order
    assert rows[0]["routed_share"] is None and rows[0]["repeats"] == 3


def _rows(dense, r3, moe):
    runs = [_run("dense", "bfloat16", i, v) for i, v in enumerate(dense)]
    runs += [_run("moe+r3", "bfloat16", i, v) for i, v in enumerate(r3)]
    runs += [_run("moe", "bfloat16", i, v) for i, v in enumerate(moe)]
    return mm.summarize(runs)


def test_verdict_holds_when_r3_moe_is_at_most_dense():
    v = mm.verdict(_rows(dense=[2e-3, 3e-3, 4e-3], r3=[1e-3, 2e-3, 3e-3], moe=[8e-3, 1e-2, 1.2e-2]))
    res = v["bfloat16"]
    assert res["r3_moe_le_dense"] is True
    x = res["metrics"]["logp_abs_diff"]
    assert (x["dense"], x["moe_r3"], x["moe"]) == pytest.approx((3e-3, 2e-3, 1e-2))
    assert x["moe_over_r3"] == pytest.approx(5.0) and x["r3_over_dense"] == pytest.approx(2 / 3)
    assert "float32" not in v  # no rows there: no verdict
    assert "R3 MoE mismatch <= dense holds" in mm.verdict_lines(v)[0]


def test_verdict_fails_when_r3_moe_is_worse_and_says_whether_beyond_the_spread():
    beyond = mm.verdict(_rows(dense=[1e-3, 2e-3, 3e-3], r3=[4e-3, 5e-3, 6e-3], moe=[5e-3, 6e-3, 7e-3]))["bfloat16"]
    assert beyond["r3_moe_le_dense"] is False
    assert beyond["metrics"]["logp_abs_diff"]["within_spread"] is False
    line = mm.verdict_lines({"bfloat16": beyond})[0]
    assert "does not hold" in line and "worse beyond the seed spread" in line
    within = mm.verdict(_rows(dense=[1e-3, 2e-3, 3e-3], r3=[2.5e-3, 2.6e-3, 2.7e-3], moe=[3e-3] * 3))["bfloat16"]
    assert within["r3_moe_le_dense"] is False and within["metrics"]["logp_abs_diff"]["within_spread"] is True
    assert "within the seed spread" in mm.verdict_lines({"bfloat16": within})[0]


def test_verdict_needs_every_metric():
    """One metric worse is enough to fail the verdict (k3 here), even if the others are better."""
    runs = [_run("dense", "bfloat16", 0, 2e-3, k3=1e-6), _run("moe+r3", "bfloat16", 0, 1e-3, k3=2e-6)]
    v = mm.verdict(mm.summarize(runs))["bfloat16"]
    assert v["metrics"]["logp_abs_diff"]["r3_moe_le_dense"] and not v["metrics"]["k3_kl"]["r3_moe_le_dense"]
    assert v["r3_moe_le_dense"] is False


def test_markdown_and_plot_from_a_result(tmp_path):
    rows = _rows(dense=[2e-3, 3e-3, 4e-3], r3=[1e-3, 2e-3, 3e-3], moe=[8e-3, 1e-2, 1.2e-2])
    setup = {"command": "python benchmarks/moe_mismatch.py", "machine": "x86_64 2 CPUs", "date": "d", "benchmark_s": 60,
             "config": "configs/tiny_cpu.yaml", "task": "arithmetic", "prompts": 48, "n": 4, "epochs": 1,
             "max_response_length": 96, "models": {"shared": "hidden 64"}, "seeds": [0, 1, 2], "repeats": 3,
             "warm_start": {"dense": {"steps": 600, "final_loss": 0.014}}, "machine_note": "shared.",
             "load_average": {"min": 16.0, "median": 47.0, "max": 91.0}}
    probes = {"dense": {"logp_abs_diff": 2e-3, "logp_abs_diff_max": 0.5},
              "moe": {"logp_abs_diff": 1e-3, "logp_abs_diff_max": 0.07, "flip_share": 0.0068, "token_flip_share": 0.018,
                      "logp_abs_diff_flipped": 3.5e-3, "logp_abs_diff_unflipped": 1.1e-3, "logp_abs_diff_replayed": 1.2e-3,
                      "logp_abs_diff_replayed_flipped": 4e-3}}
    result = {"setup": setup, "rows": rows, "verdict": mm.verdict(rows), "reading": "By hand.", "precision_probe": probes}
    md = mm.markdown(result, "moe_mismatch")
    assert "| bfloat16 | moe+r3 | 2.00e-03 (1.00e-03-3.00e-03) |" in md
    header, rule, *body = md.split("| engine dtype |", 1)[1].split("\n\n")[0].splitlines()
    assert {line.count("|") for line in [rule, *body]} == {("| engine dtype |" + header).count("|")}  # no cell missing
    assert "R3 MoE mismatch <= dense holds" in md and "## Reading this run" in md
    assert "dense 600 supervised steps, final loss 0.014" in md and "median 47.0, range 16.0-91.0" in md
    assert "| moe | 1.00e-03 | 0.070 | 0.68% | 1.80% | 3.50e-03 / 1.10e-03 | 1.20e-03 / 4.00e-03 |" in md
    assert "| dense | 2.00e-03 | 0.500 | - | - | - / - | - / - |" in md
    mm.plot(result, tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 1000
    json.dumps(result)  # the JSON the script writes


@pytest.mark.parametrize("argv", [["--variants", "dense,mixtral"], ["--engine-dtypes", "fp8"], ["--prompts", "12"],
                                  ["--repeats", "0"]])
def test_bad_arguments_exit_2_in_one_line(argv, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["moe_mismatch.py", *argv])
    assert mm.main() == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ")


def test_rollout_dtype_reaches_the_engines_and_defaults_to_the_model_dtype(tmp_path):
    from megatron_sortedrl.config import load_config
    from megatron_sortedrl.errors import ConfigError
    from megatron_sortedrl.rollout.pool_options import PoolOptions

    keys = [f"model.path={tmp_path / 'none'}"]
    assert PoolOptions.from_config(load_config(ROOT / "configs/tiny_cpu.yaml", keys)).dtype == "float32"
    cfg = load_config(ROOT / "configs/tiny_cpu.yaml", keys + ["rollout.dtype=bfloat16"])
    assert (cfg.model.dtype, PoolOptions.from_config(cfg).dtype) == ("float32", "bfloat16")
    with pytest.raises(ConfigError, match="rollout.dtype"):
        load_config(ROOT / "configs/tiny_cpu.yaml", keys + ["rollout.dtype=fp8"])


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    from megatron_sortedrl.tiny_model import build_tiny_qwen3

    return build_tiny_qwen3(tmp_path_factory.mktemp("moe"), moe=True, seed=0)


def test_probe_replay_of_own_routes_changes_nothing_and_of_other_routes_does(tiny_moe):
    """The probe's replay (routes forced, probabilities the model's own): forcing the routes the model picked
    anyway gives its log-probs back; forcing others moves them (a wrong gather or renormalisation fails here)."""
    from transformers import AutoModelForCausalLM

    from benchmarks.moe_precision_probe import _next_logp, _Routes

    model = AutoModelForCausalLM.from_pretrained(str(tiny_moe), dtype=torch.float32).eval()
    routes = _Routes(model)
    seq = [5, 9, 14, 3, 22, 7, 11, 30, 2, 17]
    own = _next_logp(model, seq)
    picked = dict(routes.picked)
    assert len(picked) == 2 and picked[0].shape == (len(seq), 2)
    routes.forced = picked
    assert torch.allclose(_next_logp(model, seq), own, atol=1e-12)
    routes.forced = {i: (p + 1) % 4 for i, p in picked.items()}
    assert (_next_logp(model, seq) - own).abs().max() > 1e-3


def test_probe_figures(tiny_moe):
    from benchmarks.moe_precision_probe import probe

    seqs = [[5, 9, 14, 3, 22, 7, 11, 30, 2, 17], [8, 8, 21, 4, 13, 6, 19]]
    out = probe(tiny_moe, seqs, [4, 3])
    assert out["tokens"] == 6 + 4  # response positions only
    assert 0 < out["logp_abs_diff"] < 0.5  # bf16 differs from fp32, a little
    assert 0 <= out["flip_share"] <= 1 and 0 <= out["token_flip_share"] <= 1
    assert out["logp_abs_diff_replayed"] is not None and "logp_abs_diff_replayed_flipped" in out
