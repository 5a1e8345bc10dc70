"""Experiment trackers: where the per-step metrics go besides `metrics.jsonl`. TensorBoard, Weights & Biases
and MLflow behind one small interface.

    trackers = open_trackers(cfg.logging, run_dir, config=to_dict(cfg), name=cfg.name, resumed_step=None)
    for t in trackers:
        t.log(step, {"reward/mean": 0.4})      # numeric scalars only
        t.close()

A tracker is anything with `log(step, scalars)` and `close()` (`Tracker`). `logging.tensorboard` turns on the
TensorBoard event files; `logging.trackers` lists the others (wandb, mlflow). Each one receives every numeric
scalar of every step's metrics row and, at start, the resolved run config (wandb: the run's config; MLflow: one
param per dotted key plus the whole config as the artifact `config.yaml`). A requeued or resumed run continues
the same wandb/MLflow run: their ids are kept in `<run_dir>/trackers.json`.

wandb and MLflow are optional dependencies (`pip install 'megatron-sortedrl[tracking]'`); naming one that is not
installed fails when the config loads (`check_trackers_installed`), before anything starts. Offline and local
modes need no server: `logging.wandb_mode=offline` writes `<run_dir>/wandb/offline-run-*` (upload later with
`wandb sync`), `logging.mlflow_tracking_uri=file:<dir>` writes an MLflow file store.

Left out: the non-scalar entries of a metrics row (per-sample rewards, the staleness histogram), which stay in
`metrics.jsonl`; system metrics (wandb's own sampler is off: the run's NVML telemetry covers the GPUs); model
artifacts (checkpoints stay in the run directory).
"""

from __future__ import annotations

import importlib.util
import json
import os
import time
from pathlib import Path
from typing import Any, Protocol

from megatron_sortedrl.errors import ConfigError, UserError

TRACKERS = ("wandb", "mlflow")  # what logging.trackers accepts (TensorBoard has its own flag)
IDS_FILE = "trackers.json"  # run ids of the wandb/MLflow runs this run directory writes to
_PACKAGES = {"wandb": "wandb", "mlflow": "mlflow"}  # tracker -> module that must import


class Tracker(Protocol):
    """One metrics sink: `log` gets a step's numeric scalars, `close` flushes and ends the run."""

    def log(self, step: int, scalars: dict[str, float]) -> None: ...

    def close(self) -> None: ...


def check_trackers_installed(trackers: list[str]) -> None:
    """A ConfigError (one line, exit 2) for a selected tracker whose package is missing. Uses find_spec: the
    packages themselves take seconds to import."""
    for name in trackers:
        if importlib.util.find_spec(_PACKAGES[name]) is None:
            raise ConfigError("logging.trackers", list(trackers),
                              f"trackers whose package is installed: {name} needs `pip install "
                              f"'megatron-sortedrl[tracking]'` (or `pip install {name}`), or remove it from the list")


def flatten(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}: the dotted keys of the config, as `key=value` overrides name them."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, dict) and value:
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


class TensorBoardTracker:
    def __init__(self, log_dir: Path, purge_step: int | None) -> None:
        """`purge_step`: a resumed run's first step; TensorBoard hides the events at and after it that the
        interrupted run wrote."""
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(str(log_dir), purge_step=purge_step)

    def log(self, step: int, scalars: dict[str, float]) -> None:
        for key, value in scalars.items():
            self._writer.add_scalar(key, value, step)

    def close(self) -> None:
        self._writer.close()


def tensorboard_tracker(run_dir: Path, purge_step: int | None) -> list[Tracker]:
    """TensorBoard events under `<run_dir>/tensorboard`, or none with one note when it cannot start (the jsonl
    file is the record; TensorBoard is optional)."""
    try:
        return [TensorBoardTracker(Path(run_dir) / "tensorboard", purge_step)]
    except Exception as exc:
        print(f"note: TensorBoard events not written ({type(exc).__name__}: {exc})")
        return []


class WandbTracker:
    def __init__(self, run_dir: Path, project: str, name: str, entity: str, mode: str, config: dict[str, Any],
                 run_id: str | None) -> None:
        import wandb

        # resume="allow" with the kept id: a requeued job appends to the same run. wandb ignores a step lower
        # than one it already has, so steps redone after a resume keep their first values there.
        self.run = wandb.init(project=project, name=name, entity=entity or None, mode=mode or None,
                              dir=str(run_dir), config=config, id=run_id, resume="allow" if run_id else None,
                              settings=wandb.Settings(console="off", x_disable_stats=True, silent=True))
        self.run_id = self.run.id

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log(scalars, step=step)

    def close(self) -> None:
        self.run.finish()


class MlflowTracker:
    BATCH = 100  # MLflow's REST limit on params (and a safe size for metrics) per log_batch call

    def __init__(self, tracking_uri: str, experiment: str, name: str, config: dict[str, Any],
                 run_id: str | None) -> None:
        if tracking_uri.startswith("file:"):
            # MLflow 3 refuses its file store unless asked for: the local, server-less mode this key documents.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=tracking_uri)  # explicit client: no process-global active run
        if run_id is None:
            exp = self.client.get_experiment_by_name(experiment)
            exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(experiment)
            run_id = self.client.create_run(exp_id, run_name=name).info.run_id
            # values as YAML/JSON would print them, cut to MLflow's 6000-character limit on a param value
            params = [Param(k, (v if isinstance(v, str) else json.dumps(v))[:6000]) for k, v in flatten(config).items()]
            for i in range(0, len(params), self.BATCH):
                self.client.log_batch(run_id, params=params[i:i + self.BATCH])
            self.client.log_dict(run_id, config, "config.yaml")
        else:
            self.client.update_run(run_id, status="RUNNING")
        self.run_id = run_id

    def log(self, step: int, scalars: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(k, float(v), now, step) for k, v in scalars.items()]
        for i in range(0, len(metrics), self.BATCH):
            self.client.log_batch(self.run_id, metrics=metrics[i:i + self.BATCH])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def open_trackers(logging_cfg: Any, run_dir: Path, config: dict[str, Any], name: str,
                  resumed_step: int | None) -> list[Tracker]:
    """The trackers `logging_cfg` (`LoggingConfig`) selects. A new run (resumed_step None) starts new wandb/MLflow
    runs; a resumed one continues those recorded in `<run_dir>/trackers.json`. TensorBoard failing to open is a
    note (the jsonl file is the record, as before); a selected wandb or MLflow that fails to start is an error."""
    run_dir = Path(run_dir)
    out: list[Tracker] = []
    if logging_cfg.tensorboard:
        out += tensorboard_tracker(run_dir, None if resumed_step is None else resumed_step + 1)
    ids_path = run_dir / IDS_FILE
    ids = json.loads(ids_path.read_text()) if resumed_step is not None and ids_path.exists() else {}
    run_name = logging_cfg.run_name or name
    try:
        if "wandb" in logging_cfg.trackers:
            what = "wandb (check `wandb login` or WANDB_API_KEY, or set logging.wandb_mode=offline)"
            w = WandbTracker(run_dir, logging_cfg.project, run_name, logging_cfg.wandb_entity,
                             logging_cfg.wandb_mode, config, ids.get("wandb"))
            ids["wandb"] = w.run_id
            out.append(w)
        if "mlflow" in logging_cfg.trackers:
            uri = (logging_cfg.mlflow_tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
                   or f"file:{(run_dir / 'mlruns').resolve()}")
            what = f"MLflow at {uri} (check logging.mlflow_tracking_uri)"
            m = MlflowTracker(uri, logging_cfg.project, run_name, config, ids.get("mlflow"))
            ids["mlflow"] = m.run_id
            out.append(m)
    except Exception as exc:  # a login, a server, a store: the user's setup, so one line, not a traceback
        for started in out:
            started.close()
        first = (str(exc).strip().splitlines() or [""])[0]
        raise UserError(f"logging.trackers: {what} did not start: {type(exc).__name__}: {first}") from exc
    if logging_cfg.trackers:
        ids_path.write_text(json.dumps(ids))
    return out
