"""The policy-comparison benchmark's bookkeeping on hand-built run directories: round length ratios from the
timeline, phase breakdown and medians from metrics, speed-ups with their spread (no engines run)."""

from __future__ import annotations

import json

import pytest

from benchmarks.policy_comparison import add_ratios, figures, median_row, round_lengths


def _run_dir(tmp_path, name, step_s, rollout_s, lengths_per_step, reward=0.5):
    d = tmp_path / name
    d.mkdir()
    events, rows, t = [], [{"step": 0, "t": 0.0, "eval/accuracy": 0.25}], 0.0
    for step, lengths in enumerate(lengths_per_step, start=1):
        events.append({"t": t, "kind": "phase", "event": "start", "step": step, "phase": "rollout"})
        for i, n in enumerate(lengths):
            events.append({"t": t, "kind": "request", "event": "submit", "step": step, "worker": 0,
                           "sample_id": f"s{step}-{i}", "tokens": 0})
            events.append({"t": t + rollout_s * n / max(lengths), "kind": "request", "event": "finish",
                           "step": step, "worker": 0, "sample_id": f"s{step}-{i}", "tokens": n})
        events.append({"t": t + rollout_s, "kind": "phase", "event": "end", "step": step, "phase": "rollout"})
        t += step_s
        rows.append({"step": step, "t": t, "time/step_s": step_s, "time/rollout_s": rollout_s, "time/train_s": 0.5,
                     "time/sync_s": 0.1, "time/history_s": 0.0, "rollout/samples": len(lengths),
                     "rollout/response_len": sum(lengths) / len(lengths), "rollout/bubble_ratio": 0.0,
                     "rollout/driver_idle_share": 0.01, "rollout/staleness_mean": 0.0, "rollout/staleness_hist": {"0": 4},
                     "reward/per_sample": {f"s{step}-{i}": reward for i in range(len(lengths))}})
    rows.append({"step": len(lengths_per_step), "t": t, "eval/accuracy": 0.5})
    (d / "timeline.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return d


def test_figures_round_ratio_phases_and_slot_bubble(tmp_path):
    d = _run_dir(tmp_path, "sync", step_s=2.0, rollout_s=1.2, lengths_per_step=[[10, 20, 20, 400], [20, 20, 30, 300]])
    assert round_lengths(d) == ([400 / 20, 300 / 25], 400)
    f = figures(d, max_num_seqs=4)
    assert f["trained_samples"] == 8 and f["s_per_sample_steps"] == pytest.approx(4.0 / 8)
    assert f["rollout_share"] == pytest.approx(0.6)
    # per update: train 0.5 s, sync 0.1 s, history 0, other = 2.0 - 1.2 - 0.6 = 0.2 s
    assert f["train_ms_per_update"] == pytest.approx(500) and f["other_ms_per_update"] == pytest.approx(200)
    assert f["fixed_ms_per_update"] == pytest.approx(800)
    # one engine with 4 slots; request i is active for n_i / max of the round: 1 - mean(n)/max(n)
    expected = 1 - ((10 + 20 + 20 + 400) / 400 + (20 + 20 + 30 + 300) / 300) / 8
    assert f["slot_bubble"] == pytest.approx(expected)
    assert f["final_eval_accuracy"] == 0.5 and f["reward_mean"] == 0.5


def test_speedup_and_spread(tmp_path):
    def runs(name, step_times):
        out = []
        for i, s in enumerate(step_times):
            d = _run_dir(tmp_path, f"{name}{i}", step_s=s, rollout_s=s / 2, lengths_per_step=[[10, 10, 10, 100]])
            out.append({**figures(d, 4), "accuracy_before_rl": 0.25, "run_dir": str(d)})
        return out

    rows = [median_row("sync", runs("sync", [4.0, 4.4, 3.6])), median_row("twotier", runs("twotier", [2.0, 2.2, 1.8]))]
    add_ratios(rows)
    sync, two = rows
    assert sync["ms_per_sample_median"] == pytest.approx(1000) and sync["ms_per_sample_min"] == pytest.approx(900)
    assert two["speedup_vs_sync"] == pytest.approx(2.0)
    assert two["speedup_vs_sync_min"] == pytest.approx(900 / 550) and two["speedup_vs_sync_max"] == pytest.approx(1100 / 450)
    assert not two["slower_than_sync_beyond_spread"] and not sync["slower_than_sync_beyond_spread"]
    assert two["reward_per_repeat"] == [0.5, 0.5, 0.5]
