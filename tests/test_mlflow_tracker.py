"""The `mlflow` tracker against real MLflow: a local SQLite store, and a real `mlflow server` on
127.0.0.1 that these tests start, stop in the middle of a run, and start again on the same store.
Everything is read back with a fresh MlflowClient. Every wait is bounded."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest
from mlflow import MlflowClient
from rlkit_plugins.mlflow_tracker import MLflowConfig, MLflowTracker

SERVER_START_SECONDS = 60
TAGS = {"rlkit.version": "0.1.0", "rlkit.plugin.policy": "hf (rlkit 0.1.0)"}


def make_tracker(uri: str, output_dir: Path, **settings) -> MLflowTracker:
    return MLflowTracker(MLflowConfig(uri=uri, **settings), SimpleNamespace(output_dir=str(output_dir)))


def iteration_metrics(step: int) -> dict[str, float]:
    """About as many metrics as one PPO iteration logs."""
    return {f"group{i % 5}/metric{i}": step * 10.0 + i for i in range(30)}


def history(client: MlflowClient, run_id: str, key: str = "group2/metric2") -> list[tuple[int, float]]:
    return [(m.step, m.value) for m in sorted(client.get_metric_history(run_id, key), key=lambda m: m.step)]


def log_artifacts(tracker: MLflowTracker, root: Path) -> None:
    recipe = root / "recipe.toml"
    recipe.write_text("[run]\nsteps = 3\n")
    tracker.log_artifact(str(recipe))
    model = root / "final-model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    tracker.log_model(str(model))
    tracker.log_checkpoint(str(root / "checkpoints" / "iteration_000003"), 3)


def check_run(client: MlflowClient, run_id: str, root: Path) -> None:
    """What `log_a_run` logged, as MLflow returns it."""
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.info.run_name == "tiny"
    assert run.data.params["ppo.batch_size"] == "16"
    assert len(run.data.params["policy.model"]) == 6000  # truncated to MLflow's limit, not refused
    assert len(run.data.params) == 150  # more than one batch of params
    assert {k: run.data.tags[k] for k in TAGS} == TAGS
    assert run.data.tags["rlkit.final_model"] == str(root / "final-model")
    assert run.data.tags["rlkit.checkpoint"] == str(root / "checkpoints" / "iteration_000003")
    assert run.data.tags["rlkit.checkpoint_step"] == "3"
    assert len(run.data.metrics) == 30
    assert history(client, run_id) == [(1, 12.0), (2, 22.0), (3, 32.0)]
    assert {a.path for a in client.list_artifacts(run_id)} == {"recipe.toml", "final_model", "samples"}
    assert [a.path for a in client.list_artifacts(run_id, "final_model")] == ["final_model/config.json"]
    table = json.loads(Path(client.download_artifacts(run_id, "samples/iteration_000003.json", str(root))).read_text())
    rows = [dict(zip(table["columns"], row)) for row in table["data"]]
    assert rows == [{"prompt": "p1", "response": "abc", "score": 0.5, "iteration": 3},
                    {"prompt": "p2", "response": "xyz", "score": 0.25, "iteration": 3}]


def log_a_run(tracker: MLflowTracker, root: Path) -> str:
    params = {"ppo.batch_size": 16, "policy.model": "m" * 7000, **{f"extra.key{i}": i for i in range(148)}}
    run_id = tracker.start(run_name="tiny", params=params, tags=TAGS, resume_id=None)
    for step in (1, 2, 3):
        tracker.log_metrics(iteration_metrics(step), step=step)
    tracker.log_samples([{"prompt": "p1", "response": "abc", "score": 0.5}, {"prompt": "p2", "response": "xyz", "score": 0.25}], step=3)
    log_artifacts(tracker, root)
    tracker.finish("FINISHED")
    return run_id


def test_limits_match_mlflow():
    from mlflow.utils import validation
    from rlkit_plugins import mlflow_tracker

    for name in ("MAX_PARAM_VAL_LENGTH", "MAX_TAG_VAL_LENGTH", "MAX_PARAMS_TAGS_PER_BATCH", "MAX_METRICS_PER_BATCH", "MAX_ENTITY_KEY_LENGTH"):
        assert getattr(mlflow_tracker, name) == getattr(validation, name), name


# -- the local SQLite store ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def sqlite_uri(tmp_path_factory):
    """One store for the module: creating an MLflow database takes seconds."""
    return f"sqlite:///{tmp_path_factory.mktemp('store')}/mlflow.db"


@pytest.mark.slow
def test_sqlite_store_records_a_run_and_resume_appends(sqlite_uri, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@example.com"]
    subprocess.run([*git, "init", "-q"], check=True, timeout=30)
    subprocess.run([*git, "commit", "-q", "--allow-empty", "-m", "start"], check=True, timeout=30)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True, timeout=30).stdout.strip()

    run_id = log_a_run(make_tracker(sqlite_uri, tmp_path), tmp_path)
    client = MlflowClient(sqlite_uri)
    check_run(client, run_id, tmp_path)
    assert client.get_run(run_id).data.tags["mlflow.source.git.commit"] == commit

    resumed = make_tracker(sqlite_uri, tmp_path)
    params = {"ppo.batch_size": 32, "policy.model": "m" * 7000, "kl.target": 6}
    assert resumed.start(run_name="tiny", params=params, tags=TAGS, resume_id=run_id) == run_id
    assert client.get_run(run_id).info.status == "RUNNING"
    resumed.log_metrics(iteration_metrics(4), step=4)
    resumed.finish("FINISHED")
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert history(client, run_id) == [(1, 12.0), (2, 22.0), (3, 32.0), (4, 42.0)]
    assert run.data.params["ppo.batch_size"] == "16" and run.data.tags["rlkit.resume.ppo.batch_size"] == "32"
    assert run.data.params["kl.target"] == "6"


def test_two_trackers_in_one_process_keep_their_runs_apart(sqlite_uri, tmp_path):
    first, second = make_tracker(sqlite_uri, tmp_path), make_tracker(sqlite_uri, tmp_path, experiment="other")
    ids = [t.start(run_name=name, params={}, tags={}, resume_id=None) for t, name in ((first, "a"), (second, "b"))]
    for step in (1, 2):
        first.log_metrics({"x": step}, step=step)
        second.log_metrics({"x": -step}, step=step)
    first.finish("FINISHED")
    second.finish("KILLED")
    client = MlflowClient(sqlite_uri)
    assert [(m.step, m.value) for m in client.get_metric_history(ids[0], "x")] == [(1, 1.0), (2, 2.0)]
    assert [(m.step, m.value) for m in client.get_metric_history(ids[1], "x")] == [(1, -1.0), (2, -2.0)]
    assert [client.get_run(i).info.status for i in ids] == ["FINISHED", "KILLED"]


def test_what_mlflow_refuses_costs_a_warning_and_blocks_nothing(sqlite_uri, tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="rlkit")
    tracker = make_tracker(sqlite_uri, tmp_path, log_model=False)
    run_id = tracker.start(run_name="refused", params={}, tags={}, resume_id=None)
    for step in (1, 2):
        tracker.log_metrics({"score/mean": step, "bad!name": 0.0, "../escape": 0.0}, step=step)
    model = tmp_path / "model"
    model.mkdir()
    tracker.log_model(str(model))
    assert tracker.flush(timeout=30)
    client = MlflowClient(sqlite_uri)
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "score/mean")] == [(1, 1.0), (2, 2.0)]
    assert client.list_artifacts(run_id) == [] and client.get_run(run_id).data.tags["rlkit.final_model"] == str(model)
    names = [r.getMessage() for r in caplog.records]
    assert len(names) == 2 and "'bad!name'" in names[0] and "'../escape'" in names[1], names

    client.delete_run(run_id)  # MLflow now refuses everything for this run: each refusal is said once, and dropped
    tracker.log_metrics({"score/mean": 3}, step=3)
    tracker.log_metrics({"score/mean": 4}, step=4)
    assert tracker.flush(timeout=30)
    refused = [r.getMessage() for r in caplog.records[2:]]
    assert len(refused) == 1 and "refused the metrics" in refused[0] and "not tried again" in refused[0], refused
    tracker.finish("FINISHED")
    assert not any("could not be reached" in r.getMessage() for r in caplog.records)


def test_a_tracker_that_cannot_start_says_where_and_what_to_do(tmp_path):
    tracker = make_tracker(f"http://127.0.0.1:{free_port()}", tmp_path, request_timeout=2)
    started = time.monotonic()
    with pytest.raises(Exception, match=r"(?s)cannot start an MLflow run at http://127\.0\.0\.1:\d+.*tracker\.type = \"none\""):
        tracker.start(run_name="x", params={}, tags={}, resume_id=None)
    assert time.monotonic() - started < 20  # MLflow's own retries would take about 4 minutes


# -- a real tracking server -------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class MlflowServer:
    """`mlflow server` on 127.0.0.1 with a SQLite store and served artifacts under `root`; stop() and
    start() again keep the port and the store."""

    def __init__(self, root: Path):
        self.root = root
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process = None

    def start(self) -> None:
        command = [str(Path(sys.executable).parent / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(self.port),
                   "--backend-store-uri", f"sqlite:///{self.root}/server.db", "--serve-artifacts",
                   "--artifacts-destination", str(self.root / "artifacts"), "--workers", "1"]
        # The job runner spawns a handful of worker processes that these tests do not need.
        env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", "MLFLOW_DISABLE_TELEMETRY": "true"}
        with (self.root / "server.log").open("ab") as out:
            self.process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        deadline = time.monotonic() + SERVER_START_SECONDS
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                pytest.fail(f"mlflow server exited with {self.process.returncode}; its log:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as answer:
                    if answer.status == 200:
                        return
            except OSError:
                time.sleep(0.25)
        self.stop()
        pytest.fail(f"mlflow server did not answer {self.url}/health within {SERVER_START_SECONDS} s; its log:\n{self.log_tail()}")

    def stop(self) -> None:
        """The whole process group: the CLI, uvicorn and anything they started."""
        if self.process is None:
            return
        for sig, grace in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
            try:
                os.killpg(self.process.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.process.wait(grace)
                break
            except subprocess.TimeoutExpired:
                continue
        with_stragglers = self.process.pid
        self.process = None
        try:
            os.killpg(with_stragglers, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def log_tail(self) -> str:
        return (self.root / "server.log").read_text(errors="replace")[-3000:]


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    server = MlflowServer(tmp_path_factory.mktemp("server"))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def server(mlflow_server):
    """The module's server, running (a test before may have stopped it)."""
    if mlflow_server.process is None:
        mlflow_server.start()
    return mlflow_server


@pytest.mark.slow
def test_tracking_server_records_a_run(server, tmp_path):
    tracker = make_tracker(server.url, tmp_path, experiment="over-http")
    run_id = log_a_run(tracker, tmp_path)
    assert tracker.location.startswith(f"{server.url}/#/experiments/") and tracker.location.endswith(run_id)
    check_run(MlflowClient(server.url), run_id, tmp_path)
    assert list((server.root / "artifacts").rglob("recipe.toml")), "artifacts did not go through the server"


@pytest.mark.slow
def test_server_outage_costs_one_warning_and_loses_nothing(server, tmp_path, caplog):
    caplog.set_level(logging.WARNING)
    client = MlflowClient(server.url)
    tracker = make_tracker(server.url, tmp_path, experiment="outage", request_timeout=2)
    run_id = tracker.start(run_name="outage", params={"a": 1}, tags=TAGS, resume_id=None)
    for step in (1, 2):
        tracker.log_metrics(iteration_metrics(step), step=step)
    assert tracker.flush(timeout=30)
    assert history(client, run_id) == [(1, 12.0), (2, 22.0)]

    server.stop()
    started = time.monotonic()
    for step in (3, 4, 5):
        tracker.log_metrics(iteration_metrics(step), step=step)
        assert tracker.flush(timeout=30)  # each step is tried, and fails, while the server is down
    tracker.log_samples([{"prompt": "p", "response": "r", "score": 1.0}], step=5)
    assert time.monotonic() - started < 10
    sent_before = int(time.time() * 1000)
    outage = [r.getMessage() for r in caplog.records]
    assert len(outage) == 1 and "cannot be reached" in outage[0] and "metrics.jsonl" in outage[0], outage

    server.start()
    tracker.log_metrics(iteration_metrics(6), step=6)
    assert tracker.flush(timeout=30)
    assert history(client, run_id) == [(s, s * 10.0 + 2) for s in range(1, 7)]
    stamps = {m.step: m.timestamp for m in client.get_metric_history(run_id, "group2/metric2")}
    assert all(stamps[s] <= sent_before for s in (3, 4, 5))  # the original timestamps, not the resend's
    assert [a.path for a in client.list_artifacts(run_id, "samples")] == ["samples/iteration_000005.json"]
    assert len(caplog.records) == 1

    # Down again, and not back before the end: finish() says what MLflow is missing, and where it is.
    server.stop()
    tracker.log_metrics(iteration_metrics(7), step=7)
    tracker.log_metrics(iteration_metrics(8), step=8)
    started = time.monotonic()
    tracker.finish("FINISHED")
    assert time.monotonic() - started < 10
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 3 and "cannot be reached" in messages[1], messages
    assert "2 iterations (7–8" in messages[2] and str(tmp_path / "metrics.jsonl") in messages[2] and "RUNNING" in messages[2]
    assert "2 iterations not sent" in tracker.location
