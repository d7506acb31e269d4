"""The least a request through an OpenAI-compatible endpoint can cost on this machine: the `openai`
client and the server stack the agent endpoint runs on (uvicorn, Starlette), with no model and no
rlkit behind them. A server in a thread of this process answers every chat completion at once with
the same short OpenAI-shaped answer; `--agents` threads, each with a copy of one shared client bound
to a session of its own (as `rlkit_core.harness` hands them out), send `--requests` requests each,
all at once. Whatever the endpoint adds on top of this, a request costs at least this much.

    python benchmarks/openai_client_floor.py                      # 64 agents of 4 requests, as a guess-number iteration
    python benchmarks/openai_client_floor.py --agents 1 --requests 200   # one agent, one request at a time

Prints one JSON line: the wall-clock and CPU (this process, every thread) milliseconds per request,
and that cost for `--per-iteration` requests as a share of a `--iteration-s` iteration (defaults: the
236 requests and 1.32 s of the multi-turn default recipe's iteration in process, benchmarks/README.md).
"""

from __future__ import annotations

import argparse
import json
import socket
import threading
import time

ANSWER = {"id": "chatcmpl-0", "object": "chat.completion", "created": 0, "model": "policy",
          "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "8"}}],
          "usage": {"prompt_tokens": 20, "completion_tokens": 2, "total_tokens": 22}}
MESSAGES = [{"role": "user", "content": "Guess my number, 1-16."}, {"role": "assistant", "content": "8"},
            {"role": "user", "content": "higher: 9-16"}]


def serve() -> str:
    """The base URL of a server that answers every chat completion with `ANSWER`."""
    import uvicorn
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    async def chat_completions(http):
        await http.json()  # read as the endpoint reads it
        return JSONResponse(ANSWER)

    app = Starlette(routes=[Route("/sessions/{session_id}/v1/chat/completions", chat_completions, methods=["POST"])])
    listener = socket.socket()
    listener.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # as the endpoint's: without it a request waits ~40 ms on a delayed ACK
    listener.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off"))
    threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True).start()
    while not server.started:
        time.sleep(0.01)
    return f"http://127.0.0.1:{listener.getsockname()[1]}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--agents", type=int, default=64, help="agent threads, all at once")
    parser.add_argument("--requests", type=int, default=4, help="requests each agent sends, one after another")
    parser.add_argument("--rounds", type=int, default=5, help="times the whole load runs (medians)")
    parser.add_argument("--per-iteration", type=int, default=236, help="requests in an iteration")
    parser.add_argument("--iteration-s", type=float, default=1.32, help="seconds an iteration takes without the endpoint")
    args = parser.parse_args()
    from openai import OpenAI

    url = serve()
    shared = OpenAI(base_url=url, api_key="floor", max_retries=0)

    def agent(session: int) -> None:
        client = shared.with_options(base_url=f"{url}/sessions/{session}/v1", api_key=f"key-{session}")
        for _ in range(args.requests):
            answer = client.chat.completions.create(model="policy", messages=MESSAGES, max_tokens=8, temperature=1.0)
            assert answer.choices[0].message.content == "8"

    walls, cpus = [], []
    for _ in range(args.rounds + 1):  # the first warms the connections up
        threads = [threading.Thread(target=agent, args=(s,)) for s in range(args.agents)]
        wall, cpu = time.perf_counter(), time.process_time()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        walls.append((time.perf_counter() - wall) * 1000 / (args.agents * args.requests))
        cpus.append((time.process_time() - cpu) * 1000 / (args.agents * args.requests))
    wall_ms, cpu_ms = sorted(walls[1:])[args.rounds // 2], sorted(cpus[1:])[args.rounds // 2]
    print(json.dumps({"agents": args.agents, "requests_each": args.requests, "wall_ms_per_request": round(wall_ms, 3),
                      "cpu_ms_per_request": round(cpu_ms, 3),
                      "share_of_an_iteration": round(wall_ms * args.per_iteration / 1000 / args.iteration_s, 3)}))


if __name__ == "__main__":
    main()
