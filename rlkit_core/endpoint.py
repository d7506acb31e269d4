# pyright: standard
"""An OpenAI-compatible chat endpoint on loopback, through which an agent that rlkit did not write
(a harness: a program calling `client.chat.completions.create`) plays rlkit's episodes.

Each episode is a session with its own base URL (`http://127.0.0.1:<port>/sessions/<id>/v1`) and
key. The endpoint never renders or tokenises: a request waits in its session's inbox until the
episode's environment takes it (`Session.next_event`, called from the agent environment's `reset`
and `step`), which hands its messages to the core as any environment's messages, and the model's
turn comes back as the response (`Session.respond`). The core keeps the sampled ids as sampled.

A request's messages are compared, never re-encoded: when they extend the conversation as the
endpoint returned it (the assistant turns as it sent them, tool-call ids included), the new ones
are what the environment says next, and the core renders only the gap; when the harness changed
what came before, the turn comes with the whole conversation (`Step.history`), a new sample starts
and is counted. Whatever the endpoint refuses (a malformed request, a setting the run's sampling
would not honour, an unknown tool-call id, a request past the episode's turns or after its end,
a second request at once) is an HTTP error the harness can read, counted, and never trained on.
The harness's return ends the episode at once: a request it left waiting is refused, and a turn
sampled for it is not the episode's.
"""

from __future__ import annotations

import asyncio
import json
import queue
import secrets
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import attrs

from rlkit_core.messages import Reply

ROLES = ("system", "developer", "user", "assistant", "tool")
ENDED_KEPT = 100_000  # ended sessions remembered, so that a late request reads why
# an idle connection is kept longer than a client keeps it (httpx, under the openai client: 5 s), so that the client, not
# the server, closes it: at equal limits a request sent as the server closes it fails as a connection error, and with no
# retries the episode is an error (once in 960 episodes of the default agent recipe under load, before this was set)
KEEP_ALIVE_S = 75


class Refused(Exception):
    """A request answered with an HTTP error: `status`, a message naming the fix, and a `code`."""

    def __init__(self, status: int, message: str, code: str):
        super().__init__(message)
        self.status, self.message, self.code = status, message, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": "invalid_request_error", "code": self.code}}


@attrs.define(eq=False)
class Request:
    """One chat completion asked for, and the future its HTTP handler awaits: (status, body)."""

    body: dict[str, Any]
    answer: Future = attrs.field(factory=Future)

    def settle(self, status: int, body: dict[str, Any]) -> None:
        if not self.answer.done():
            self.answer.set_result((status, body))


@attrs.frozen
class HarnessEnded:
    """The harness returned (its reward and figures) or failed (`failure`: why, for the warning)."""

    reward: float | None = None
    info: dict[str, float] = attrs.field(factory=dict)
    failure: str | None = None


@attrs.frozen
class Turn:
    """A request the environment took: the conversation in the chat template's terms, the tools,
    and either the messages that extend what the session said before (`new`) or None when the
    harness changed what came before."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]]
    new: list[dict[str, Any]] | None


@attrs.frozen
class Limits:
    """What a request may ask for, from the recipe: its sampling is the run's, not the harness's."""

    max_turns: int
    max_new_tokens: int
    temperature: float
    model: str = "policy"
    top_p: float = 1.0
    top_k: int = 0


# sampling fields a request may send only at the value that changes nothing (`sampling`)
NEUTRAL = {"min_p": 0.0, "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0}


def text_of(content: Any, where: str) -> str:
    """A message's content as text: a string, None, or a list of text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise Refused(400, f"{where}.content is neither a string nor a list of text parts; the policy reads text only", "invalid_content")


def call_of(entry: Any, where: str) -> tuple[str, str, dict[str, Any]]:
    """An assistant message's tool call as (id, name, arguments)."""
    function = entry.get("function") if isinstance(entry, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not isinstance(entry.get("id"), str):
        raise Refused(400, f"{where} is not a tool call with an 'id' and a 'function' with a 'name'", "invalid_tool_call")
    arguments = function.get("arguments", "{}")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments or "{}")
        except json.JSONDecodeError:
            raise Refused(400, f"{where}.function.arguments is not JSON", "invalid_tool_call") from None
    if not isinstance(arguments, dict):
        raise Refused(400, f"{where}.function.arguments is not a JSON object", "invalid_tool_call")
    return entry["id"], function["name"], arguments


def normalized(messages: Any) -> list[dict[str, Any]]:
    """The request's messages in one canonical form (role, text, tool calls, tool-call id), so that
    what a client serialised with fields of its own compares equal to what the endpoint returned.
    A malformed message, or a tool result for a call no assistant turn before it made, is refused."""
    if not isinstance(messages, list) or not messages:
        raise Refused(400, "'messages' must be a non-empty list of messages", "invalid_messages")
    made: set[str] = set()
    result = []
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise Refused(400, f"{where} is not a message with a role among {', '.join(ROLES)}", "invalid_messages")
        role = message["role"]
        entry: dict[str, Any] = {"role": role, "content": text_of(message.get("content"), where)}
        if role == "assistant" and message.get("tool_calls"):
            if not isinstance(message["tool_calls"], list):
                raise Refused(400, f"{where}.tool_calls is not a list", "invalid_tool_call")
            entry["tool_calls"] = [call_of(call, f"{where}.tool_calls[{i}]") for i, call in enumerate(message["tool_calls"])]
            made.update(call_id for call_id, _, _ in entry["tool_calls"])
        if role == "tool":
            call_id = message.get("tool_call_id")
            if call_id not in made:
                raise Refused(400, f"{where}.tool_call_id {call_id!r} names no tool call of an assistant message before it", "unknown_tool_call_id")
            entry["tool_call_id"] = call_id
        result.append(entry)
    return result


def for_template(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Normalized messages as chat templates take them: tool calls in the OpenAI layout with their
    arguments as objects, a tool result named by its call's tool, a developer message as system."""
    names = {call_id: name for m in messages for call_id, name, _ in m.get("tool_calls", ())}
    rendered = []
    for m in messages:
        role = "system" if m["role"] == "developer" else m["role"]
        if role == "tool":
            rendered.append({"role": "tool", "name": names[m["tool_call_id"]], "content": m["content"]})
        elif m.get("tool_calls"):
            calls = [{"type": "function", "function": {"name": name, "arguments": arguments}} for _, name, arguments in m["tool_calls"]]
            rendered.append({"role": role, "content": m["content"], "tool_calls": calls})
        else:
            rendered.append({"role": role, "content": m["content"]})
    return rendered


def checked_body(body: Any, limits: Limits) -> dict[str, Any]:
    """The request's own fields, refused where they ask for what the run's sampling does not do."""
    if not isinstance(body, dict):
        raise Refused(400, "the request body is not a JSON object", "invalid_request")
    if not isinstance(body.get("stream_options") or {}, dict):
        raise Refused(400, "'stream_options' must be an object, e.g. {'include_usage': true}", "invalid_request")
    if body.get("n") not in (None, 1):
        raise Refused(400, "'n' must be 1: an episode is one conversation (set samples_per_prompt in the recipe for more)", "invalid_n")
    temperature = body.get("temperature")
    if temperature is not None and (not isinstance(temperature, (int, float)) or abs(temperature - limits.temperature) > 1e-6):
        raise Refused(400, f"'temperature' {temperature!r} is not the run's: the policy samples at generator.temperature = "
                           f"{limits.temperature:g}, which its training assumes; leave 'temperature' out or send that", "invalid_temperature")
    for name in ("max_tokens", "max_completion_tokens"):
        asked = body.get(name)
        if asked is not None and (not isinstance(asked, int) or asked < limits.max_new_tokens):
            raise Refused(400, f"'{name}' {asked!r} is below the run's turn limit: every turn samples up to generator.max_new_tokens = "
                               f"{limits.max_new_tokens}; leave '{name}' out or ask for at least that", "invalid_max_tokens")
    sampling(body, limits)
    if body.get("stop"):
        raise Refused(400, "'stop' sequences are not served: a turn ends at the policy's end token", "stop_unsupported")
    if body.get("parallel_tool_calls") is False:
        raise Refused(400, "'parallel_tool_calls' false cannot be enforced: the policy may call several tools in a "
                           "turn; leave it out or send true", "parallel_tool_calls_unsupported")
    if body.get("top_logprobs"):
        raise Refused(400, "'top_logprobs' are not served: each sampled id comes with its own log-prob only "
                           "('logprobs': true); leave it out or send 0", "top_logprobs_unsupported")
    if (body.get("response_format") or {"type": "text"}) != {"type": "text"}:
        raise Refused(400, "'response_format' cannot be enforced: the policy samples freely; leave it out or send "
                           "{'type': 'text'}", "response_format_unsupported")
    if body.get("reasoning_effort") is not None:
        raise Refused(400, "'reasoning_effort' is not served: how long the policy reasons is its training's and its "
                           "chat template's; leave it out", "reasoning_effort_unsupported")
    if body.get("tool_choice", "auto") not in ("auto", None):
        raise Refused(400, f"'tool_choice' {body['tool_choice']!r} cannot be enforced: the policy samples freely; leave it out or "
                           "send 'auto'", "tool_choice_unsupported")
    normalized(body.get("messages"))
    tools = body.get("tools") or []
    if not isinstance(tools, list) or not all(isinstance(t, dict) and t.get("type") == "function" and isinstance(t.get("function"), dict)
                                              and isinstance(t["function"].get("name"), str) for t in tools):
        raise Refused(400, "'tools' must be a list of {'type': 'function', 'function': {'name': ..., ...}}", "invalid_tools")
    return body


def sampling(body: dict[str, Any], limits: Limits) -> None:
    """Refuse a sampling field that would change what the policy samples: the run's sampler is the
    one its training assumes. Each is taken at the run's value, or the value that changes nothing."""
    served = {"top_p": limits.top_p, "top_k": limits.top_k, **NEUTRAL}
    for name, value in served.items():
        asked = body.get(name)
        if asked is None or name == "top_k" and value == 0 and asked == -1:  # -1: off, as vLLM writes it
            continue
        if isinstance(asked, bool) or not isinstance(asked, (int, float)) or abs(asked - value) > 1e-6:
            raise Refused(400, f"'{name}' {asked!r} is not served: the policy samples with {name} = {value:g} (the "
                               f"run's), which its training assumes; leave '{name}' out or send {value:g}",
                          "sampling_unsupported")
    if body.get("logit_bias"):
        raise Refused(400, "'logit_bias' is not served: a bias changes what the policy samples, which its training "
                           "assumes is its own distribution; leave it out or send {}", "sampling_unsupported")


def as_chunks(completion: dict[str, Any], usage: bool) -> list[dict[str, Any]]:
    """A whole completion as the chunks of a stream (`stream: true`): the role and the content with
    its log-probs, then the tool calls, then the finish reason with the sampled ids and the other
    extension fields, then (`usage`: the request's `stream_options.include_usage`) the token counts.
    The turn is sampled whole before its first chunk is sent: a stream is its answer in OpenAI's
    stream layout."""
    choice, head = completion["choices"][0], {"id": completion["id"], "object": "chat.completion.chunk", "created": completion["created"],
                                              "model": completion["model"]}
    message = choice["message"]
    deltas = [{"index": 0, "delta": {"role": "assistant", "content": message["content"]}, "logprobs": choice["logprobs"], "finish_reason": None}]
    if message.get("tool_calls"):
        calls = [{"index": index, **call} for index, call in enumerate(message["tool_calls"])]
        deltas.append({"index": 0, "delta": {"tool_calls": calls}, "logprobs": None, "finish_reason": None})
    deltas.append({"index": 0, "delta": {}, "logprobs": None, "finish_reason": choice["finish_reason"], "token_ids": choice["token_ids"],
                   "weights_version": choice["weights_version"], "tool_call_error": choice["tool_call_error"]})
    return [{**head, "choices": [delta]} for delta in deltas] + ([{**head, "choices": [], "usage": completion["usage"]}] if usage else [])


class Session:
    """One episode's conversation with its harness (see the module). The HTTP handler `submit`s
    requests; the environment, in its own thread, takes them (`next_event`) and answers (`respond`)."""

    def __init__(self, endpoint: Endpoint, limits: Limits):
        self.endpoint, self.limits = endpoint, limits
        self.id, self.key = secrets.token_hex(8), f"rlkit-{secrets.token_hex(16)}"
        self.inbox: queue.Queue[Request | HarnessEnded] = queue.Queue()
        self.lock = threading.Lock()
        self.in_flight: Request | None = None  # the request the harness awaits an answer to
        self.conversation: list[dict[str, Any]] = []  # normalized, as the endpoint returned it
        self.tools: list[dict[str, Any]] = []  # as the first request named them
        self.turns = self.requests = self.refused = self.rewrites = 0
        self.calls: set[str] = set()  # ids of the tool calls the model made (the endpoint named them)
        self.answered: set[str] = set()  # those the harness sent a tool result for
        self.ended: str | None = None  # why no request is taken any more
        self.outcome: HarnessEnded | None = None  # what the harness returned: the episode's end, whatever is queued

    @property
    def base_url(self) -> str:
        return f"{self.endpoint.url}/sessions/{self.id}/v1"

    def submit(self, request: Request) -> None:
        """A request from the harness (the HTTP handler's thread): queued for the environment, or refused."""
        with self.lock:
            if self.ended:
                return request.settle(*_refusal(Refused(410, f"this episode has ended ({self.ended}); no request is taken after its end",
                                                        "episode_ended")))
            if self.in_flight is not None:
                return request.settle(*_refusal(Refused(400, "a request of this session is still being answered: an episode is one "
                                                             "conversation, one request at a time", "request_in_flight")))
            self.in_flight = request
            self.requests += 1
            self.inbox.put(request)  # under the lock: a request taken before `end` is in the inbox `end` drains

    def harness_ended(self, ended: HarnessEnded) -> None:
        """The harness returned (or failed): the episode ends at this moment. A request of its still
        queued or being answered is refused, and no turn is played after it (`next_event` returns the end)."""
        with self.lock:
            self.outcome, self.ended = ended, self.ended or "its harness returned"
            request = self.in_flight
        if request is not None:
            why = f"this episode has ended ({self.ended}) before this request was answered"
            self._refuse(request, Refused(410, why, "episode_ended"))
        self.inbox.put(ended)  # wakes `next_event`

    def next_event(self, timeout: float | None) -> Turn | HarnessEnded:
        """The harness's next request, read (requests the endpoint refuses are answered here and
        counted), or its end, which comes first once the harness returned. Raises TimeoutError
        after `timeout` seconds with neither."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self.lock:
                if self.outcome is not None:
                    return self.outcome
            try:
                event = self.inbox.get(timeout=None if deadline is None else max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"the harness neither sent a request nor ended within {timeout:g} s") from None
            if isinstance(event, HarnessEnded) or event.answer.done():  # the end, or a request it refused
                continue
            try:
                return self._read(event)
            except Refused as refused:
                self._refuse(event, refused)

    def _read(self, request: Request) -> Turn:
        body = checked_body(request.body, self.limits)
        if self.turns >= self.limits.max_turns:
            raise Refused(400, f"this episode's turns ran out (environment.max_turns = {self.limits.max_turns}): end the episode",
                          "max_turns")
        messages = normalized(body["messages"])
        tools = list(body.get("tools") or [])
        if self.turns and tools != self.tools:
            raise Refused(400, "'tools' differ from the episode's first request: the tools are fixed for an episode", "tools_changed")
        self.tools = tools
        self.answered.update(m["tool_call_id"] for m in messages if m["role"] == "tool" and m["tool_call_id"] in self.calls)
        known = len(self.conversation)
        extends = bool(known) and messages[:known] == self.conversation and len(messages) > known \
            and all(m["role"] != "assistant" for m in messages[known:])
        self.conversation = messages
        if known and not extends:
            self.rewrites += 1
        new = for_template(messages)[known:] if extends else None
        return Turn(messages=for_template(messages), tools=tools, new=new)

    def respond(self, reply: Reply, message: dict[str, Any],
                logprob_pieces: Callable[[], list[str]] | None = None) -> bool:
        """Answer the request in flight with the model's turn: `message` as the chat format recorded
        it (its content and the calls it read), the sampled ids and, when asked, their log-probs
        (`logprob_pieces` gives each id's text, called only then: a decode per id costs). False when
        the harness returned before the turn was answered: it never saw the turn, which is not the session's."""
        with self.lock:
            if self.outcome is not None:
                return False
            request, self.in_flight = self.in_flight, None
        self.turns += 1
        calls = [(f"call_{self.id}_{self.turns}_{i}", c["function"]["name"], c["function"]["arguments"])
                 for i, c in enumerate(message.get("tool_calls", ()))]
        self.calls.update(call_id for call_id, _, _ in calls)
        content = message.get("content") or ""
        wire: dict[str, Any] = {"role": "assistant", "content": content or (None if calls else "")}
        if calls:
            wire["tool_calls"] = [{"id": i, "type": "function", "function": {"name": n, "arguments": json.dumps(a)}} for i, n, a in calls]
        self.conversation = [*self.conversation, {"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})}]
        choice: dict[str, Any] = {"index": 0, "message": wire, "finish_reason": "tool_calls" if calls else "stop", "logprobs": None,
                                  "token_ids": list(reply.ids), "weights_version": reply.weights_version,
                                  "tool_call_error": reply.parse_error}
        if request is not None and request.body.get("logprobs") and logprob_pieces is not None:
            choice["logprobs"] = {"content": [{"token": piece, "logprob": lp, "bytes": list(piece.encode()), "top_logprobs": []}
                                              for piece, lp in zip(logprob_pieces(), reply.logprobs)]}
        usage = {"prompt_tokens": reply.prompt_tokens, "completion_tokens": len(reply.ids), "total_tokens": reply.prompt_tokens + len(reply.ids)}
        body = {"id": f"chatcmpl-{self.id}-{self.turns}", "object": "chat.completion", "created": int(time.time()),
                "model": self.limits.model, "choices": [choice], "usage": usage}
        if request is not None:
            request.settle(200, body)
        return True

    def end(self, why: str) -> None:
        """No request is taken any more; one in flight is answered with an error."""
        with self.lock:
            self.ended = self.ended or why
            request = self.in_flight
        if request is not None:
            self._refuse(request, Refused(410, f"this episode has ended ({self.ended})", "episode_ended"))
        while True:  # requests queued but never taken
            try:
                event = self.inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(event, Request):
                event.settle(*_refusal(Refused(410, f"this episode has ended ({self.ended})", "episode_ended")))
        self.endpoint.forget(self)

    def returned(self, timeout: float | None) -> HarnessEnded | None:
        """After `end`: the harness's return, waited for up to `timeout` seconds (None when it did not
        come). No request is taken after the end (`submit` refuses it), so only the return can come."""
        try:
            event = self.next_event(timeout)
        except TimeoutError:
            return None
        return event if isinstance(event, HarnessEnded) else None

    def _refuse(self, request: Request, refused: Refused) -> None:
        """Refuse the request in flight, counted once (the harness's end and the episode may race to answer it)."""
        with self.lock:
            if self.in_flight is not request:
                return
            self.in_flight = None
            self.refused += 1
        request.settle(*_refusal(refused))


def _refusal(refused: Refused) -> tuple[int, dict[str, Any]]:
    return refused.status, refused.body()


class Endpoint:
    """The process's server (uvicorn, Starlette) on a free loopback port, and its open sessions."""

    def __init__(self):
        self.sessions: dict[str, Session] = {}
        self.ended: dict[str, str] = {}  # ids of sessions that ended -> why, so a late request reads why
        self.lock = threading.Lock()
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # else each answer waits ~40 ms on a delayed ACK
        listener.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        self._serve(listener)

    def open(self, limits: Limits) -> Session:
        session = Session(self, limits)
        with self.lock:
            self.sessions[session.id] = session
        return session

    def forget(self, session: Session) -> None:
        with self.lock:
            self.sessions.pop(session.id, None)
            self.ended[session.id] = session.ended or "ended"
            if len(self.ended) > ENDED_KEPT:  # the oldest: a request that late reads "unknown session"
                del self.ended[next(iter(self.ended))]

    def _session(self, session_id: str, authorization: str | None) -> Session:
        with self.lock:
            session, ended = self.sessions.get(session_id), self.ended.get(session_id)
        if session is None:
            if ended:
                raise Refused(410, f"this episode has ended ({ended}); no request is taken after its end", "episode_ended")
            raise Refused(404, f"no episode has the session {session_id!r}: use the base URL the episode was given", "unknown_session")
        if authorization != f"Bearer {session.key}":
            raise Refused(401, "the API key is not this session's: use the key the episode was given (OPENAI_API_KEY)", "invalid_api_key")
        return session

    def _serve(self, listener: socket.socket) -> None:
        import uvicorn
        from starlette.applications import Starlette
        from starlette.responses import JSONResponse, StreamingResponse
        from starlette.routing import Route

        async def models(http):
            try:
                session = self._session(http.path_params["session_id"], http.headers.get("authorization"))
            except Refused as refused:
                return JSONResponse(refused.body(), status_code=refused.status)
            return JSONResponse({"object": "list", "data": [{"id": session.limits.model, "object": "model", "created": 0,
                                                             "owned_by": "rlkit"}]})

        async def chat_completions(http):
            try:
                session = self._session(http.path_params["session_id"], http.headers.get("authorization"))
                try:
                    body = await http.json()
                except ValueError:
                    raise Refused(400, "the request body is not JSON", "invalid_request") from None
            except Refused as refused:
                return JSONResponse(refused.body(), status_code=refused.status)
            try:
                checked_body(body, session.limits)  # what can be refused before the episode reads it
            except Refused as refused:
                with session.lock:
                    session.refused += 1
                return JSONResponse(refused.body(), status_code=refused.status)
            request = Request(body)
            session.submit(request)
            status, answer = await asyncio.wrap_future(request.answer)
            if status != 200 or not body.get("stream"):
                return JSONResponse(answer, status_code=status)
            usage = bool((body.get("stream_options") or {}).get("include_usage"))
            events = [f"data: {json.dumps(chunk)}\n\n" for chunk in as_chunks(answer, usage)] + ["data: [DONE]\n\n"]
            return StreamingResponse(iter(events), media_type="text/event-stream")

        app = Starlette(routes=[Route("/sessions/{session_id}/v1/models", models, methods=["GET"]),
                                Route("/sessions/{session_id}/v1/chat/completions", chat_completions, methods=["POST"])])
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off",
                                                timeout_keep_alive=KEEP_ALIVE_S))
        thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True, name="rlkit-endpoint")
        thread.start()
        while not server.started:
            if not thread.is_alive():
                raise RuntimeError(f"the agent endpoint's server did not start on {self.url}; its error is printed above")
            time.sleep(0.01)


_ENDPOINT: Endpoint | None = None
_STARTING = threading.Lock()


def agent_endpoint() -> Endpoint:
    """This process's endpoint, started on first use."""
    global _ENDPOINT
    with _STARTING:
        if _ENDPOINT is None:
            _ENDPOINT = Endpoint()
        return _ENDPOINT
