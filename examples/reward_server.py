"""A reward service to run next to a training run: the default task's reward (ROUGE-1 F1 against
the `reference` column, plus 0.5 for a summary that copies the whole fact), served over HTTP.

    python examples/reward_server.py --port 8765        # then, in another shell:
    rlkit run recipes/ppo_summarize_http_reward.toml

It speaks both wire formats of rlkit's service rewards (see docs/models-and-rewards.md, "Rewards from services"):

- `POST /score`, for `reward.type = "http"`: {"prompts", "responses", "columns"} -> {"scores"};
- `POST /v1/chat/completions` and `GET /v1/models`, for `reward.type = "openai-judge"`: a
  rule-based stand-in for an LLM judge. It finds the lines `Reference: ...` and `Summary: ...` in
  the last user message and answers `Score: <0 to 10>`, the same reward scaled to 0-10.

`--delay S` makes it wait S seconds before each answer, as a reward model or judge across the
network does (benchmarks/async_throughput.py measures the schedulers against it). `--token NAME`
makes it require `Authorization: Bearer <value of $NAME>`. It binds 127.0.0.1 only and uses
nothing but the standard library and rlkit's own task module. Replace `score` with your own model
or verifier: the rest is the wire format.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from rlkit_plugins.summarize_task import fact_copied, summary_reward

FACT_BONUS = 0.5  # as in recipes/ppo_summarize.toml
JUDGE_MODEL = "rule-judge"


def score(response: str, reference: str) -> float:
    return summary_reward(response, reference) + FACT_BONUS * fact_copied(response, reference)


def score_batch(body: dict) -> dict:
    references = body["columns"].get("reference", [])  # none in the empty batch of `rlkit check`'s probe
    return {"scores": [score(r, ref) for r, ref in zip(body["responses"], references, strict=True)]}


def judge(body: dict) -> dict:
    text = body["messages"][-1]["content"]
    reference = re.search(r"^Reference: (.*)$", text, re.M).group(1)
    summary = re.search(r"^Summary: (.*)$", text, re.M).group(1)
    grade = 10 * score(summary, reference) / (1 + FACT_BONUS)
    return {"object": "chat.completion", "model": JUDGE_MODEL,
            "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": f"Score: {grade:.2f}"}}]}


class Handler(BaseHTTPRequestHandler):
    token: str | None = None
    delay = 0.0  # seconds before each POST is answered
    routes = {"/score": score_batch, "/v1/chat/completions": judge}

    def _reply(self, status: int, payload: dict) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _authorised(self) -> bool:
        if self.token and self.headers.get("Authorization") != f"Bearer {self.token}":
            self._reply(401, {"error": "missing or wrong bearer token"})
            return False
        return True

    def do_GET(self):
        if not self._authorised():
            return
        if self.path == "/v1/models":
            self._reply(200, {"object": "list", "data": [{"id": JUDGE_MODEL, "object": "model"}]})
        else:
            self._reply(404, {"error": f"no route {self.path}"})

    def do_POST(self):
        if not self._authorised():
            return
        route = self.routes.get(self.path)
        if route is None:
            self._reply(404, {"error": f"no route {self.path}"})
            return
        try:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
            answer = route(body)
        except (ValueError, KeyError, TypeError, AttributeError, IndexError) as exc:
            self._reply(400, {"error": f"{type(exc).__name__}: {exc}"})
            return
        time.sleep(self.delay)
        self._reply(200, answer)

    def log_message(self, format, *args):  # one line per request would drown the training run's output
        pass


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8765, help="0: any free port (printed)")
    parser.add_argument("--delay", type=float, default=0.0, help="seconds to wait before each answer (a model's latency)")
    parser.add_argument("--token", metavar="NAME", help="require 'Authorization: Bearer <value of the environment variable NAME>'")
    args = parser.parse_args(argv)
    Handler.delay = args.delay
    if args.token:
        Handler.token = os.environ[args.token]
    server = ThreadingHTTPServer(("127.0.0.1", args.port), Handler)
    print(f"serving rewards on http://127.0.0.1:{server.server_address[1]} (/score, /v1/chat/completions)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


if __name__ == "__main__":
    main()
