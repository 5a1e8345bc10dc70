"""Experiment trackers (`telemetry/trackers.py`): wandb in offline mode and MLflow on a local file store get every
numeric metric of every step and the resolved run config, read back with their own formats and client; a resumed
run continues the same tracker runs; a selected tracker whose package is missing, or that cannot start, stops the
run in one line.

    python -m pytest tests/test_trackers.py -q -m 'not slow'  # 15-40 s on 2 cores (importing mlflow dominates)
    python -m pytest tests/test_trackers.py -q -m slow        # a real RL run logging to both, 2-3 minutes
"""

from __future__ import annotations

import importlib.util
import json
import math
import struct
from pathlib import Path

import pytest
import yaml

from megatron_sortedrl.cli import main
from megatron_sortedrl.config import load_config, to_dict
from megatron_sortedrl.metrics import read_metrics
from megatron_sortedrl.run_records import RunRecords
from megatron_sortedrl.telemetry.trackers import IDS_FILE, flatten

pytest.importorskip("wandb")
pytest.importorskip("mlflow")

ROWS = [  # three steps as the driver logs them: scalars, a bool, a non-finite value, non-scalar entries
    {"reward/mean": 0.25, "reward/accuracy": 0.5, "rollout/bubble_ratio": 0.125, "time/step_s": 3.5,
     "policy/version": 1, "spec/enabled": True, "loss/kl": float("nan"), "reward/per_sample": {"p0#0": 1.0}},
    {"reward/mean": 0.5, "reward/accuracy": 0.75, "rollout/bubble_ratio": 0.0625, "time/step_s": 2.25,
     "policy/version": 2, "spec/enabled": False, "loss/kl": 0.01, "rollout/staleness_hist": {"0": 4}},
    {"reward/mean": 0.75, "reward/accuracy": 1.0, "rollout/bubble_ratio": 0.03125, "time/step_s": 2.0,
     "policy/version": 3, "spec/enabled": True, "loss/kl": 0.02},
]


@pytest.fixture(scope="module", autouse=True)
def _wandb_service_ends():
    """wandb keeps a service process until interpreter exit; end it with this module, so the suite's
    leftover-process check does not find (and kill) it and wandb's exit hook does not then fail."""
    yield
    import wandb

    wandb.teardown()


def _config(run_dir: Path):
    return load_config(None, [f"logging.run_dir={run_dir}", "logging.trackers=[wandb,mlflow]",
                              "logging.wandb_mode=offline", f"logging.mlflow_tracking_uri=file:{run_dir / 'mlruns'}",
                              "logging.project=trackers-test", "logging.tensorboard=false"])


def _wandb_records(run_file: Path) -> list:
    """The records of a wandb transaction log (`run-<id>.wandb`): a 7-byte header, then LevelDB-log records in
    32 KiB blocks, each with a 7-byte header (crc32, length, type: 1 full, 2 first, 3 middle, 4 last)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, block, pos, buf, out = run_file.read_bytes(), 32768, 7, b"", []
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:
            pos += left
            continue
        buf += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(buf)
            out.append(rec)
            buf = b""
    return out


def _expected(rows: list[dict]) -> dict[int, dict[str, float]]:
    """What the trackers must hold: per step, the numeric, finite scalars of metrics.jsonl (bools as 0/1); rows
    of one step (a step's row and its eval line) merge."""
    out: dict[int, dict[str, float]] = {}
    for r in rows:
        out.setdefault(r["step"], {}).update(
            {k: v for k, v in r.items() if k not in ("step", "t") and isinstance(v, (int, float))})
    return out


def _wandb_history(run_dir: Path, run_id: str) -> dict[int, dict[str, float]]:
    (run_file,) = (run_dir / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb")
    history: dict[int, dict[str, float]] = {}
    for r in _wandb_records(run_file):
        if r.WhichOneof("record_type") == "history":
            # a key with "/" comes as a one-element nested_key
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
            history.setdefault(items.pop("_step"), {}).update({k: v for k, v in items.items() if not k.startswith("_")})
    return history


def test_wandb_and_mlflow_get_every_metric_and_the_config(tmp_path):
    from mlflow.tracking import MlflowClient

    run_dir = tmp_path / "run"
    cfg = _config(run_dir)
    records = RunRecords(cfg, run_dir, resumed_step=None, clock_epoch=None, printer=lambda _: None)
    for step, row in enumerate(ROWS, 1):
        records.metrics.log(step, row)
    for close in records.closers():
        close()
    expected = _expected(read_metrics(run_dir))
    assert sorted(expected) == [1, 2, 3] and "loss/kl" not in expected[1] and expected[2]["spec/enabled"] == 0
    config = to_dict(cfg)
    ids = json.loads((run_dir / IDS_FILE).read_text())

    # MLflow, read back with its client: every metric's full history, one param per dotted key, the config file.
    client = MlflowClient(tracking_uri=f"file:{run_dir / 'mlruns'}")
    run = client.get_run(ids["mlflow"])
    assert run.info.status == "FINISHED" and run.info.run_name == cfg.name
    assert client.get_experiment(run.info.experiment_id).name == "trackers-test"
    names = {k for values in expected.values() for k in values}
    assert set(run.data.metrics) == names
    for name in names:
        history = {m.step: m.value for m in client.get_metric_history(ids["mlflow"], name)}
        assert history == {s: float(v[name]) for s, v in expected.items() if name in v}, name
    params = {k: v if isinstance(v, str) else json.dumps(v) for k, v in flatten(config).items()}
    assert run.data.params == params
    assert params["logging.trackers"] == '["wandb", "mlflow"]' and params["rollout.max_response_length"]
    artifact = Path(client.download_artifacts(ids["mlflow"], "config.yaml", str(tmp_path / "dl")))
    assert yaml.safe_load(artifact.read_text()) == config

    # wandb offline: the run's transaction log holds the config and one history record per step.
    (run_file,) = (run_dir / "wandb").glob(f"offline-run-*-{ids['wandb']}/run-{ids['wandb']}.wandb")
    (run_rec,) = [r.run for r in _wandb_records(run_file) if r.WhichOneof("record_type") == "run"]
    assert run_rec.project == "trackers-test" and run_rec.display_name == cfg.name
    logged_config = {i.key: json.loads(i.value_json) for i in run_rec.config.update if i.key != "_wandb"}
    assert logged_config == config
    history = _wandb_history(run_dir, ids["wandb"])
    assert history.keys() == expected.keys()
    for step, values in expected.items():
        assert history[step].keys() == values.keys()
        assert all(math.isclose(history[step][k], v) for k, v in values.items()), (step, history[step])

    # A resumed run (requeue) continues both tracker runs instead of starting new ones.
    records = RunRecords(cfg, run_dir, resumed_step=3, clock_epoch=None, printer=lambda _: None)
    records.metrics.log(4, {"reward/mean": 1.0})
    for close in records.closers():
        close()
    assert json.loads((run_dir / IDS_FILE).read_text()) == ids
    assert [(m.step, m.value) for m in client.get_metric_history(ids["mlflow"], "reward/mean")][-1] == (4, 1.0)


def test_a_selected_tracker_that_is_not_installed_is_one_line(monkeypatch, capsys, tmp_path):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real(name, *a))
    # `train` stops at config load, before Ray or anything else starts: exit 2 and one line naming the key.
    rc = main(["train", "configs/tiny_cpu.yaml", f"logging.run_dir={tmp_path}", "logging.trackers=[mlflow]"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "\n" not in err, err
    assert err == ("error: config error: logging.trackers=['mlflow'] is not allowed; expected trackers whose package "
                   "is installed: mlflow needs `pip install 'megatron-sortedrl[tracking]'` (or `pip install mlflow`), "
                   "or remove it from the list")
    assert not (tmp_path / "metrics.jsonl").exists()
    # Unknown names and bad modes are refused the same way.
    assert main(["config", "configs/tiny_cpu.yaml", "logging.trackers=[comet]"]) == 2
    assert main(["config", "configs/tiny_cpu.yaml", "logging.wandb_mode=sometimes"]) == 2


@pytest.mark.slow
def test_an_rl_run_logs_every_step_to_wandb_and_mlflow(tiny_model_dir, tmp_path):
    """The driver's own rows (rewards, rollout, train, sync, spec, time per phase ...), not a hand-made list."""
    from mlflow.tracking import MlflowClient

    from megatron_sortedrl.driver import Driver

    run_dir = tmp_path / "run"
    cfg = load_config("configs/tiny_cpu.yaml", [
        f"model.path={tiny_model_dir}", f"logging.run_dir={run_dir}", "trainer.total_steps=2",
        "trainer.warmup_sft_steps=5", "trainer.eval_interval=0", "checkpoint.save_interval=0",
        "rollout.max_response_length=48", "data.num_eval_prompts=4", "logging.tensorboard=false",
        "scheduler.rollout_batch_size=4", "scheduler.update_batch_size=8", "scheduler.group_size=4",
        "logging.trackers=[wandb,mlflow]", "logging.wandb_mode=offline"])
    driver = Driver(cfg, printer=print)
    try:
        driver.run()
    finally:
        driver.close()
    expected = _expected(read_metrics(run_dir))
    assert {1, 2} <= expected.keys() and len(expected[2]) > 30  # the step rows are full rows
    ids = json.loads((run_dir / IDS_FILE).read_text())
    client = MlflowClient(tracking_uri=f"file:{(run_dir / 'mlruns').resolve()}")  # the default URI
    for name in {k for values in expected.values() for k in values}:
        history = {m.step: m.value for m in client.get_metric_history(ids["mlflow"], name)}
        assert history == pytest.approx({s: float(v[name]) for s, v in expected.items() if name in v}), name
    history = _wandb_history(run_dir, ids["wandb"])
    assert history.keys() == expected.keys()
    for step, values in expected.items():
        assert history[step] == pytest.approx(values), step


def test_a_tracker_that_cannot_start_is_one_line(tmp_path):
    from megatron_sortedrl.errors import UserError

    run_dir = tmp_path / "run"
    cfg = load_config(None, [f"logging.run_dir={run_dir}", "logging.trackers=[mlflow]", "logging.tensorboard=false",
                             "logging.mlflow_tracking_uri=file:/proc/no-such-store"])
    with pytest.raises(UserError) as err:
        RunRecords(cfg, run_dir, resumed_step=None, clock_epoch=None, printer=lambda _: None)
    line = str(err.value)
    assert "\n" not in line and line.startswith(
        "logging.trackers: MLflow at file:/proc/no-such-store (check logging.mlflow_tracking_uri) did not start: ")
