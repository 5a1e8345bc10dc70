"""The learning-parity workload and benchmark bookkeeping: the warm start's answer-only share (which problems lose
their worked steps, deterministically, and the config refusal where no answer line exists), and the benchmark's
curve arithmetic on hand-built curves (interpolation, area under the curve, the paired t interval, the
verdict). No engines run; the benchmark itself runs real RL (benchmarks/learning_parity.py)."""

from __future__ import annotations

import statistics

import pytest

from benchmarks.learning_parity import BASELINE, area_under_curve, interp, paired_interval, summarize
from megatron_sortedrl.config import load_config
from megatron_sortedrl.errors import ConfigError
from megatron_sortedrl.warmup import answer_only, sft_problems


def test_answer_only_share_cuts_a_fixed_share_to_the_answer_line():
    cfg = load_config("configs/learning_cpu.yaml", ["trainer.warmup_sft_problems=2000"])
    pool = sft_problems(cfg, [])
    cut = [p for p in pool if "\n" not in p.solution]
    assert len(pool) == 2000
    assert all(p.solution == f"#### {p.ground_truth}" for p in cut)  # exactly the answer line of the worked one
    assert abs(len(cut) / len(pool) - cfg.trainer.warmup_answer_only_share) < 0.04  # binomial, sd 0.011
    again = sft_problems(cfg, [])
    assert [p.solution for p in again] == [p.solution for p in pool]  # the same problems lose their steps
    none = sft_problems(load_config("configs/learning_cpu.yaml", ["trainer.warmup_sft_problems=200",
                                                                  "trainer.warmup_answer_only_share=0"]), [])
    assert all(p.solution.count("\n") >= 1 for p in none)
    assert answer_only("0+1+2=3\n#### 3", "3") == "#### 3"
    assert answer_only("a1+1+0=10\n", "10") == "#### 10"  # column_addition writes no answer line: one is made


def test_a_direct_answer_scores_0_in_column_addition():
    from megatron_sortedrl.data.column_addition import answer_of, solve
    from megatron_sortedrl.rewards.column_addition import reward
    from megatron_sortedrl.sample import Sample

    # the learning workload's premise: its reward reads only the column lines, so skipping the work never pays
    assert answer_of(solve("101", "111")) == "1100"
    for text in ("#### 1100", "a1+1+0=10\nb0+1+1=10\nc1+1+1=11\n#### 1100"):
        assert reward(Sample(prompt_id="p", index=0, response_text=text), "1100") == 0.0


def test_answer_only_share_is_refused_where_solutions_have_no_answer_line():
    with pytest.raises(ConfigError, match="trainer.warmup_answer_only_share"):
        load_config("configs/learning_cpu.yaml", ["data.task=knights_knaves", "data.min_difficulty=2",
                                                  "data.max_difficulty=3"])
    with pytest.raises(ConfigError, match="trainer.warmup_answer_only_share"):
        load_config("configs/learning_cpu.yaml", ["trainer.warmup_answer_only_share=1.5"])


def _curve(accs, every=10, wall_per=2.0):
    return [{"drawn": i * every, "trained": i * every, "wall_s": i * wall_per, "updates": i, "version": i,
             "accuracy": a, "kl_to_warm": 0.01 * i} for i, a in enumerate(accs)]


def test_curve_arithmetic():
    c = _curve([0.0, 0.5, 1.0])
    assert interp(c, "drawn", 5) == pytest.approx(0.25)
    assert interp(c, "drawn", 50) == 1.0  # past the end: the last value
    assert interp(c, "wall_s", 3.0) == pytest.approx(0.75)
    # trapezoids: (0 + .5)/2 * 10 + (.5 + 1)/2 * 10 = 10 over a budget of 20
    assert area_under_curve(c, 20) == pytest.approx(0.5)
    assert area_under_curve([{"drawn": 0, "accuracy": 0.2}, {"drawn": 10, "accuracy": 0.2}], 20) == pytest.approx(0.2)


def test_paired_interval_against_a_hand_computed_t_interval():
    d = [0.02, 0.05, -0.01]
    v = paired_interval(d)
    half = 4.303 * statistics.stdev(d) / 3 ** 0.5
    assert v["mean"] == pytest.approx(0.02) and v["low"] == pytest.approx(0.02 - half)
    assert not v["resolved"]  # 0 lies inside
    assert paired_interval([0.10, 0.11, 0.12])["resolved"]
    assert paired_interval([0.1])["low"] is None


def _run(accs, wall_per, stale=0.0):
    return {"curve": _curve(accs, wall_per=wall_per),
            "figures": {"reward_mean": 0.3, "staleness_mean": stale, "staleness_hist": {"0": 10}}}


def test_summarize_verdict_and_equal_time():
    runs = {BASELINE: [_run([0.1, 0.3, 0.5], 4.0), _run([0.1, 0.35, 0.5], 4.0), _run([0.1, 0.3, 0.55], 4.0)],
            "twotier": [_run([0.1, 0.3, 0.5], 2.0), _run([0.1, 0.35, 0.52], 2.0), _run([0.1, 0.3, 0.55], 2.0)],
            "worse": [_run([0.1, 0.1, 0.2], 4.0), _run([0.1, 0.12, 0.22], 4.0), _run([0.1, 0.11, 0.18], 4.0)]}
    out = summarize(runs, budget=20, every=10)
    assert out["grid"] == [0, 10, 20] and out["equal_time_s"] == 4.0  # the fastest variant's median run time
    rows = {r["variant"]: r for r in out["rows"]}
    assert rows["twotier"]["accuracy_at_equal_time"]["median"] > rows[BASELINE]["accuracy_at_equal_time"]["median"]
    assert rows[BASELINE]["final_accuracy"] == {"median": 0.5, "min": 0.5, "max": 0.55}
    assert out["verdict"]["twotier"]["learns_as_well"]
    assert out["verdict"]["worse"]["final_accuracy_diff"]["resolved"]
    assert not out["verdict"]["worse"]["learns_as_well"]


def test_side_by_side_puts_the_simulators_speed_beside_the_learning(tmp_path):
    import json

    from benchmarks.learning_parity import side_by_side

    runs = {BASELINE: [_run([0.1, 0.3, 0.5], 4.0)] * 3, "twotier": [_run([0.1, 0.3, 0.5], 2.0)] * 3}
    result = {"summary": summarize(runs, budget=20, every=10)}
    sim = tmp_path / "sim.json"
    # the simulated column is the equal-footing ratio to the better sync, not the ratio to sync's recipe batch
    sim.write_text(json.dumps({"rows": [{"policy": "sync", "throughput_vs_sync": 1.0, "x_best_sync": 0.45},
                                        {"policy": "twotier", "throughput_vs_sync": 2.87, "x_best_sync": 1.28}]}))
    table = side_by_side(result, sim).splitlines()
    assert table[2].startswith("| sync | 0.45 | 1.00 | 0.500 |")
    assert table[3].startswith("| twotier | 1.28 | 2.00 | 0.500 |")  # measured: half the ms per sample


def test_curve_counts_drawn_samples_from_the_drivers_step_result():
    from benchmarks.learning_parity import Curve
    from megatron_sortedrl.driver import StepResult

    class D:  # the driver surface the hook reads: version and evaluate()
        version = 0

        def evaluate(self):
            return {"eval/accuracy": 0.25}

    curve, d = Curve(every=8, n=4, probe=None), D()
    curve.start(d, 0.0)
    curve(d, StepResult(1, {"time/step_s": 1.5}, batch=[object()] * 4))  # 4 drawn: no evaluation yet
    assert len(curve.points) == 1
    # dynamic sampling: 1 trained group, 2 filtered, 1 skipped prompt = 4 prompts x 4 samples drawn
    curve(d, StepResult(2, {"time/step_s": 2.0, "sampling/trained_groups": 1, "sampling/filtered_groups": 2,
                            "sampling/skipped_prompts": 1}, batch=[object()] * 4))
    assert (curve.drawn, curve.trained, curve.updates, curve.wall) == (20, 8, 2, 3.5)
    assert curve.points[-1] == {"drawn": 20, "trained": 8, "wall_s": 3.5, "updates": 2, "version": 0,
                                "accuracy": 0.25, "kl_to_warm": None}
    assert curve.next_at == 24  # the next evaluation after the next multiple of `every`
