"""Agents for the tests of the `agent` environment, written against the `openai` package as a user
writes theirs: each is called with a prompt record and a client (or run as a program: `python
agent_harnesses.py <name>`, which reads the endpoint from the environment as `OpenAI()` does).

The probes of bad input make a good request first (the episode opens on it), then the bad one, and
return a reward of 1 only when the endpoint refused it as it should, with the code it should."""

from __future__ import annotations

import itertools
import json
import os
import sys
import threading
import time
from urllib.parse import urlsplit

import openai
from openai import OpenAI

LOOKUP = {"type": "function", "function": {"name": "lookup", "description": "Look a word up.",
                                           "parameters": {"type": "object", "properties": {"word": {"type": "string"}},
                                                          "required": ["word"]}}}


def ask(client: OpenAI, messages: list, **fields):
    return client.chat.completions.create(model="policy", messages=messages, **fields).choices[0].message


def talk(record: dict, client: OpenAI, turns: int = 3) -> dict:
    """Says 'again' after each of the model's turns, keeping the conversation as the endpoint returned it;
    reports the first answer's `usage.prompt_tokens` and the last one's `usage.total_tokens`."""
    messages, usage = [{"role": "user", "content": record["prompt"]}], []
    for turn in range(turns):
        if turn:
            messages.append({"role": "user", "content": "again"})
        completion = client.chat.completions.create(model="policy", messages=messages)
        usage.append(completion.usage)
        messages.append(completion.choices[0].message.model_dump(exclude_none=True))
    return {"reward": 1.0, "talked": float(turns), "opening_tokens": float(usage[0].prompt_tokens), "last_total_tokens": float(usage[-1].total_tokens)}


TOLD = threading.Lock()


def talk_and_tell(record: dict, client: OpenAI, turns: int = 3) -> dict:
    """`talk`, telling what it saw: a JSON line per episode, appended to `<RLKIT_TEST_AGENT_LOG>/<pid>.jsonl`
    when that variable names a folder (the process, its RANK, the endpoint's port, the session, each
    answer's id, content and token ids). `own_answers` is 1 when every answer came from its own
    session, in order (`chatcmpl-<session>-<turn>`): no answer meant for another episode reached it."""
    base = urlsplit(str(client.base_url))
    session = base.path.split("/sessions/")[1].split("/")[0]
    messages: list = [{"role": "user", "content": record["prompt"]}]
    answers = []
    for turn in range(1, turns + 1):
        completion = client.chat.completions.create(model="policy", messages=messages)
        choice = completion.choices[0]
        answers.append({"id": completion.id, "content": choice.message.content, "token_ids": (choice.model_extra or {}).get("token_ids")})
        messages.append(choice.message.model_dump(exclude_none=True))
        if turn < turns:
            messages.append({"role": "user", "content": "again"})
    own = all(a["id"] == f"chatcmpl-{session}-{turn}" for turn, a in enumerate(answers, 1))
    folder = os.environ.get("RLKIT_TEST_AGENT_LOG")
    if folder:
        told = {"pid": os.getpid(), "parent": os.getppid(), "rank": os.environ.get("RANK"), "port": base.port, "session": session,
                "prompt": record["prompt"], "answers": answers}
        with TOLD, open(os.path.join(folder, f"{os.getpid()}.jsonl"), "a") as out:
            out.write(json.dumps(told) + "\n")
    return {"reward": 1.0, "talked": float(len(answers)), "own_answers": float(own)}


def forgetful(record: dict, client: OpenAI) -> float:
    """Drops the model's turn from the history before asking again: the history changed."""
    first = [{"role": "user", "content": record["prompt"]}]
    ask(client, first)
    ask(client, [*first, {"role": "user", "content": "again"}])
    return 0.5


def summarises(record: dict, client: OpenAI) -> float:
    """Keeps the conversation as returned for its second request, then sends a summary in place of
    the history: one change of history in two later turns."""
    messages = [{"role": "user", "content": record["prompt"]}]
    messages += [ask(client, messages).model_dump(exclude_none=True), {"role": "user", "content": "again"}]
    ask(client, messages)
    ask(client, [{"role": "user", "content": "two guesses so far; again"}])
    return 1.0


def tool_user(record: dict, client: OpenAI) -> float:
    """Answers every tool call the model makes by its id, until the model answers without one."""
    messages = [{"role": "user", "content": record["prompt"]}]
    while True:
        message = ask(client, messages, tools=[LOOKUP])
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return 1.0
        messages += [{"role": "tool", "tool_call_id": call.id, "content": "found"} for call in message.tool_calls]


def refused(call, code: str) -> bool:
    try:
        call()
    except openai.APIStatusError as error:
        return error.body is not None and error.body.get("code") == code
    return False


def wrong_tool_id(record: dict, client: OpenAI) -> float:
    messages = [{"role": "user", "content": record["prompt"]}]
    message = ask(client, messages, tools=[LOOKUP])
    bad = [*messages, message.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": "call_nobody_made", "content": "x"}]
    return float(refused(lambda: ask(client, bad, tools=[LOOKUP]), "unknown_tool_call_id"))


def hot(record: dict, client: OpenAI) -> float:
    messages = [{"role": "user", "content": record["prompt"]}]
    message = ask(client, messages)
    later = [*messages, message.model_dump(exclude_none=True), {"role": "user", "content": "again"}]
    return float(refused(lambda: ask(client, later, temperature=0.3), "invalid_temperature"))


def stranger(record: dict, client: OpenAI) -> float:
    """Uses a key that is not its session's, then a session that does not exist."""
    ask(client, [{"role": "user", "content": record["prompt"]}])
    other = OpenAI(base_url=str(client.base_url), api_key="rlkit-not-mine", max_retries=0)
    elsewhere = OpenAI(base_url=str(client.base_url).replace("/sessions/", "/sessions/x"), api_key=client.api_key, max_retries=0)
    message = [{"role": "user", "content": "hi"}]
    return float(refused(lambda: ask(other, message), "invalid_api_key") and refused(lambda: ask(elsewhere, message), "unknown_session"))


def too_many(record: dict, client: OpenAI) -> dict:
    """Keeps asking until the endpoint refuses: the episode's turns ran out."""
    messages = [{"role": "user", "content": record["prompt"]}]
    for asked in range(1, 20):
        try:
            messages += [ask(client, messages).model_dump(exclude_none=True), {"role": "user", "content": "again"}]
        except openai.BadRequestError as error:
            return {"reward": float(error.body.get("code") == "max_turns"), "answered": float(asked - 1)}
    return {"reward": 0.0, "answered": 19.0}


RETURNED: list[threading.Thread] = []  # the threads of the harnesses below that return while a request waits
LEFT: list[tuple[threading.Thread, list[str]]] = []  # each request they left waiting, and how it was answered


def leaves_a_request(client: OpenAI, messages: list) -> None:
    """Sends `messages` from a thread of its own, and returns once the episode has taken the request
    (not yet answered): the harness returns while its turn is sampled."""
    from rlkit_core.endpoint import agent_endpoint

    RETURNED.append(threading.current_thread())
    answers: list[str] = []

    def send():
        try:
            ask(client, messages)
            answers.append("answered")
        except openai.APIStatusError as error:
            answers.append(str((error.body or {}).get("code")))

    thread = threading.Thread(target=send, daemon=True)
    session = agent_endpoint().sessions[str(client.base_url).split("/sessions/")[1].split("/")[0]]
    asked = session.requests
    thread.start()
    LEFT.append((thread, answers))
    while session.requests == asked or not session.inbox.empty():
        time.sleep(0.001)


def returns_while_asking(record: dict, client: OpenAI, anew: bool = False) -> float:
    """Reads the model's first turn, then returns while its second request is answered: the
    conversation as returned, or (`anew`) without the model's turn, which starts a new sample."""
    messages = [{"role": "user", "content": record["prompt"]}]
    first = ask(client, messages).model_dump(exclude_none=True)
    leaves_a_request(client, [*messages, *([] if anew else [first]), {"role": "user", "content": "again"}])
    return 1.0


def returns_while_asking_anew(record: dict, client: OpenAI) -> float:
    return returns_while_asking(record, client, anew=True)


def returns_before_its_first_answer(record: dict, client: OpenAI) -> float:
    leaves_a_request(client, [{"role": "user", "content": record["prompt"]}])
    return 1.0


NEUTRAL = {"temperature": 1.0, "top_p": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0, "logit_bias": {},
           "seed": 7, "user": "someone", "metadata": {"run": "a"}, "store": False, "parallel_tool_calls": True,
           "logprobs": True, "top_logprobs": 0, "response_format": {"type": "text"}, "n": None, "stop": None,
           "extra_body": {"top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0}}


def neutral(record: dict, client: OpenAI) -> float:
    """Two turns asked with every setting at the value that changes nothing (top_k 0 and -1 alike,
    `n` and `stop` sent as null, as left out)."""
    messages = [{"role": "user", "content": record["prompt"]}]
    messages += [ask(client, messages, **NEUTRAL).model_dump(exclude_none=True), {"role": "user", "content": "again"}]
    ask(client, messages, **{**NEUTRAL, "extra_body": {"top_k": 0}})
    return 1.0


def raises(record: dict, client: OpenAI) -> float:
    ask(client, [{"role": "user", "content": record["prompt"]}])
    raise ValueError("the harness broke")


def hangs(record: dict, client: OpenAI) -> float:
    ask(client, [{"role": "user", "content": record["prompt"]}])
    time.sleep(30)
    return 1.0


HELD = threading.Event()  # released by the test that holds `held`'s threads


def held(record: dict, client: OpenAI) -> float:
    """Asks once, then waits (up to a minute) for the test to release it, whatever the endpoint says: a callable that
    outlives its episode."""
    ask(client, [{"role": "user", "content": record["prompt"]}])
    HELD.wait(60)
    return 1.0


def no_reward(record: dict, client: OpenAI):
    ask(client, [{"role": "user", "content": record["prompt"]}])
    return None


def never_asks(record: dict, client: OpenAI) -> float:
    return 1.0


def reports(record: dict, client: OpenAI) -> dict:
    """Asks once, then returns a reward of 1 and the record's `figures` as they are (text, NaN, a bool, ...)."""
    ask(client, [{"role": "user", "content": record["prompt"]}])
    return {"reward": 1.0, **record["figures"]}


def reports_when_ended(record: dict, client: OpenAI) -> dict:
    """`talk`; when the episode is ended under it (the endpoint answers `episode_ended`) it returns all
    the same: `told_ended` 1, the record's `figures`, and a reward of 5 that the ended episode must not take."""
    try:
        talk(record, client)
    except openai.APIStatusError as error:
        if error.status_code != 410 or error.body.get("code") != "episode_ended":
            raise
        return {"reward": 5.0, "told_ended": 1.0, **record.get("figures", {})}
    return {"reward": 1.0, "told_ended": 0.0}


def hangs_when_ended(record: dict, client: OpenAI) -> dict:
    """`talk`; when the episode is ended under it, it returns its figures only after 30 s."""
    try:
        talk(record, client)
    except openai.APIStatusError:
        time.sleep(30)
        return {"reward": 5.0, "told_ended": 1.0}
    return {"reward": 1.0, "told_ended": 0.0}


EPISODES = itertools.count()  # the episodes this process's agents played


def reports_by_rank(record: dict, client: OpenAI) -> dict:
    """Asks once (a turn cut off is answered `episode_ended`, and it returns all the same). Under
    torchrun, on RANK 0 every episode reports `figure` = 1; on another, one episode in four reports it, as 0."""
    try:
        ask(client, [{"role": "user", "content": record["prompt"]}])
    except openai.APIStatusError:
        pass
    if os.environ.get("RANK", "0") == "0":
        return {"reward": 1.0, "figure": 1.0}
    return {"reward": 1.0, **({"figure": 0.0} if next(EPISODES) % 4 == 0 else {})}


if __name__ == "__main__":
    name = sys.argv[1]
    if name == "exits":
        ask(OpenAI(max_retries=0), [{"role": "user", "content": "hi"}])
        sys.exit(3)
    if name == "silent":
        ask(OpenAI(max_retries=0), [{"role": "user", "content": json.loads(os.environ["RLKIT_RECORD"])["prompt"]}])
        sys.exit(0)
    if name == "slow_start":  # `talk`, its first request RLKIT_TEST_START_S seconds after its imports: when, told in RLKIT_TEST_AGENT_LOG
        launched = time.time()
        time.sleep(float(os.environ["RLKIT_TEST_START_S"]))
        if os.environ.get("RLKIT_TEST_AGENT_LOG"):
            with open(os.path.join(os.environ["RLKIT_TEST_AGENT_LOG"], f"{os.getpid()}.start"), "w") as out:
                out.write(json.dumps({"launched": launched, "asked": time.time()}))
        name = "talk"
    record = json.loads(sys.stdin.read())
    print("some chatter first")
    print(json.dumps(globals()[name](record, OpenAI(max_retries=0))))


def versions(record: dict, client: OpenAI) -> dict:
    """`talk`, reporting the weights version each answer says sampled it: the first, and 1 when all agree."""
    messages, seen = [{"role": "user", "content": record["prompt"]}], []
    for turn in range(3):
        if turn:
            messages.append({"role": "user", "content": "again"})
        completion = client.chat.completions.create(model="policy", messages=messages)
        seen.append((completion.choices[0].model_extra or {})["weights_version"])
        messages.append(completion.choices[0].message.model_dump(exclude_none=True))
    return {"reward": 1.0, "weights_version": float(seen[0]), "one_version": float(len(set(seen)) == 1)}


def streamed(client: OpenAI, messages: list, **fields) -> dict:
    """One answer asked with `stream=True`, put together from its chunks as an agent that streams does:
    the assistant message to send back, and the extension fields of the last chunk."""
    content, calls, extra = "", {}, {}
    for chunk in client.chat.completions.create(model="policy", messages=messages, stream=True, stream_options={"include_usage": True}, **fields):
        if chunk.usage is not None:
            extra["usage"] = chunk.usage
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for call in choice.delta.tool_calls or ():
                entry = calls.setdefault(call.index, {"id": call.id, "type": "function", "function": {"name": "", "arguments": ""}})
                entry["function"]["name"] += (call.function and call.function.name) or ""
                entry["function"]["arguments"] += (call.function and call.function.arguments) or ""
            if choice.finish_reason:
                extra.update({"finish_reason": choice.finish_reason, **(choice.model_extra or {})})
    message = {"role": "assistant", "content": content or None, **({"tool_calls": [calls[i] for i in sorted(calls)]} if calls else {})}
    return {"message": message, **extra}


def talk_streaming(record: dict, client: OpenAI, turns: int = 3) -> dict:
    """`talk`, every answer streamed; `streamed_ids` is 1 when each answer's last chunk carried its sampled ids."""
    messages, with_ids, usage = [{"role": "user", "content": record["prompt"]}], [], []
    for turn in range(turns):
        if turn:
            messages.append({"role": "user", "content": "again"})
        answer = streamed(client, messages)
        messages.append(answer["message"])
        with_ids.append(bool(answer.get("token_ids")) and answer["finish_reason"] == "stop")
        usage.append(answer["usage"])
    return {"reward": 1.0, "talked": float(turns), "streamed_ids": float(all(with_ids)), "opening_tokens": float(usage[0].prompt_tokens),
            "last_total_tokens": float(usage[-1].total_tokens)}


def tool_user_streaming(record: dict, client: OpenAI) -> float:
    """`tool_user`, every answer streamed."""
    messages = [{"role": "user", "content": record["prompt"]}]
    while True:
        answer = streamed(client, messages, tools=[LOOKUP])
        messages.append(answer["message"])
        if not answer["message"].get("tool_calls"):
            return 1.0
        messages += [{"role": "tool", "tool_call_id": call["id"], "content": "found"} for call in answer["message"]["tool_calls"]]


def talk_with_logprobs(record: dict, client: OpenAI) -> dict:
    """Two turns asked with `logprobs=True`: `logprobs_ok` is 1 when every answer has one entry per
    sampled id, its pieces spell the content (then the end token's text), and `logprob_sum` adds them all."""
    messages, ok, total = [{"role": "user", "content": record["prompt"]}], [], 0.0
    for turn in range(2):
        if turn:
            messages.append({"role": "user", "content": "again"})
        choice = client.chat.completions.create(model="policy", messages=messages, logprobs=True).choices[0]
        entries = choice.logprobs.content if choice.logprobs else []
        spelled = "".join(entry.token for entry in entries)
        ok.append(len(entries) == len((choice.model_extra or {})["token_ids"]) and spelled.startswith(choice.message.content or "")
                  and all(bytes(entry.bytes or []).decode() == entry.token for entry in entries))
        total += sum(entry.logprob for entry in entries)
        messages.append(choice.message.model_dump(exclude_none=True))
    return {"reward": 1.0, "logprobs_ok": float(all(ok)), "logprob_sum": total}


def tells_unreadable_calls(record: dict, client: OpenAI, stream: bool = False) -> dict:
    """`tool_user`, telling the model when its call could not be read (`tool_call_error`), as the
    in-process environment does, in a user message (such a call has no id to answer). `told`: the
    answers that carried an error; `errors_only_there`: 1 when every other answer's field was null."""
    messages: list = [{"role": "user", "content": record["prompt"]}]
    errors = []
    while True:
        if stream:
            answer = streamed(client, messages, tools=[LOOKUP])
            message, error = answer["message"], answer.get("tool_call_error")
        else:
            choice = client.chat.completions.create(model="policy", messages=messages, tools=[LOOKUP]).choices[0]
            message, error = choice.message.model_dump(exclude_none=True), (choice.model_extra or {})["tool_call_error"]
        messages.append(message)
        errors.append(error)
        if error:
            messages.append({"role": "user", "content": f"Error: your tool call could not be read: {error}. Again."})
        elif message.get("tool_calls"):
            messages += [{"role": "tool", "tool_call_id": c["id"], "content": "found"} for c in message["tool_calls"]]
        else:
            told = sum(bool(e) for e in errors)
            only_there = errors.count(None) + told == len(errors)
            return {"reward": 1.0, "told": float(told), "errors_only_there": float(only_there)}


def tells_unreadable_calls_streaming(record: dict, client: OpenAI) -> dict:
    return tells_unreadable_calls(record, client, stream=True)
