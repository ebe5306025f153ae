"""MLflow: one MLflow run per fedsilo run, nested under its study's (or finetune run's) MLflow run.

The store: `[tracking] uri`, else $MLFLOW_TRACKING_URI, else a local SQLite store beside the run
directory (`<parent>/mlflow.db`, artifacts in `<parent>/mlartifacts/`), which `mlflow ui` run in that
folder opens with no server. The MLflow run's id is kept in the run directory's tracking.json, so a
resume continues the same MLflow run.

A tracking server that does not answer must not hold a run up for minutes: unless the user set them,
MLflow's HTTP requests get 2 retries, backoff factor 1 and a 30 s timeout (its defaults: 7, 2, 120 s).
"""
from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from pathlib import Path

from . import TrackedRun, read_state, write_state
from .metrics import ROUND, part

BACKEND = "mlflow"
STORE, ARTIFACTS = "mlflow.db", "mlartifacts"  # the default local store, beside the run directory
PARENT_TAG = "mlflow.parentRunId"  # how MLflow nests a run under another
HTTP_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
                 "MLFLOW_HTTP_REQUEST_TIMEOUT": "30"}
BATCH, PARAM_VALUE = 1000, 6000  # MLflow's limits: metrics per log_batch, characters in a parameter's value


def default_uri(run_dir: Path) -> str:
    """The local store beside a run directory: `sqlite:///<parent>/mlflow.db`."""
    return f"sqlite:///{Path(run_dir).resolve().parent / STORE}"


def artifact_root(uri: str) -> str | None:
    """Where a local SQLite store's experiments keep artifacts (beside the database); None: the
    server decides (a remote store)."""
    if not uri.startswith("sqlite:///"):
        return None
    return str(Path(uri[len("sqlite:///"):]).parent / ARTIFACTS)


def _quiet() -> None:
    """MLflow announces its database migrations on the first use of a store: not the user's business."""
    for name in ("mlflow.store.db.utils", "alembic", "alembic.runtime.migration"):
        logging.getLogger(name).setLevel(logging.WARNING)


class MLflowTracker:
    def __init__(self, client, run_id: str, uri: str, experiment_id: str) -> None:
        self.client, self.run_id, self.uri, self.experiment_id = client, run_id, uri, experiment_id

    def logged_through(self) -> int:
        steps = [m.step for m in self.client.get_metric_history(self.run_id, ROUND)]
        return max(steps, default=-1)

    def has_step(self, key: str, step: int) -> bool:
        return any(m.step == step for m in self.client.get_metric_history(self.run_id, key))

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(key, float(value), now, step) for key, value in metrics.items()]
        for i in range(0, len(batch), BATCH):
            self.client.log_batch(self.run_id, metrics=batch[i:i + BATCH])

    def log_files(self, files: Mapping[str, Path]) -> None:
        for name, path in files.items():
            if path.is_dir():
                self.client.log_artifacts(self.run_id, str(path), artifact_path=name)
            else:
                where = Path(name).parent.as_posix()
                self.client.log_artifact(self.run_id, str(path), artifact_path=None if where == "." else where)

    def log_text(self, text: str, name: str) -> None:
        self.client.log_text(self.run_id, text, name)

    def close(self, status: str) -> None:
        self.client.set_terminated(self.run_id, status)


def _experiment(client, name: str, uri: str) -> str:
    found = client.get_experiment_by_name(name)
    if found is not None:
        return found.experiment_id
    root = artifact_root(uri)
    try:
        return client.create_experiment(name, artifact_location=f"{root}/{part(name)}" if root else None)
    except Exception:  # noqa: BLE001 - another process created it first (a study's runs share a store)
        found = client.get_experiment_by_name(name)
        if found is None:
            raise
        return found.experiment_id


def _continued(client, state: dict, uri: str):
    """The MLflow run tracking.json names, where it is an active run of this store (a resume); else None."""
    from mlflow.exceptions import MlflowException

    if state.get("tracking_uri") != uri or not isinstance(state.get("run_id"), str):
        return None
    try:
        run = client.get_run(state["run_id"])
    except MlflowException:  # deleted from the store, or another store at the same address
        return None
    return run if run.info.lifecycle_stage == "active" else None


def open_mlflow(settings, run: TrackedRun, parent: MLflowTracker | None) -> MLflowTracker:
    """The run's MLflow run: continued where tracking.json names one in this store, else created (nested
    under `parent`'s); its parameters (those it has not yet: MLflow never changes one) and tags logged."""
    for key, value in HTTP_DEFAULTS.items():
        os.environ.setdefault(key, value)
    _quiet()
    from mlflow import MlflowClient
    from mlflow.entities import Param, RunTag

    uri = parent.uri if parent is not None else settings.uri or os.environ.get("MLFLOW_TRACKING_URI") \
        or default_uri(run.path)
    client = MlflowClient(uri)
    found = _continued(client, read_state(run.path, BACKEND), uri)
    if found is None:
        experiment_id = parent.experiment_id if parent is not None else _experiment(client, run.experiment, uri)
        tags = {PARENT_TAG: parent.run_id} if parent is not None else {}
        run_id, logged = client.create_run(experiment_id, run_name=run.name, tags=tags).info.run_id, {}
        write_state(run.path, BACKEND, {"run_id": run_id, "tracking_uri": uri, "experiment_id": experiment_id})
    else:
        run_id, experiment_id, logged = found.info.run_id, found.info.experiment_id, found.data.params
        client.update_run(run_id, status="RUNNING")
    params = [Param(k[:250], v[:PARAM_VALUE]) for k, v in run.params.items() if k[:250] not in logged]
    changed = {f"fedsilo.resumed_with.{k}"[:250]: v[:PARAM_VALUE] for k, v in run.params.items()
               if k[:250] in logged and logged[k[:250]] != v[:PARAM_VALUE]}  # e.g. more federation.rounds
    tags = [RunTag(k, str(v)) for k, v in {**run.tags, **changed}.items()]
    for i in range(0, max(len(params), len(tags)), 100):  # MLflow: at most 100 of each per batch
        client.log_batch(run_id, params=params[i:i + 100], tags=tags[i:i + 100])
    return MLflowTracker(client, run_id, uri, experiment_id)
