"""The `http` and `openai-judge` rewards against real HTTP servers on 127.0.0.1: correct scores,
slow, failing, wrong-count and malformed replies, a server that dies mid-run under a real
`rlkit run`, credentials kept out of every message and file, and `rlkit check`'s probe."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from rlkit_plugins.reward_services import HttpReward, HttpRewardConfig, JudgeConfig, OpenAIJudge, ServiceFailure

from rlkit_core.errors import RecipeError
from rlkit_core.testing.contracts import RewardContract

ROOT = Path(__file__).parent.parent
ENV = {**os.environ, "RLKIT_PLUGINS": "none"}
SECRET = "tok-3f9a1c-very-secret"
FAST = {"retries": 0, "backoff": 0.01, "timeout": 5.0}


class Server:
    """A scoring service in a thread: each request takes the next behaviour of `plan` (then
    `default`): "ok" scores len(response); ("status", n), ("busy", Retry-After seconds), ("sleep", s),
    ("body", bytes), ("scores", list)."""

    def __init__(self):
        self.plan, self.default, self.requests = [], "ok", []
        self.in_flight = self.most_in_flight = 0
        self.lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                self.do_POST()

            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                with server.lock:
                    server.requests.append({"path": self.path, "headers": dict(self.headers), "body": json.loads(body or b"null")})
                    action = server.plan.pop(0) if server.plan else server.default
                    server.in_flight += 1
                    server.most_in_flight = max(server.most_in_flight, server.in_flight)
                try:
                    self.act(action, server.requests[-1]["body"])
                finally:
                    with server.lock:
                        server.in_flight -= 1

            def act(self, action, body):
                kind, value = (action, None) if isinstance(action, str) else action
                if kind == "sleep":
                    time.sleep(value)
                    kind = "ok"
                if kind == "ok":
                    self.send(200, json.dumps({"scores": [float(len(r)) for r in body["responses"]]}).encode())
                elif kind == "scores":
                    self.send(200, json.dumps({"scores": value}).encode())
                elif kind == "status":  # the body echoes the request's headers, as some services do
                    self.send(value, json.dumps({"error": "broken", "headers": dict(self.headers)}).encode())
                elif kind == "busy":  # 429 Too Many Requests, come back in `value` seconds
                    self.send(429, b'{"error": "rate limited"}', {"Retry-After": str(value)})
                else:
                    self.send(200, value)

            def send(self, status, data, headers=()):
                self.send_response(status)
                for name, value in dict(headers).items():
                    self.send_header(name, value)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/score"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server():
    running = Server()
    yield running
    running.close()


def http_reward(url, **settings):
    return HttpReward(HttpRewardConfig(url=url, **{**FAST, **settings}))


PROMPTS = [f"p{i}" for i in range(7)]
RESPONSES = ["", "a", "bb", "ccc", "dddd", "eeeee", "ffffff"]


def test_scores_come_back_in_order_over_several_concurrent_requests(server):
    server.default = ("sleep", 0.5)  # long enough for the two allowed requests to overlap
    reward = http_reward(server.url, batch_size=3, max_concurrent=2)
    scores = reward.score(PROMPTS, RESPONSES, reference=[f"r{i}" for i in range(7)])
    assert scores == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0]  # len(response), in the batch's order
    bodies = sorted((r["body"] for r in server.requests), key=lambda b: b["prompts"][0])
    assert bodies == [  # the wire format: rows split in batch_size, columns sliced with them
        {"prompts": ["p0", "p1", "p2"], "responses": ["", "a", "bb"], "columns": {"reference": ["r0", "r1", "r2"]}},
        {"prompts": ["p3", "p4", "p5"], "responses": ["ccc", "dddd", "eeeee"], "columns": {"reference": ["r3", "r4", "r5"]}},
        {"prompts": ["p6"], "responses": ["ffffff"], "columns": {"reference": ["r6"]}},
    ]
    assert server.most_in_flight == 2  # max_concurrent, reached and never passed
    assert all(r["headers"]["Content-Type"] == "application/json" for r in server.requests)


def test_an_empty_batch_sends_nothing(server):
    assert http_reward(server.url).score([], []) == []
    assert server.requests == []


def test_a_slow_server_times_out_is_retried_and_then_fails_within_the_bound(server):
    server.default = ("sleep", 3)
    reward = http_reward(server.url, timeout=0.3, retries=1, backoff=0.05)
    started = time.monotonic()
    with pytest.raises(ServiceFailure) as failure:
        reward.score(["p"], ["r"])
    assert time.monotonic() - started < 2.5  # 2 × 0.3 s + 0.05 s, with room; never the server's 3 s
    assert f"POST {server.url}: no reply within the timeout of 0.3 s (the last of 2 attempts in " in str(failure.value)
    assert len(server.requests) == 2


def test_a_request_that_times_out_once_is_answered_by_the_retry(server):
    server.plan = [("sleep", 3)]
    assert http_reward(server.url, timeout=0.3, retries=1).score(["p"], ["abc"]) == [3.0]
    assert len(server.requests) == 2


def test_500s_then_success_within_the_retries_give_the_scores(server):
    server.plan = [("status", 500), ("status", 503)]
    started = time.monotonic()
    assert http_reward(server.url, retries=2, backoff=0.1).score(["p", "q"], ["ab", "c"]) == [2.0, 1.0]
    assert time.monotonic() - started >= 0.1 + 0.2  # the backoff doubled between attempts
    assert len(server.requests) == 3


def test_500s_past_the_retries_fail_with_the_status(server):
    server.default = ("status", 503)
    with pytest.raises(ServiceFailure) as failure:
        http_reward(server.url, retries=2).score(["p"], ["r"])
    assert f"POST {server.url}: HTTP 503 Service Unavailable: " in str(failure.value)
    assert "(the last of 3 attempts in " in str(failure.value)
    assert len(server.requests) == 3


def test_a_rate_limited_request_waits_as_retry_after_says_up_to_max_backoff(server):
    server.plan = [("busy", 1)]
    started = time.monotonic()
    assert http_reward(server.url, retries=1, backoff=0.01).score(["p"], ["ab"]) == [2.0]
    assert time.monotonic() - started >= 1.0  # Retry-After, not the 0.01 s backoff
    server.plan = [("busy", 600)]
    started = time.monotonic()
    assert http_reward(server.url, retries=1, backoff=0.01, max_backoff=0.2).score(["p"], ["ab"]) == [2.0]
    assert time.monotonic() - started < 5  # capped at max_backoff, not 600 s


def test_a_client_error_is_not_retried(server):
    server.default = ("status", 400)
    with pytest.raises(ServiceFailure, match=r"HTTP 400 Bad Request: .* \(not retried: the service refused the request itself\)"):
        http_reward(server.url, retries=3).score(["p"], ["r"])
    assert len(server.requests) == 1


@pytest.mark.parametrize("action, message", [
    (("scores", [1.0]), "responses 0 to 1 of the batch: the reply holds 1 scores for 2 responses"),
    (("scores", [1.0, 2.0, 3.0]), "responses 0 to 1 of the batch: the reply holds 3 scores for 2 responses"),
    (("scores", [1.0, "high"]), 'the score of response 1 is "high", not a finite number'),
    (("scores", [True, 1.0]), "the score of response 0 is true, not a finite number"),
    (("body", b'{"scores": [NaN, 1.0]}'), "the score of response 0 is NaN, not a finite number"),
    (("body", b'{"scores": [1.0, Infinity]}'), "the score of response 1 is Infinity, not a finite number"),
    (("body", b'{"score": [1.0, 2.0]}'), "the reply has no list 'scores'"),
    (("body", b"[1.0, 2.0]"), "the reply has no list 'scores'"),
    (("body", b'{"scores": [1.0,'), "HTTP 200 but the reply is not JSON"),
    (("body", b"<html>oops</html>"), "HTTP 200 but the reply is not JSON"),
])
def test_wrong_counts_and_malformed_replies_are_failures_never_scores(server, action, message):
    server.default = action
    with pytest.raises(ServiceFailure) as failure:
        http_reward(server.url, retries=2).score(["p", "q"], ["a", "b"])
    assert message in str(failure.value)
    assert len(server.requests) == 1  # the service answered: asking again would not change its answer


def test_the_second_requests_failure_is_located_in_the_batch(server):
    server.plan = ["ok", ("scores", [1.0])]
    with pytest.raises(ServiceFailure, match="responses 2 to 3 of the batch: the reply holds 1 scores for 2 responses"):
        http_reward(server.url, batch_size=2, max_concurrent=1).score(["p"] * 4, ["a"] * 4)


def test_a_server_that_is_not_there_fails_after_the_retries(server):
    server.close()
    with pytest.raises(ServiceFailure, match=r"no reply \(ConnectionRefusedError: .*\) \(the last of 2 attempts in "):
        http_reward(server.url, retries=1).score(["p"], ["r"])


def test_credentials_come_from_the_environment_and_are_blanked_out_of_messages(server, monkeypatch):
    monkeypatch.setenv("RLKIT_TEST_TOKEN", SECRET)
    monkeypatch.setenv("RLKIT_TEST_KEY", "key-77af")
    reward = http_reward(server.url, auth_env="RLKIT_TEST_TOKEN", headers_env={"X-Api-Key": "RLKIT_TEST_KEY"})
    assert reward.score(["p"], ["ab"]) == [2.0]
    assert server.requests[0]["headers"]["Authorization"] == f"Bearer {SECRET}"
    assert server.requests[0]["headers"]["X-Api-Key"] == "key-77af"
    server.default = ("status", 500)  # its reply echoes the headers back
    with pytest.raises(ServiceFailure) as failure:
        reward.score(["p"], ["ab"])
    assert "HTTP 500" in str(failure.value) and "Bearer ***" in str(failure.value)
    assert SECRET not in str(failure.value) and "key-77af" not in str(failure.value)


def test_a_credential_variable_that_is_not_set_is_a_located_error(monkeypatch):
    monkeypatch.delenv("RLKIT_TEST_TOKEN", raising=False)
    with pytest.raises(RecipeError, match=r"\$\.reward\.auth_env: the environment variable RLKIT_TEST_TOKEN is not set"):
        http_reward("http://127.0.0.1:9/score", auth_env="RLKIT_TEST_TOKEN")


def test_credentials_in_the_recipe_are_refused_without_repeating_them(builtin_registry):
    from rlkit_core.recipe.document import structure_table

    _, problems = structure_table({"url": "http://user:hunter22@127.0.0.1:9/score"}, HttpRewardConfig, "$.reward", builtin_registry)
    assert [p.where for p in problems] == ["$.reward.url"]
    assert "holds credentials (user:password@host)" in problems[0].message and "hunter22" not in problems[0].message
    _, problems = structure_table({"url": "http://127.0.0.1:9/", "auth_env": "sk-live-123.abc"}, HttpRewardConfig, "$.reward", builtin_registry)
    assert str(problems[0]) == "$.reward.auth_env: must be the name of an environment variable (letters, digits, _), not its value"


class TestHttpRewardContract(RewardContract):
    component = "http"

    @pytest.fixture
    def component_config(self, server):
        return {"url": server.url}


# --- openai-judge -------------------------------------------------------------------------------

def example_server_module():
    spec = importlib.util.spec_from_file_location("reward_server", ROOT / "examples" / "reward_server.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def example_server(request):
    """examples/reward_server.py serving in a thread: `http` at /score, the judge at /v1; a
    parameter is a bearer token it then requires, as `--token` does."""
    module = example_server_module()
    module.Handler.token = getattr(request, "param", None)
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), module.Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


TEMPLATE = "Grade the summary from 0 to 10.\nReference: {reference}\nSummary: {response}\nDocument: {prompt}"


def judge(url, **settings):
    return OpenAIJudge(JudgeConfig(url=url, model="rule-judge", template=TEMPLATE, **{**FAST, **settings}))


def test_the_example_server_answers_the_probe_and_scores_as_the_in_process_reward(example_server):
    from rlkit_plugins.summarize import Rouge, RougeConfig

    assert HttpReward.probe(HttpRewardConfig(url=f"{example_server}/score", **FAST), "$.reward") == []
    reference = "The pilot cooked boxes in Berlin."
    responses = [reference, "", "The pilot cooked boxes in Berlin. The sky was grey.", "The pilot cooked boxes in Bern."]
    columns = {"reference": [reference] * 4, "document": ["d"] * 4}
    scores = http_reward(f"{example_server}/score", batch_size=3).score(["p"] * 4, responses, **columns)
    assert scores == Rouge(RougeConfig(fact_bonus=0.5)).score(["p"] * 4, responses, **columns)
    assert scores[:3] == [1.5, 0.0, 1.25]  # F1 1 + 0.5; nothing; 6 of 6 words in 10: F1 0.75, + 0.5


@pytest.mark.parametrize("example_server", [SECRET], indirect=True)
def test_the_example_server_with_a_token_refuses_requests_without_it(example_server, monkeypatch):
    with pytest.raises(ServiceFailure, match="HTTP 401 Unauthorized: .* \\(not retried: the service refused the request itself\\)"):
        http_reward(f"{example_server}/score").score(["p"], ["r"], reference=["r"])
    monkeypatch.setenv("RLKIT_TEST_TOKEN", SECRET)
    assert http_reward(f"{example_server}/score", auth_env="RLKIT_TEST_TOKEN").score(["p"], ["r"], reference=["r"]) == [1.5]  # F1 1 + 0.5


def test_the_judge_grades_each_response_by_the_template(example_server):
    reference = "The pilot cooked boxes in Berlin."
    scores = judge(f"{example_server}/v1/").score(
        ["doc 1", "doc 2", "doc 3"], [reference, "", "The pilot cooked boxes in Berlin. The sky was grey."],
        reference=[reference] * 3)
    # ROUGE-1 F1 + 0.5 × whole fact, scaled by 10 / 1.5: exact 1 + 0.5 -> 10.00; empty -> 0.00;
    # with the filler: 6 of 6 reference words in 10, F1 = 2·0.6·1/1.6 = 0.75, + 0.5 -> 8.33
    assert scores == [10.0, 0.0, 8.33]


def judge_server(server, content):
    server.default = ("body", json.dumps({"choices": [{"message": {"role": "assistant", "content": content}}]}).encode())
    return server.url.removesuffix("/score") + "/v1"


@pytest.mark.parametrize("content, settings, expected", [
    ("7", {}, 7.0),
    ("Score: 4.5/10, because it is short", {}, 4.5),
    ("Rating 3 of 5. Final: 8", {"score_pattern": r"Final: (\d+)"}, 8.0),
    ("-1", {"min_score": -1.0, "max_score": 1.0}, -1.0),
])
def test_the_judges_score_is_the_first_match_of_its_pattern(server, content, settings, expected):
    assert judge(judge_server(server, content), **settings).score(["p"], ["r"], reference=["x"]) == [expected]
    request = server.requests[0]
    assert request["path"] == "/v1/chat/completions"
    assert request["body"] == {"model": "rule-judge", "max_tokens": 16, "temperature": 0.0, "messages": [
        {"role": "user", "content": "Grade the summary from 0 to 10.\nReference: x\nSummary: r\nDocument: p"}]}


@pytest.mark.parametrize("content, message", [
    ("I cannot grade this.", "no score in the judge's reply 'I cannot grade this.'"),
    ("Score: 11", "the judge's score 11 in 'Score: 11' is outside [0, 10]"),
    ("Score: -2", "the judge's score -2 in 'Score: -2' is outside [0, 10]"),
])
def test_an_unparseable_or_out_of_range_grade_is_a_failure_never_a_score(server, content, message):
    with pytest.raises(ServiceFailure) as failure:
        judge(judge_server(server, content)).score(["p", "q"], ["r", "s"], reference=["x", "y"])
    assert message in str(failure.value) and "/v1/chat/completions, response 0 of the batch" in str(failure.value)


def test_a_judge_reply_without_a_message_is_a_failure(server):
    server.default = ("body", b'{"choices": []}')
    with pytest.raises(ServiceFailure, match=r"the reply has no choices\[0\]\.message\.content: "):
        judge(server.url.removesuffix("/score") + "/v1").score(["p"], ["r"], reference=["x"])


def test_a_template_placeholder_the_data_lacks_is_the_recipes_fault(server):
    with pytest.raises(RecipeError, match=r"\$\.reward\.template: \{reference\} is not prompt, response or a column of the data \(columns: document\)"):
        judge(server.url).score(["p"], ["r"], document=["d"])
    assert server.requests == []


class TestOpenAIJudgeContract(RewardContract):
    component = "openai-judge"
    columns = {"reference": ["The cat sat.", "The meeting is on Friday.", "x"]}

    @pytest.fixture
    def component_config(self, example_server):
        return {"url": f"{example_server}/v1", "model": "rule-judge", "template": "Reference: {reference}\nSummary: {response}"}


def test_the_judge_probe_asks_for_the_model(example_server):
    config = JudgeConfig(url=f"{example_server}/v1", model="rule-judge", template=TEMPLATE, **FAST)
    assert OpenAIJudge.probe(config, "$.reward") == []
    other = JudgeConfig(url=f"{example_server}/v1", model="gpt-9", template=TEMPLATE, **FAST)
    assert OpenAIJudge.probe(other, "$.reward") == [f"$.reward.model: {example_server}/v1 does not serve 'gpt-9' (it serves: rule-judge)"]


# --- rlkit check and rlkit run, as a user meets them ------------------------------------------

def cli(*args, env=ENV, timeout=240):
    return subprocess.run([sys.executable, "-m", "rlkit_core.runtime.cli", *args], env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def http_recipe(recipe_document, write_recipe):
    def make(url, name="http.toml", steps=2, on_bad_reward="stop", **reward):
        document = dict(recipe_document, run={**recipe_document["run"], "steps": steps, "on_bad_reward": on_bad_reward},
                        reward={"type": "http", "url": url, **FAST, **reward})
        return write_recipe(document, name)

    return make


@pytest.mark.slow
def test_rlkit_check_probes_the_service_and_offline_skips_the_probe(server, http_recipe, capsys, monkeypatch):
    from rlkit_core.runtime.cli import main

    monkeypatch.setenv("HF_HUB_OFFLINE", os.environ.get("HF_HUB_OFFLINE", "0"))  # --offline sets it; undone after the test
    recipe = http_recipe(server.url)
    assert main(["check", recipe]) == 0, capsys.readouterr().err
    assert server.requests[-1]["body"] == {"prompts": [], "responses": [], "columns": {}}
    server.default = ("scores", [0.0])
    assert main(["check", recipe]) == 2
    assert '$.reward.url: the reward service answered the empty batch with {"scores": [0.0]}, not {"scores": []}' in capsys.readouterr().err
    asked = len(server.requests)
    assert main(["check", recipe, "--offline"]) == 0
    assert "$.reward: the http service was not probed (--offline)" in capsys.readouterr().out
    assert len(server.requests) == asked  # --offline sent nothing
    server.default = ("status", 500)  # and as a user meets it: exit 2, the located line
    failed = cli("check", recipe)
    assert failed.returncode == 2
    assert (f"$.reward.url: the probe (the empty batch) failed: POST {server.url}: HTTP 500 Internal Server Error: ") in failed.stderr
    assert "(rlkit check --offline skips this probe)" in failed.stderr


@pytest.mark.slow
def test_check_and_run_refuse_a_credential_variable_that_is_not_set(server, http_recipe, tmp_path, capsys):
    from rlkit_core.runtime.cli import main

    recipe = http_recipe(server.url, auth_env="RLKIT_TEST_UNSET_TOKEN")
    problem = "$.reward.auth_env: the environment variable RLKIT_TEST_UNSET_TOKEN is not set (or empty)"
    assert main(["check", recipe]) == 2 and problem in capsys.readouterr().err
    result = cli("run", recipe)
    assert result.returncode == 2 and problem in result.stderr
    assert server.requests == [] and not (tmp_path / "run").exists()  # refused before anything was built or written


DYING_SERVER = '''
import json, os, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

answered = 0


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_POST(self):
        global answered
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        assert self.headers["Authorization"] == "Bearer " + os.environ["RLKIT_TEST_TOKEN"]
        data = json.dumps({"scores": [sum(c.islower() for c in r) / 8 for r in body["responses"]]}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
        self.wfile.flush()
        answered += 1
        if answered == int(sys.argv[1]):
            os._exit(0)  # dies, port and all, after its last answer


server = ThreadingHTTPServer(("127.0.0.1", int(sys.argv[2])), Handler)
print(server.server_address[1], flush=True)
server.serve_forever()
'''


@pytest.mark.slow
def test_a_batch_the_service_fails_is_skipped_and_counted_under_the_skip_policy(server, http_recipe, tmp_path):
    server.plan = ["ok", ("status", 502), ("status", 502)]  # iteration 2: both attempts fail
    result = cli("run", "--quiet", http_recipe(server.url, steps=3, retries=1, on_bad_reward="skip"), env=ENV)
    assert result.returncode == 0, result.stderr
    assert (f'reward "http" (url = "{server.url}", ') in result.stderr
    assert f"failed at iteration 2: raised ServiceFailure: POST {server.url}: HTTP 502 Bad Gateway: " in result.stderr
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [row["iteration"] for row in rows] == [1, 2, 3] and rows[-1]["run/skipped_batches"] == 1
    assert "score/mean" not in rows[1] and (tmp_path / "run" / "bad_batches" / "iter_000002.json").is_file()


@pytest.mark.slow
def test_two_processes_each_send_their_share_and_stop_together_when_one_request_fails(server, http_recipe, tmp_path):
    from rlkit_core.runtime import checkpoint

    server.plan = ["ok", "ok", ("status", 500)]  # iteration 2: whichever process asks first fails, the other is answered
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               str(Path(sys.executable).with_name("rlkit")), "run", "--quiet", http_recipe(server.url, steps=3)]
    result = subprocess.run(command, env=ENV, capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    assert f'failed at iteration 2: raised ServiceFailure: POST {server.url}: HTTP 500 Internal Server Error: ' in result.stderr
    first = [r["body"]["prompts"] for r in server.requests[:2]]
    assert len(server.requests) == 4 and all(len(r["body"]["responses"]) == 8 for r in server.requests)  # 16 rollouts, halved
    assert len(set(first[0] + first[1])) == 16  # iteration 1: the processes sent different prompts
    saved = checkpoint.resolve("auto", tmp_path / "run")
    assert saved.name == "iter_000001" and checkpoint.read_meta(saved)["processes"] == 2


def serve(script, answers, port, env):
    """The dying server, started on `port` (0: any free one): (process, its port)."""
    process = subprocess.Popen([sys.executable, str(script), str(answers), str(port)], env=env, stdout=subprocess.PIPE, text=True)
    return process, process.stdout.readline().strip()


@pytest.mark.slow
def test_a_server_that_dies_mid_run_stops_the_run_as_a_bad_reward_without_leaking_the_token(http_recipe, tmp_path):
    script = tmp_path / "dying_server.py"
    script.write_text(DYING_SERVER)
    env = {**ENV, "RLKIT_TEST_TOKEN": SECRET}
    dying, port = serve(script, 2, 0, env)
    try:
        url = f"http://127.0.0.1:{port}/score"
        recipe = http_recipe(url, steps=4, auth_env="RLKIT_TEST_TOKEN", retries=1, timeout=2.0, backoff=0.05)
        result = cli("run", "--quiet", recipe, env=env)
    finally:
        dying.kill()
        dying.wait(timeout=10)
    assert dying.returncode == 0  # it died by itself after two answers: iterations 1 and 2
    assert result.returncode == 1, result.stderr
    output_dir = tmp_path / "run"
    message = result.stderr.strip().splitlines()[-1]
    assert message.startswith(f'rlkit run: reward "http" (url = "{url}", ')
    assert (f"failed at iteration 3: raised ServiceFailure: POST {url}: no reply (ConnectionRefusedError: "
            "[Errno 111] Connection refused) (the last of 2 attempts in ") in message
    assert f"saved the state after iteration 2 as {output_dir / 'checkpoints' / 'iter_000002'}" in message
    assert f"and the batch as {output_dir / 'bad_batches' / 'iter_000003.json'}" in message
    saved = json.loads((output_dir / "bad_batches" / "iter_000003.json").read_text())
    assert saved["iteration"] == 3 and len(saved["rows"]) == 16 and "Connection refused" in saved["problem"]
    assert [json.loads(line)["iteration"] for line in (output_dir / "metrics.jsonl").read_text().splitlines()] == [1, 2]

    back, _ = serve(script, 100, port, env)  # the service is back: the run continues where it stopped
    try:
        resumed = cli("run", "--quiet", recipe, "--resume", "auto", env=env)
    finally:
        back.kill()
        back.wait(timeout=10)
    assert resumed.returncode == 0, resumed.stderr
    assert [json.loads(line)["iteration"] for line in (output_dir / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4]
    leaked = [str(p) for p in output_dir.rglob("*") if p.is_file() and SECRET.encode() in p.read_bytes()]
    assert leaked == [] and SECRET not in result.stderr + result.stdout + resumed.stderr + resumed.stdout


# --- the example server and recipe on the default task ----------------------------------------

SHRUNK = ["run.steps=2", "run.threads=1", "tracker.type=none", "policy.n_layer=1", "policy.n_embd=32", "policy.n_head=2",
          "policy.sft_steps=300", "policy.sft_batch_size=8", "policy.sft_learning_rate=0.01", "generator.max_new_tokens=12",
          "data.size=40", "eval.size=4", "ppo.batch_size=8", "ppo.minibatch_size=4"]


@pytest.fixture(scope="module")
def warm_cache(tmp_path_factory):
    """One folder for the shrunk warm start, built by the first test that needs it."""
    return tmp_path_factory.mktemp("warm-start-cache")


@pytest.mark.slow
def test_the_http_recipe_against_the_example_server_trains_exactly_as_the_in_process_reward(tmp_path, warm_cache):
    import io

    from rlkit_core.recipe.document import load_recipe
    from rlkit_core.recipe.plugins import load_registry
    from rlkit_core.runtime.run import run_recipe

    def train(recipe, *overrides):
        loaded = load_recipe(ROOT / "recipes" / recipe, load_registry(environ={"RLKIT_PLUGINS": "none"}),
                             [*SHRUNK, f"policy.cache_dir={warm_cache}", *overrides])
        return [{k: v for k, v in row.items() if not k.startswith("time/")} for row in run_recipe(loaded, quiet=True, out=io.StringIO())]

    served = subprocess.Popen([sys.executable, str(ROOT / "examples" / "reward_server.py"), "--port", "0"], env=ENV,
                              stdout=subprocess.PIPE, text=True)
    try:
        url = served.stdout.readline().split()[3] + "/score"  # "serving rewards on http://127.0.0.1:PORT (...)"
        over_http = train("ppo_summarize_http_reward.toml", f"run.output_dir={tmp_path / 'http'}", f"reward.url={url}")
    finally:
        served.kill()
        served.wait(timeout=10)
    assert [row["iteration"] for row in over_http] == [0, 1, 2] and "eval/score" in over_http[0]
    assert all(row["score/mean"] > 0 for row in over_http[1:])  # 300 supervised steps: "The ce in in", some words right
    in_process = train("ppo_summarize.toml", f"run.output_dir={tmp_path / 'rouge'}")
    # the service computes the same reward: the same training, to the last digit (json: a NaN equals a NaN)
    assert json.dumps(over_http) == json.dumps(in_process)


@pytest.mark.slow
def test_a_run_graded_by_the_example_judge(example_server, tmp_path, warm_cache):
    import io

    from rlkit_core.recipe.document import load_recipe
    from rlkit_core.recipe.plugins import load_registry
    from rlkit_core.runtime.run import run_recipe

    judge_table = ('reward={type="openai-judge", url="' + example_server + '/v1", model="rule-judge", max_concurrent=4, '
                   'template="Reference: {reference}\\nSummary: {response}\\nGrade it from 0 to 10."}')
    recipe = load_recipe(ROOT / "recipes" / "ppo_summarize_http_reward.toml", load_registry(environ={"RLKIT_PLUGINS": "none"}),
                         [*SHRUNK, f"policy.cache_dir={warm_cache}", f"run.output_dir={tmp_path / 'judged'}", judge_table])
    history = run_recipe(recipe, quiet=True, out=io.StringIO())
    assert [row["iteration"] for row in history] == [0, 1, 2]
    assert all(0 < row["score/mean"] <= 10 for row in history[1:])  # 8 responses, each graded by its own request
