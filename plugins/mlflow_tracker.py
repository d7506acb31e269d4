"""Tracker `mlflow`: params, tags, per-iteration metrics, sample tables and artifacts in MLflow, to a
local SQLite store by default or to any tracking server.

Training never waits on MLflow. `start` is the only call made on the training thread, so that a
wrong URI stops the run at once; everything after it goes, in order, through one sender thread.
When the store or server cannot be reached, the sender keeps what failed in memory, warns once,
and re-sends it (with its original steps and timestamps) at its next attempt: on the next thing
logged, or every RETRY_SECONDS. `finish` makes a last attempt and says what could not be sent;
`metrics.jsonl` holds every metric either way.

MLflow's limits are copied here (from `mlflow.utils.validation`) so that listing plugins does not
import MLflow; a test checks that they still match.
"""

from __future__ import annotations

import contextlib
import getpass
import logging
import os
import queue
import subprocess
import threading
import time
import urllib.parse
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING

import attrs

from rlkit_core import RunError, Tracker, at_least, setting

if TYPE_CHECKING:
    from mlflow import MlflowClient

MAX_PARAM_VAL_LENGTH = 6000
MAX_TAG_VAL_LENGTH = 8000
MAX_PARAMS_TAGS_PER_BATCH = 100
MAX_METRICS_PER_BATCH = 1000
MAX_ENTITY_KEY_LENGTH = 250

START_RETRIES = 2  # start() is the one call the run waits for: ride out a brief blip
SENDER_RETRIES = 0  # the sender tries again on its own schedule; MLflow's backoff (minutes) would only stall it
RETRY_SECONDS = 10  # how often the sender tries again while nothing new is logged

log = logging.getLogger("rlkit.tracker.mlflow")
_ENV_LOCK = threading.Lock()
_CLOSE = object()


@attrs.frozen
class MLflowConfig:
    uri: str = setting("sqlite:///mlflow.db", help="tracking URI: a local store ('sqlite:///mlflow.db' is in the working directory) or a server ('http://host:5000')")
    experiment: str = setting("rlkit", help="experiment the run is filed under; created when missing")
    log_model: bool = setting(True, help="upload the final model directory as an artifact; turn off for large models (its path is recorded either way)")
    request_timeout: int = setting(
        10, validator=at_least(1),
        help="seconds one request to a tracking server may take (instead of MLFLOW_HTTP_REQUEST_TIMEOUT, with MLflow's own retries off)")


@contextlib.contextmanager
def _bounded_requests(timeout: int, retries: int):
    """MLflow reads its HTTP limits from the environment on every request and offers no per-client
    setting, so they are set around each of the tracker's calls (one call at a time, process-wide)."""
    limits = {"MLFLOW_HTTP_REQUEST_TIMEOUT": str(timeout), "MLFLOW_HTTP_REQUEST_MAX_RETRIES": str(retries),
              "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1"}
    with _ENV_LOCK:
        saved = {name: os.environ.get(name) for name in limits}
        os.environ.update(limits)
        try:
            yield
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value


def _transient(error: Exception) -> bool:
    """Whether trying again later may succeed (no connection, timeout, server error, rate limit), as
    opposed to a request MLflow will never accept (a 4xx such as an invalid metric name)."""
    import requests
    from mlflow.exceptions import MlflowException

    if isinstance(error, MlflowException):
        status = error.get_http_status_code()
        return not 400 <= status < 500 or status == 429
    return isinstance(error, (requests.RequestException, ConnectionError, TimeoutError))


def _absolute_sqlite(uri: str) -> str:
    """`sqlite:///mlflow.db` names a file relative to the working directory; pin it, so the store
    stays put if the directory changes and the printed `mlflow ui` command works from anywhere."""
    prefix = "sqlite:///"
    if uri.startswith(prefix) and not uri[len(prefix):].startswith("/"):
        return prefix + os.path.abspath(uri[len(prefix):])
    return uri


def _git_tags() -> dict[str, str]:
    """The commit of the working directory's repository (MLflow's UI shows this tag), if there is one."""
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5, check=True).stdout.strip()
        changes = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True, timeout=5, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    return {"mlflow.source.git.commit": commit, "rlkit.git.dirty": str(bool(changes.strip())).lower()}


class MLflowTracker(Tracker):
    def __init__(self, config: MLflowConfig, context):
        self.config = config
        self.uri = _absolute_sqlite(config.uri)
        self.client: MlflowClient | None = None
        self.metrics_path = Path(context.output_dir) / "metrics.jsonl"
        self.run_id = None
        self.location = None
        self._queue = queue.Queue()
        self._pending = deque()  # owned by the sender thread until finish() joins it
        self._sender = threading.Thread(target=self._send_loop, name="rlkit-mlflow-sender", daemon=True)
        self._outage = False
        self._reported = set()
        self._names = {}  # metric name -> whether MLflow takes it

    @staticmethod
    def check(config: MLflowConfig, recipe, where: str) -> tuple[list[str], list[str]]:
        """(problems, notes) of `rlkit check` and the start of `rlkit run`: a URI MLflow cannot
        store to (an unknown scheme, a local store in a folder that is not there). Connects to
        nothing and creates nothing."""
        uri = _absolute_sqlite(config.uri)
        if urllib.parse.urlsplit(uri).password is not None:
            return [f"{where}.uri: holds a password, and the recipe is logged with the run; put the credentials in the "
                    "environment instead (MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD, or MLFLOW_TRACKING_TOKEN)"], []
        if uri.startswith("sqlite:///") and not Path(uri[len("sqlite:///"):]).parent.is_dir():
            folder = Path(uri[len("sqlite:///"):]).parent
            return [f"{where}.uri: {config.uri!r} puts the store in {str(folder)!r}, which is not a folder; "
                    "create it, or use a path in an existing folder (sqlite:///mlflow.db is the working directory)"], []
        try:
            from mlflow.tracking._tracking_service.utils import _tracking_store_registry as stores  # MLflow's own table of schemes

            stores.get_store_builder(uri)
        except ImportError:
            return [], [f"{where}.uri: MLflow's table of URI schemes moved; the URI is checked when the run starts"]
        except Exception:
            schemes = ", ".join(f"{s}:" for s in sorted(getattr(stores, "_registry", {})) if s)
            return [f"{where}.uri: MLflow cannot store to {config.uri!r}: it takes {schemes} URIs or a local path "
                    "(e.g. 'sqlite:///mlflow.db', 'http://host:5000'); set tracker.type = \"none\" to train without MLflow"], []
        return [], []

    @property
    def _mlflow(self) -> MlflowClient:
        assert self.client is not None  # made by start()
        return self.client

    # -- the training thread's side ------------------------------------------------------------

    def start(self, *, run_name, params, tags, resume_id):
        from mlflow import MlflowClient

        tags = {**_git_tags(), **self._user_tag(), **tags}
        params = {key: str(value)[:MAX_PARAM_VAL_LENGTH] for key, value in params.items()}
        try:
            with _bounded_requests(self.config.request_timeout, START_RETRIES):
                self.client = MlflowClient(tracking_uri=self.uri)  # its own: no global active run to collide on
                run = self._reopen(resume_id, params, tags) if resume_id else self._create(run_name, params, tags)
        except RunError:
            raise
        except Exception as error:
            raise RunError(f"tracker: cannot start an MLflow run at {self.uri}: {error}\n"
                           f"Start the tracking server or fix $.tracker.uri; set tracker.type = \"none\" to train without MLflow.") from error
        self.run_id = run.info.run_id
        self.location = self._describe(run.info.experiment_id)
        self._sender.start()
        return self.run_id

    def log_metrics(self, metrics, step):
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        items = [Metric(key, float(value), now, step) for key, value in metrics.items() if self._sendable(key)]
        for first in range(0, len(items), MAX_METRICS_PER_BATCH):
            self._queue.put(("metrics", items[first:first + MAX_METRICS_PER_BATCH]))

    def _sendable(self, name: str) -> bool:
        """MLflow refuses a whole batch for one bad metric name; leave that metric out instead, with one warning."""
        if name not in self._names:
            from mlflow.utils.validation import path_not_unique, validate_param_and_metric_name

            self._names[name] = bool(validate_param_and_metric_name(name)) and not path_not_unique(name) and len(name) <= MAX_ENTITY_KEY_LENGTH
            if not self._names[name]:
                log.warning("metric %r is not sent to MLflow, which takes names of at most %d letters, digits and _ - . : / "
                            "or spaces, without empty or '..' parts; rename it where it is made (metrics.jsonl has it)",
                            name, MAX_ENTITY_KEY_LENGTH)
        return self._names[name]

    def log_samples(self, rows, step):
        if rows:
            columns = {key: [row[key] for row in rows] for key in rows[0]}
            columns["iteration"] = [step] * len(rows)
            self._queue.put(("table", (columns, f"samples/iteration_{step:06d}.json")))

    def log_artifact(self, path, artifact_path=None):
        """Upload a file or folder; it must stay in place until `finish` returns."""
        path = os.path.abspath(path)
        if not os.path.exists(path):
            raise FileNotFoundError(f"tracker.log_artifact: nothing at {path}; log a file or folder that exists")
        self._queue.put(("artifact", (path, artifact_path)))

    def log_model(self, path: str) -> None:
        """The final model directory: its path as tag `rlkit.final_model`, its files under
        `final_model/` unless `log_model = false`. It must stay in place until `finish` returns."""
        self._queue.put(("tags", {"rlkit.final_model": os.path.abspath(path)}))
        if self.config.log_model:
            self.log_artifact(path, "final_model")

    def log_checkpoint(self, path: str, step: int) -> None:
        """Where the latest checkpoint is (tags `rlkit.checkpoint`, `rlkit.checkpoint_step`), so a
        run found in the UI can be resumed."""
        self._queue.put(("tags", {"rlkit.checkpoint": os.path.abspath(path), "rlkit.checkpoint_step": str(step)}))

    def log_note(self, name: str, text: str, step: int) -> None:
        """A note as tag `rlkit.note.<name>`."""
        self._queue.put(("tags", {f"rlkit.note.{name}": text[:MAX_TAG_VAL_LENGTH]}))

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until everything logged so far has been tried once; False if `timeout` ran out first."""
        tried = threading.Event()
        self._queue.put(tried)
        return tried.wait(timeout)

    def finish(self, status):
        if self.run_id is None:
            return
        self._queue.put(("end", status))
        self._queue.put(_CLOSE)
        self._sender.join()
        if self._pending:
            self._report_unsent()

    # -- starting ------------------------------------------------------------------------------

    @staticmethod
    def _user_tag() -> dict[str, str]:
        try:
            return {"mlflow.user": getpass.getuser()}
        except (OSError, KeyError):
            return {}

    def _experiment_id(self) -> str:
        from mlflow.exceptions import MlflowException

        name = self.config.experiment
        experiment = self._mlflow.get_experiment_by_name(name)
        if experiment is None:
            try:
                return self._mlflow.create_experiment(name)
            except MlflowException as error:  # another run created it a moment ago
                if error.error_code != "RESOURCE_ALREADY_EXISTS":
                    raise
                experiment = self._mlflow.get_experiment_by_name(name)
        assert experiment is not None  # found, or made by another run a moment ago
        if experiment.lifecycle_stage == "deleted":
            raise RunError(f"$.tracker.experiment: experiment {name!r} at {self.uri} is deleted; restore it "
                           f"(mlflow experiments restore --experiment-id {experiment.experiment_id}) or name another one")
        return experiment.experiment_id

    def _create(self, run_name, params, tags):
        from mlflow.entities import Param

        tags = {key: str(value)[:MAX_TAG_VAL_LENGTH] for key, value in tags.items()}
        run = self._mlflow.create_run(self._experiment_id(), run_name=run_name or None, tags=tags)
        items = [Param(key, value) for key, value in params.items()]
        for first in range(0, len(items), MAX_PARAMS_TAGS_PER_BATCH):
            self._mlflow.log_batch(run.info.run_id, params=items[first:first + MAX_PARAMS_TAGS_PER_BATCH])
        return run

    def _reopen(self, run_id, params, tags):
        """The same run, RUNNING again. MLflow never changes a param's value, so a resumed recipe that
        differs keeps the first values as params and records the new ones as `rlkit.resume.<key>` tags."""
        from mlflow.entities import Param, RunTag
        from mlflow.exceptions import MlflowException

        try:
            run = self._mlflow.get_run(run_id)
        except MlflowException as error:
            if error.error_code != "RESOURCE_DOES_NOT_EXIST":
                raise
            raise RunError(f"tracker: no run {run_id} at {self.uri} to resume; point $.tracker.uri at the store "
                           f"the run was logged to") from error
        if run.info.lifecycle_stage == "deleted":
            raise RunError(f"tracker: run {run_id} at {self.uri} is deleted; restore it (mlflow runs restore --run-id {run_id}) to resume it")
        known = run.data.params
        changed = {key: value for key, value in params.items() if key in known and known[key] != value}
        if changed:
            log.warning("resumed run %s with different values for %s; MLflow keeps a param's first value, so the "
                        "new values are tags rlkit.resume.<name>", run_id, ", ".join(sorted(changed)))
        tags = {**tags, **{f"rlkit.resume.{key}": value for key, value in changed.items()}}
        new_params = [Param(key, value) for key, value in params.items() if key not in known]
        new_tags = [RunTag(key, str(value)[:MAX_TAG_VAL_LENGTH]) for key, value in tags.items()]
        for first in range(0, max(len(new_params), len(new_tags)), MAX_PARAMS_TAGS_PER_BATCH):
            window = slice(first, first + MAX_PARAMS_TAGS_PER_BATCH)
            self._mlflow.log_batch(run_id, params=new_params[window], tags=new_tags[window])
        self._mlflow.update_run(run_id, status="RUNNING")
        return run

    def _describe(self, experiment_id: str) -> str:
        """Where to find the run: a link for a server, the `mlflow ui` command for a local store."""
        if self.uri.startswith(("http://", "https://")):
            return f"{self.uri.rstrip('/')}/#/experiments/{experiment_id}/runs/{self.run_id}"
        return f"MLflow run {self.run_id} in experiment {self.config.experiment!r}; to see it: mlflow ui --backend-store-uri {self.uri}"

    # -- the sender thread ---------------------------------------------------------------------

    def _send_loop(self) -> None:
        closing = False
        while not closing:
            tried = []
            try:
                item = self._queue.get(timeout=RETRY_SECONDS if self._pending else None)
            except queue.Empty:
                item = None
            while item is not None:  # take all that is queued, so one attempt covers it
                if item is _CLOSE:
                    closing = True
                elif isinstance(item, threading.Event):
                    tried.append(item)
                else:
                    self._pending.append(item)
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    item = None
            self._send_pending()
            for event in tried:
                event.set()

    def _send_pending(self) -> None:
        """Send what is pending, oldest first; stop at the first failure that may pass."""
        while self._pending:
            kind, payload = self._pending[0]
            count = 1
            if kind == "metrics":  # consecutive iterations go in one call
                while (count < len(self._pending) and self._pending[count][0] == "metrics"
                       and len(payload) + len(self._pending[count][1]) <= MAX_METRICS_PER_BATCH):
                    payload = payload + self._pending[count][1]
                    count += 1
            try:
                with _bounded_requests(self.config.request_timeout, SENDER_RETRIES):
                    self._send(kind, payload)
            except Exception as error:
                if _transient(error):
                    if not self._outage:
                        self._outage = True
                        log.warning("MLflow at %s cannot be reached (%s). Training goes on; every metric is in %s, "
                                    "and what MLflow missed is kept in memory and sent when it is back.",
                                    self.uri, str(error)[:500], self.metrics_path)
                    return
                message = str(error)[:500]
                if message not in self._reported:
                    self._reported.add(message)
                    log.warning("MLflow at %s refused the %s of run %s (dropped, not tried again): %s", self.uri, kind, self.run_id, message)
            else:
                if self._outage:
                    self._outage = False
                    log.info("MLflow at %s is reachable again; sent what it had missed", self.uri)
            for _ in range(count):
                self._pending.popleft()

    def _send(self, kind: str, payload) -> None:
        from mlflow.entities import RunTag

        run_id = self.run_id
        assert run_id is not None  # the sender thread starts once the run has its id

        if kind == "metrics":
            self._mlflow.log_batch(run_id, metrics=payload)
        elif kind == "tags":
            self._mlflow.log_batch(run_id, tags=[RunTag(key, value[:MAX_TAG_VAL_LENGTH]) for key, value in payload.items()])
        elif kind == "table":
            columns, artifact_file = payload
            self._mlflow.log_table(run_id, data=columns, artifact_file=artifact_file)
        elif kind == "artifact":
            path, artifact_path = payload
            if os.path.isdir(path):
                self._mlflow.log_artifacts(run_id, path, artifact_path)
            else:
                self._mlflow.log_artifact(run_id, path, artifact_path)
        else:
            self._mlflow.set_terminated(run_id, status=payload)

    def _report_unsent(self) -> None:
        steps = sorted({metric.step for kind, payload in self._pending if kind == "metrics" for metric in payload})
        parts = []
        if steps:
            parts.append(f"the metrics of {len(steps)} iteration{'s' if len(steps) != 1 else ''} ({steps[0]}–{steps[-1]}; "
                         f"all of them are in {self.metrics_path})")
        for kind, words in (("table", "sample table"), ("artifact", "artifact"), ("tags", "tag update")):
            n = sum(1 for k, _ in self._pending if k == kind)
            if n:
                parts.append(f"{n} {words}{'s' if n != 1 else ''}")
        if any(kind == "end" for kind, _ in self._pending):
            parts.append("the run's end (the UI will show it as RUNNING)")
        log.warning("MLflow at %s could not be reached before the run ended; not sent to run %s: %s",
                    self.uri, self.run_id, "; ".join(parts))
        self.location = f"{self.location} (incomplete: {len(steps)} iterations not sent; see {self.metrics_path})"
