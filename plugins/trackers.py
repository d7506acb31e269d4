"""Trackers: `none` (metrics.jsonl only) and `mlflow`."""

from __future__ import annotations

import attrs

from rlkit_core import SilentTracker, hookimpl


@attrs.frozen
class NoTrackerConfig:
    pass


class NoTracker(SilentTracker):
    """For tests and quick experiments: the run's metrics.jsonl is the whole record."""

    location = None

    def __init__(self, config=None, context=None):
        pass


@hookimpl
def register_trackers(register):
    from rlkit_plugins.mlflow_tracker import MLflowConfig, MLflowTracker

    register("none", NoTracker, NoTrackerConfig)
    register("mlflow", MLflowTracker, MLflowConfig)
