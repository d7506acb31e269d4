"""Trackers: `none` (metrics.jsonl only) and `mlflow`."""

from __future__ import annotations

import attrs

from rlkit_core import NullTracker, hookimpl


@attrs.frozen
class NoTrackerConfig:
    pass


@hookimpl
def register_trackers(register):
    from .mlflow_tracker import MLflowConfig, MLflowTracker

    register("none", NullTracker, NoTrackerConfig)  # for tests and quick experiments
    register("mlflow", MLflowTracker, MLflowConfig)
