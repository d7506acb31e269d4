"""Rewards from services over HTTP: `http` (a scoring service of your own) and `openai-judge` (an
OpenAI-compatible chat endpoint that grades each response).

At scale the reward model or verifier rarely fits beside the policy, so it is served elsewhere.
Two things go wrong there, and both are handled here: a service that hangs would stall training
(every request has a timeout and a bounded number of retries with backoff), and a failure scored
as a real number would train the policy on garbage (a request that still fails, or a reply that
is not one finite score per response, raises `ServiceFailure`; the trainer makes it a bad reward,
which `run.on_bad_reward` stops or skips, the batch saved under `bad_batches/`).

Wire format of `http`: one POST per `batch_size` responses, `Content-Type: application/json`,
body `{"prompts": [str, ...], "responses": [str, ...], "columns": {name: [value, ...], ...}}`
(every other column of the prompt data, each list as long as `responses`, row i belonging to
response i); the reply is HTTP 200 with `{"scores": [number, ...]}`, one finite number per
response, in order. `rlkit check` sends the empty batch (`{"prompts": [], "responses": [],
"columns": {}}`), which a service answers with `{"scores": []}`.

`openai-judge` POSTs one chat completion per response to `<url>/chat/completions`
(`{"model", "messages": [system?, user], "max_tokens", "temperature"}`), the user message being
`template` with `{prompt}`, `{response}` and `{<column>}` filled in, and reads the score from
`choices[0].message.content`: the first match of `score_pattern` (its first group, when it has
one), which must lie in [min_score, max_score]. A reply without one is a failure, never a score.
`rlkit check` asks `<url>/models` whether the model is served.

Credentials come from environment variables only, named in the recipe (`auth_env`,
`headers_env`), because the recipe is logged with every run; a URL with `user:password@` in it is
refused, and the values are blanked out of every message this module writes.
"""

from __future__ import annotations

import http.client
import json
import math
import os
import re
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import attrs

from rlkit_core import RecipeError, RewardSource, at_least, between, building_at, greater_than, hookimpl, setting

RETRIED_STATUSES = {408, 425, 429, 500, 502, 503, 504}  # the service may answer the same request later
LARGEST_REPLY = 16 * 2**20  # bytes; a reply beyond this is a broken service, not scores
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")


class ServiceFailure(Exception):
    """A reward service gave no usable answer (after its retries); the trainer makes it a bad reward."""


def _url(value: str) -> str | None:
    """Why `value` is not a URL a reward service can have, or None."""
    parts = urllib.parse.urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return "must be an http:// or https:// URL with a host, e.g. 'http://127.0.0.1:8000/score'"
    if parts.username is not None or parts.password is not None:
        return ("holds credentials (user:password@host), and the recipe is logged with the run; put them in an "
                "environment variable and name it in auth_env or headers_env")
    try:
        _ = parts.port  # urlsplit parses the port only when it is read
    except ValueError:
        return "has a port that is not a number from 0 to 65535"
    return None


def url_setting(instance, attribute, value):
    problem = _url(value)
    if problem:
        raise ValueError(problem)  # the value is not repeated: it may hold a password


def env_name_setting(instance, attribute, value):
    if value and not ENV_NAME.fullmatch(value):
        raise ValueError("must be the name of an environment variable (letters, digits, _), not its value")


def headers_env_setting(instance, attribute, value):
    for header, variable in value.items():
        if not HEADER_NAME.fullmatch(header):
            raise ValueError(f"{header!r} is not an HTTP header name")
        if not ENV_NAME.fullmatch(variable):
            raise ValueError(f"[{header!r}] must be the name of an environment variable (letters, digits, _), not its value")


@attrs.frozen
class ServiceSettings:
    """How rlkit talks to a reward service: shared by `http` and `openai-judge`."""

    timeout: float = setting(30.0, help="seconds one request may take, connecting and reading the reply included", validator=greater_than(0), kw_only=True)
    retries: int = setting(2, help="attempts after the first for a request that timed out, could not connect or got HTTP 408/425/429/5xx",
                           validator=between(0, 10), kw_only=True)
    backoff: float = setting(1.0, help="seconds before the first retry, doubled before each next one up to max_backoff", validator=at_least(0), kw_only=True)
    max_backoff: float = setting(10.0, help="longest wait between two attempts (a Retry-After header is honoured up to it)",
                                 validator=at_least(0), kw_only=True)
    max_concurrent: int = setting(4, help="requests in flight at once", validator=between(1, 256), kw_only=True)
    auth_env: str = setting("", help="environment variable whose value is sent as 'Authorization: Bearer <value>' (empty: none)",
                            validator=env_name_setting, kw_only=True)
    headers_env: dict[str, str] = setting(factory=dict, help="more headers: {header name = environment variable holding its value}",
                                          validator=headers_env_setting, kw_only=True)


@attrs.frozen
class HttpRewardConfig(ServiceSettings):
    url: str = setting(help="where to POST batches of {prompts, responses, columns}; the reply is {scores}", validator=url_setting, kw_only=True)
    batch_size: int = setting(64, help="responses per request", validator=greater_than(0), kw_only=True)


def _names_the_response(instance, attribute, value):
    if "{response}" not in value:
        raise ValueError("must contain {response}, where the response to grade goes")


def _compiles(instance, attribute, value):
    try:
        re.compile(value)
    except re.error as exc:
        raise ValueError(f"is not a regular expression: {exc}") from None


def _above_min(instance, attribute, value):
    if value < instance.min_score:
        raise ValueError(f"must be >= min_score ({instance.min_score}), got {value}")


@attrs.frozen
class JudgeConfig(ServiceSettings):
    url: str = setting(help="the endpoint's base URL, as OpenAI clients take it (e.g. 'http://127.0.0.1:8000/v1'); rlkit POSTs to <url>/chat/completions",
                       validator=url_setting, kw_only=True)
    model: str = setting(help="the served model that grades, as the endpoint names it", kw_only=True)
    template: str = setting(help="the user message: {prompt}, {response} and {<data column>} are filled in", kw_only=True,
                            validator=_names_the_response)
    system: str = setting("", help="a system message before it (empty: none)", kw_only=True)
    score_pattern: str = setting(r"[-+]?\d+(?:\.\d+)?",
                                 help="regular expression: its first match in the reply (its first group, if it has one) is the score", kw_only=True,
                                 validator=_compiles)
    min_score: float = setting(0.0, help="lowest score the template asks for; a reply outside [min_score, max_score] is a failure", kw_only=True)
    max_score: float = setting(10.0, help="highest score the template asks for", kw_only=True, validator=_above_min)
    max_tokens: int = setting(16, help="longest reply, in the judge's tokens", validator=greater_than(0), kw_only=True)
    temperature: float = setting(0.0, help="the judge's sampling temperature (0: its most likely reply)", validator=at_least(0), kw_only=True)


def environment_headers(settings: ServiceSettings, where: str) -> tuple[dict[str, str], list[str]]:
    """(headers, secret values) from the environment variables the recipe names; a located
    RecipeError for one that is not set."""
    wanted = ([("Authorization", settings.auth_env, "auth_env")] if settings.auth_env else []) + \
             [(header, variable, f"headers_env[{header!r}]") for header, variable in settings.headers_env.items()]
    headers, secrets, problems = {}, [], []
    for header, variable, key in wanted:
        value = os.environ.get(variable, "")
        if not value:
            problems.append(f"{where}.{key}: the environment variable {variable} is not set (or empty); "
                            "export it in the shell that starts rlkit")
            continue
        headers[header] = f"Bearer {value}" if key == "auth_env" else value
        secrets.append(value)
    if problems:
        raise RecipeError(problems)
    return headers, secrets


def _cut(text: str, width: int = 200) -> str:
    return text if len(text) <= width else text[:width - 3] + "..."


class Service:
    """One reward service: JSON requests with a timeout, bounded retries and backoff, run up to
    `max_concurrent` at a time, each failure told with the URL and status and without secrets."""

    def __init__(self, settings: ServiceSettings, where: str):
        self.settings = settings
        self.headers, self.secrets = environment_headers(settings, where)
        self.pool = ThreadPoolExecutor(settings.max_concurrent, thread_name_prefix="rlkit-reward-service")

    def clean(self, text: str) -> str:
        """`text` with every credential value blanked out (a service may echo the headers back)."""
        for secret in self.secrets:
            text = text.replace(secret, "***")
        return text

    def _once(self, method: str, url: str, body: bytes | None) -> tuple[int, str, bytes, str | None]:
        """(status, reason, reply, Retry-After) of one request; OSError or HTTPException when there
        is no reply within the timeout. No redirects, no proxies: the URL is where the scores come from."""
        parts = urllib.parse.urlsplit(url)
        deadline = time.monotonic() + self.settings.timeout
        kind = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        connection = kind(parts.hostname or "", parts.port, timeout=self.settings.timeout)
        try:
            headers = {"Accept": "application/json", **self.headers}
            if body is not None:
                headers["Content-Type"] = "application/json"
            connection.request(method, (parts.path or "/") + (f"?{parts.query}" if parts.query else ""), body=body, headers=headers)
            sock = connection.sock  # the reply reads from it, also once the connection lets go of it
            reply = connection.getresponse()
            chunks, size = [], 0
            while True:  # the socket timeout bounds each read; the deadline bounds them all
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"timed out after {self.settings.timeout:g} s")
                sock.settimeout(left)
                chunk = reply.read1(65536)
                if not chunk:
                    break
                size += len(chunk)
                if size > LARGEST_REPLY:
                    raise http.client.HTTPException(f"reply larger than {LARGEST_REPLY} bytes")
                chunks.append(chunk)
            return reply.status, reply.reason, b"".join(chunks), reply.getheader("Retry-After")
        finally:
            connection.close()

    def request(self, method: str, url: str, payload=None, attempts: int | None = None):
        """The JSON reply to one request, retried as the settings say; ServiceFailure otherwise."""
        attempts = attempts or 1 + self.settings.retries
        body = None if payload is None else json.dumps(payload).encode()
        started, delay, last = time.monotonic(), self.settings.backoff, ""
        for attempt in range(attempts):
            if attempt:
                time.sleep(min(delay, self.settings.max_backoff))
                delay *= 2
            try:
                status, reason, reply, retry_after = self._once(method, url, body)
            except TimeoutError:
                last = f"no reply within the timeout of {self.settings.timeout:g} s"
                continue
            except (OSError, http.client.HTTPException) as exc:
                last = f"no reply ({type(exc).__name__}: {exc})"
                continue
            text = reply.decode("utf-8", "replace")
            if 200 <= status < 300:
                try:
                    return json.loads(text)
                except ValueError as exc:
                    raise ServiceFailure(self.clean(f"{method} {url}: HTTP {status} but the reply is not JSON ({exc}): {_cut(text)!r}")) from None
            last = f"HTTP {status} {reason}: {_cut(text)!r}"
            if status not in RETRIED_STATUSES:
                raise ServiceFailure(self.clean(f"{method} {url}: {last} (not retried: the service refused the request itself)"))
            if retry_after and retry_after.strip().isdigit():
                delay = max(delay, float(retry_after))
        tries = f"the last of {attempts} attempts" if attempts > 1 else "one attempt"
        raise ServiceFailure(self.clean(f"{method} {url}: {last} ({tries} in {time.monotonic() - started:.1f} s; "
                                        "the reward's timeout, retries and backoff say how long to try)"))

    def gather(self, jobs: list) -> list:
        """Each job's result, in order, at most `max_concurrent` running at once; the first failure
        cancels the jobs not yet started and is raised here, in the caller's thread."""
        futures = [self.pool.submit(job) for job in jobs]
        results = []
        for future in futures:
            try:
                results.append(future.result())
            except ServiceFailure as exc:
                for other in futures:
                    other.cancel()
                raise ServiceFailure(str(exc)) from None  # a fresh one: no thread-pool frames in the user's traceback
        return results


def _finite_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


class HttpReward(RewardSource):
    """Scores from a service of your own that speaks the `http` wire format (the module's docstring)."""

    def __init__(self, config: HttpRewardConfig, context=None):
        self.config = config
        self.service = Service(config, building_at(context, "reward"))

    @staticmethod
    def check(config: ServiceSettings, recipe, where: str) -> tuple[list[str], list[str]]:
        """(problems, notes): the credentials' environment variables are set. Connects to nothing."""
        try:
            environment_headers(config, where)
        except RecipeError as exc:
            return exc.problems, []
        return [], []

    @staticmethod
    def probe(config: HttpRewardConfig, where: str) -> list[str]:
        """What `rlkit check` (without --offline) finds wrong when it sends the empty batch."""
        try:
            reply = Service(config, where).request("POST", config.url, {"prompts": [], "responses": [], "columns": {}}, attempts=1)
        except RecipeError:
            return []  # the check already reported the missing variable
        except ServiceFailure as exc:
            return [f"{where}.url: the probe (the empty batch) failed: {exc}; check that the service runs at this URL and "
                    'answers the empty batch with {"scores": []} (rlkit check --offline skips this probe)']
        if not (isinstance(reply, dict) and reply.get("scores") == []):
            return [f"{where}.url: the reward service answered the empty batch with {_cut(json.dumps(reply))}, not "
                    '{"scores": []}; see the `http` wire format in docs/models-and-rewards.md']
        return []

    def score(self, prompts, responses, **columns):
        size = self.config.batch_size
        jobs = [partial(self._score_rows, prompts, responses, columns, start, min(start + size, len(responses)))
                for start in range(0, len(responses), size)]
        return [score for part in self.service.gather(jobs) for score in part]

    def _score_rows(self, prompts, responses, columns, start: int, stop: int) -> list[float]:
        payload = {"prompts": prompts[start:stop], "responses": responses[start:stop],
                   "columns": {name: list(values[start:stop]) for name, values in columns.items()}}
        try:
            reply = self.service.request("POST", self.config.url, payload)
        except TypeError as exc:  # a data column JSON cannot carry
            raise ServiceFailure(f"the batch cannot be sent as JSON: {exc}") from None
        where = f"POST {self.config.url}, responses {start} to {stop - 1} of the batch"
        scores = reply.get("scores") if isinstance(reply, dict) else None
        if not isinstance(scores, list):
            raise ServiceFailure(self.service.clean(f"{where}: the reply has no list 'scores': {_cut(json.dumps(reply))}"))
        if len(scores) != stop - start:
            raise ServiceFailure(f"{where}: the reply holds {len(scores)} scores for {stop - start} responses")
        for offset, value in enumerate(scores):
            if not _finite_number(value):
                raise ServiceFailure(self.service.clean(f"{where}: the score of response {start + offset} is "
                                                        f"{_cut(json.dumps(value), 60)}, not a finite number"))
        return [float(value) for value in scores]


PLACEHOLDER = re.compile(r"\{(\w+)\}")


class OpenAIJudge(RewardSource):
    """An LLM judge behind an OpenAI-compatible `/chat/completions` endpoint, one request per response."""

    def __init__(self, config: JudgeConfig, context=None):
        self.config = config
        self.url = config.url.rstrip("/") + "/chat/completions"
        self.pattern = re.compile(config.score_pattern)
        self.where = building_at(context, "reward")
        self.service = Service(config, self.where)

    @staticmethod
    def check(config: JudgeConfig, recipe, where: str) -> tuple[list[str], list[str]]:
        return HttpReward.check(config, recipe, where)

    @staticmethod
    def probe(config: JudgeConfig, where: str) -> list[str]:
        """What `rlkit check` (without --offline) finds wrong when it asks `<url>/models`."""
        url = config.url.rstrip("/") + "/models"
        try:
            reply = Service(config, where).request("GET", url, attempts=1)
        except RecipeError:
            return []
        except ServiceFailure as exc:
            return [f"{where}.url: the probe (listing the models) failed: {exc}; check that the endpoint runs at this URL "
                    "(rlkit check --offline skips this probe)"]
        served = [m.get("id") for m in reply.get("data", []) if isinstance(m, dict)] if isinstance(reply, dict) else []
        if config.model not in served:
            return [f"{where}.model: {config.url} does not serve {config.model!r} (it serves: {', '.join(map(str, served)) or 'nothing'})"]
        return []

    def message(self, prompt: str, response: str, row: dict) -> str:
        """The template with its placeholders filled; one the data lacks is the recipe's fault."""
        values = {**row, "prompt": prompt, "response": response}

        def fill(match):
            if match.group(1) not in values:
                raise RecipeError([f"{self.where}.template: {{{match.group(1)}}} is not prompt, response or a column of the data "
                                   f"(columns: {', '.join(sorted(row)) or 'none'})"])
            return str(values[match.group(1)])

        return PLACEHOLDER.sub(fill, self.config.template)

    def score(self, prompts, responses, **columns):
        messages = [self.message(p, r, {name: values[i] for name, values in columns.items()})
                    for i, (p, r) in enumerate(zip(prompts, responses))]
        return self.service.gather([partial(self._grade, i, m) for i, m in enumerate(messages)])

    def _grade(self, index: int, text: str) -> float:
        system = [{"role": "system", "content": self.config.system}] if self.config.system else []
        payload = {"model": self.config.model, "messages": [*system, {"role": "user", "content": text}],
                   "max_tokens": self.config.max_tokens, "temperature": self.config.temperature}
        reply = self.service.request("POST", self.url, payload)
        where = f"POST {self.url}, response {index} of the batch"
        try:
            content = reply["choices"][0]["message"]["content"]
        except (KeyError, IndexError, TypeError):
            content = None
        if not isinstance(content, str):
            raise ServiceFailure(self.service.clean(f"{where}: the reply has no choices[0].message.content: "
                                                    f"{_cut(json.dumps(reply))}"))
        found = self.pattern.search(content)
        try:
            if found is None:
                raise ValueError("no match")
            value = float(found.group(1) if self.pattern.groups else found.group(0))
        except (TypeError, ValueError):
            raise ServiceFailure(self.service.clean(f"{where}: no score in the judge's reply {_cut(content)!r} "
                                                    f"(score_pattern {self.config.score_pattern!r})")) from None
        if not (math.isfinite(value) and self.config.min_score <= value <= self.config.max_score):
            raise ServiceFailure(self.service.clean(f"{where}: the judge's score {value:g} in {_cut(content)!r} is outside "
                                                    f"[{self.config.min_score:g}, {self.config.max_score:g}]"))
        return value


@hookimpl
def register_rewards(register):
    register("http", HttpReward, HttpRewardConfig)
    register("openai-judge", OpenAIJudge, JudgeConfig)
