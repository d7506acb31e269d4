"""Tracker `mlflow`: params, tags, per-iteration metrics (one batched call each), sample tables
and artifacts, to a local SQLite store by default or to any tracking server."""

from __future__ import annotations

import time

import attrs

from rlkit_core.config import setting
from rlkit_core.interfaces import Tracker

MAX_PARAM_LENGTH = 6000  # MLflow rejects longer parameter values
BATCH_LIMIT = 100  # MLflow accepts at most this many params per log_batch call


@attrs.frozen
class MLflowConfig:
    uri: str = setting("sqlite:///mlflow.db", help="tracking URI: a local store ('sqlite:///mlflow.db') or a server ('http://host:5000')")
    experiment: str = setting("rlkit", help="experiment the run is filed under")


class MLflowTracker(Tracker):
    def __init__(self, config: MLflowConfig, context=None):
        from mlflow import MlflowClient

        self.config = config
        self.client = MlflowClient(tracking_uri=config.uri)
        self.run_id = None
        self.location = None

    def start(self, *, run_name, params, tags, resume_id):
        from mlflow.entities import Param, RunTag

        if resume_id:
            self.run_id = resume_id
            self.client.update_run(resume_id, status="RUNNING")
        else:
            experiment = self.client.get_experiment_by_name(self.config.experiment)
            experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(self.config.experiment)
            run = self.client.create_run(experiment_id, run_name=run_name, tags=tags)
            self.run_id = run.info.run_id
            items = [Param(k, str(v)[:MAX_PARAM_LENGTH]) for k, v in params.items()]
            for start in range(0, len(items), BATCH_LIMIT):
                self.client.log_batch(self.run_id, params=items[start:start + BATCH_LIMIT])
        self.location = f"{self.config.uri} (experiment {self.config.experiment!r}, run {self.run_id})"
        return self.run_id

    def log_metrics(self, metrics, step):
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, float(v), now, step) for k, v in metrics.items()])

    def log_samples(self, rows, step):
        columns = {key: [row[key] for row in rows] for key in rows[0]} if rows else {}
        columns["iteration"] = [step] * len(rows)
        self.client.log_table(self.run_id, data=columns, artifact_file=f"samples/iteration_{step:06d}.json")

    def log_artifact(self, path, artifact_path=None):
        self.client.log_artifact(self.run_id, path, artifact_path)

    def finish(self, status):
        if self.run_id:
            self.client.set_terminated(self.run_id, status=status)
