"""Trackers: `none` (metrics.jsonl only) and `mlflow`."""

from __future__ import annotations

import attrs

from rlkit_core import Tracker, hookimpl


@attrs.frozen
class NoTrackerConfig:
    pass


class NoTracker(Tracker):
    """For tests and quick experiments: the run's metrics.jsonl is the whole record."""

    location = None

    def __init__(self, config=None, context=None):
        pass

    def start(self, *, run_name, params, tags, resume_id):
        return None

    def log_metrics(self, metrics, step):
        pass

    def finish(self, status):
        pass


@hookimpl
def register_trackers(register):
    from .mlflow_tracker import MLflowConfig, MLflowTracker

    register("none", NoTracker, NoTrackerConfig)
    register("mlflow", MLflowTracker, MLflowConfig)
