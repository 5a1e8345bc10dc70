"""The utilization report rendered from the checked-in sample run (tests/data/nvml_sample*.jsonl).

    python -m pytest tests/test_telemetry_report.py -q

The sample: 2 GPUs on one host, one row per GPU every 0.5 s for t = 0.0 .. 9.5 (20 rows each).
Timeline: step 0 rollout [0, 4), reward [4, 5), train [5, 8); step 1 rollout [8.5, 10); nothing in [8, 8.5).
GPU 0 util: 100 for t < 2, 0 for 2 <= t < 4, 0 in reward, 90 in train, 0 at 8.0, 100 in step 1.
GPU 1 util: 100 in step 0's rollout, 0 in reward, 90 in train, 0 at 8.0, then 100, 100, 40.
Rollout requests: step 0 worker 0 finishes at 1 and 2, worker 1 at 3 and 4 (abort); step 1 at 10 and 9.7.
"""

from __future__ import annotations

import csv
import shutil
from pathlib import Path

import pytest

from megatron_sortedrl.cli import main
from megatron_sortedrl.telemetry.nvml import read_samples
from megatron_sortedrl.telemetry.report import render
from megatron_sortedrl.telemetry.timeline import read_timeline

DATA = Path(__file__).parent / "data"
SAMPLES = DATA / "nvml_sample.jsonl"
TIMELINE = DATA / "nvml_sample_timeline.jsonl"

# Idle fraction = 1 - mean(util)/100 over the GPU's samples in the phase.
EXPECTED_IDLE = {
    (0, "rollout"): 1 - (4 * 100 + 4 * 0 + 3 * 100) / 1100,  # 8 samples in step 0 + 3 in step 1
    (1, "rollout"): 1 - (8 * 100 + 100 + 100 + 40) / 1100,
    (0, "reward"): 1.0, (1, "reward"): 1.0,
    (0, "train"): 0.1, (1, "train"): 0.1,
    (0, "none"): 1.0, (1, "none"): 1.0,  # the sample at t = 8.0
    (0, "all"): 1 - (700 + 540) / 2000, (1, "all"): 1 - (1040 + 540) / 2000,
}


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("report")
    return render(read_samples(SAMPLES), read_timeline(TIMELINE), out, max_batch=2)


def test_idle_fraction_per_gpu_and_phase(report):
    got = {(r.gpu, r.phase): r.idle_fraction for r in report.summary}
    assert got == pytest.approx(EXPECTED_IDLE)
    samples = {(r.gpu, r.phase): r.samples for r in report.summary}
    assert samples[(0, "rollout")] == 11 and samples[(0, "train")] == 6 and samples[(0, "all")] == 20
    seconds = {(r.gpu, r.phase): r.seconds for r in report.summary}
    assert seconds[(1, "train")] == pytest.approx(3.0)  # 6 samples x 0.5 s
    power = {(r.gpu, r.phase): r.mean_power_w for r in report.summary}
    assert power[(0, "rollout")] == pytest.approx((7 * 300 + 4 * 100) / 11)  # 300 W busy, 100 W idle


def test_steps_table_has_breakdown_and_bubbles(report):
    assert report.steps[0] == pytest.approx({"rollout": 4.0, "reward": 1.0, "train": 3.0, "idle": 0.5,
                                             # worker 0 idle 2 of 4 s, worker 1 busy to the end
                                             "worker_bubble": (4 - 2) / (2 * 4),
                                             # sequence-seconds 1 + 2 + 3 + 4 of 2 slots x 2 workers x 4 s
                                             "slot_bubble": 1 - 10 / 16,
                                             # every request ended by the phase end: nothing waited on the driver
                                             "driver_idle": 0.0})
    assert report.steps[1] == pytest.approx({"rollout": 1.5, "idle": 0.0, "worker_bubble": 0.3 / 3,
                                             "slot_bubble": 1 - 2.7 / 6, "driver_idle": 0.0})


def test_breakdown_stacks_seconds_only_and_tables_read_in_phase_order(report):
    from megatron_sortedrl.telemetry.report import step_columns

    assert step_columns(report.steps, ratios=False) == ["rollout", "reward", "train", "idle"]
    assert step_columns(report.steps) == ["rollout", "reward", "train", "idle", "worker_bubble", "slot_bubble",
                                          "driver_idle"]


def test_headline_figures(report):
    # Pooled over steps: idle worker-seconds (2 + 0.3) over worker-seconds (2 x 4 + 2 x 1.5).
    assert report.headline == pytest.approx({"gpus": 2, "recorded_s": 10.0, "idle_fraction": (0.38 + 0.21) / 2,
                                             "worker_bubble": 2.3 / 11, "slot_bubble": 1 - (10 + 2.7) / (16 + 6),
                                             "steps": 2, "mean_step_s": (8.5 + 1.5) / 2})
    assert "20.9%" in report.html.read_text()  # the pooled worker bubble, shown first


def test_report_files_figures_and_csv(report):
    assert set(report.figures) == {"utilization", "idle", "bubbles", "breakdown"}
    for path in report.figures.values():
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    html = report.html.read_text()
    assert html.count("data:image/png;base64,") == 4  # self-contained: every figure embedded
    assert "NVIDIA H100 80GB HBM3" in html and "Sampler cost" in html
    rows = list(csv.DictReader(open(report.out_dir / "summary.csv")))
    assert len(rows) == 10
    row = next(r for r in rows if r["gpu"] == "1" and r["phase"] == "rollout")
    assert float(row["idle_fraction"]) == pytest.approx(EXPECTED_IDLE[(1, "rollout")], abs=1e-4)
    steps = list(csv.DictReader(open(report.out_dir / "steps.csv")))
    assert [s["step"] for s in steps] == ["0", "1"] and float(steps[0]["worker_bubble"]) == 0.25


def test_heatmap_bins_match_the_sampling_interval():
    from megatron_sortedrl.telemetry.utilization import heatmap_grid

    keys, grid, t0, t1 = heatmap_grid(read_samples(SAMPLES))
    assert keys == [("node0", 0), ("node0", 1)]
    assert grid.shape == (2, 20) and (t0, t1) == pytest.approx((0.0, 10.0))
    assert list(grid[0, :8]) == [100] * 4 + [0] * 4 and grid[1, 19] == 40


def test_samples_alone_give_only_the_all_phase(tmp_path):
    rep = render(read_samples(SAMPLES), [], tmp_path)
    assert {r.phase for r in rep.summary} == {"all"}
    assert set(rep.figures) == {"utilization", "idle"}
    assert any("No timeline" in n for n in rep.notes)


def test_cli_on_a_run_directory(tmp_path, capsys):
    run = tmp_path / "run"
    (run / "nvml").mkdir(parents=True)
    shutil.copy(SAMPLES, run / "nvml" / "node0.jsonl")
    shutil.copy(TIMELINE, run / "timeline.jsonl")
    assert main(["nvml-report", str(run), "--max-batch", "2"]) == 0
    assert "report.html" in capsys.readouterr().out
    steps = list(csv.DictReader(open(run / "nvml_report" / "steps.csv")))
    assert float(steps[1]["slot_bubble"]) == pytest.approx(0.55)


def test_cli_on_a_sample_file_recorded_elsewhere(tmp_path):
    sample = tmp_path / "gpu_box.jsonl"
    shutil.copy(SAMPLES, sample)
    assert main(["nvml-report", str(sample)]) == 0
    assert (tmp_path / "gpu_box_report" / "utilization_heatmap.png").exists()


def test_cli_user_errors(tmp_path, capsys):
    assert main(["nvml-report", str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["nvml-report", str(tmp_path)]) == 2  # empty directory
    assert "no NVML samples and no timeline" in capsys.readouterr().err


def test_nvidia_smi_csv_is_read(tmp_path):
    path = tmp_path / "smi.csv"
    path.write_text(
        "timestamp, index, utilization.gpu [%], memory.used [MiB], power.draw [W], clocks.sm [MHz], temperature.gpu\n"
        "2025/01/01 10:00:00.000, 0, 80 %, 1000 MiB, 250.5 W, 1980 MHz, 55\n"
        "2025/01/01 10:00:00.500, 0, 20 %, 1000 MiB, 120.0 W, 1980 MHz, 55\n"
        "2025/01/01 10:00:01.000, 0, [N/A], 1000 MiB, 120.0 W, 1980 MHz, 55\n")
    s = read_samples(path)
    assert [r["t"] for r in s.rows] == pytest.approx([0.0, 0.5, 1.0])
    assert s.rows[0]["util"] == 80 and s.rows[0]["power_w"] == 250.5 and "util" not in s.rows[2]
    rep = render(s, [], tmp_path / "out")
    assert rep.summary[0].idle_fraction == pytest.approx(0.5)  # mean of 80 and 20; N/A row skipped
