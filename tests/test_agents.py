"""The `agent` environment and its endpoint (`rlkit_core.endpoint`): an agent written against the
`openai` package (tests/agent_harnesses.py), in this process or as a program of its own, plays
episodes through a real HTTP server; the training rows are the ids the model sampled and the chat
template rendered, decided by ids, never re-encoded; a harness that changed history starts a new
sample, counted; every bad request is an HTTP error the harness reads, and every failure of a
harness is an episode status, never a reward of 0."""

from __future__ import annotations

import json
import math
import re
import sys
import time
from pathlib import Path

import attrs
import pytest
import torch

from tests.test_episodes import Scripted, render_ids
from tests.test_trainer import make_trainer, rollout_with

openai = pytest.importorskip("openai")

HARNESSES = Path(__file__).parent / "agent_harnesses.py"
PROMPT = "Guess my number, 1-16."
TIMED_OUT = "the environment's step timed out: the harness neither sent a request nor ended within 1.9 s (environment.step_timeout_s = 2 s)"


def turn_ids(tokenizer, text: str, end: bool = True) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"] + ([tokenizer.convert_tokens_to_ids("<|im_end|>")] if end else [])


def agent_trainer(document, registry, model, tokenizer, turns: list[list[int]], **environment):
    """A trainer whose episodes are played by an agent, the model's turns `turns` in order (the same
    for every episode), so that what the rows must hold is known to the token."""
    document["policy"]["model"] = str(model)
    document.pop("reward")
    document["generator"]["max_new_tokens"] = 12
    document["environment"] = {"type": "agent", "max_turns": 3, "max_episode_tokens": 200, "step_timeout_s": 60.0, **environment}
    document["data"] = {"type": "guess-number-games", "size": 64, "seed": 0}
    trainer = make_trainer(document, registry)
    trainer.components = attrs.evolve(trainer.components, generator=Scripted(turns, tokenizer.pad_token_id))
    return trainer


def harness(name: str) -> dict:
    return {"harness": f"tests.agent_harnesses:{name}"}


def command(name: str) -> dict:
    return {"command": [sys.executable, str(HARNESSES), name]}


def rows_of(batch) -> list[list[int]]:
    return [torch.cat([batch.prompt_ids[i][batch.prompt_mask[i].bool()], batch.response_ids[i][batch.response_mask[i].bool()]]).tolist()
            for i in range(len(batch))]


def sampled_of(batch) -> list[list[int]]:
    return [row[~torch.isnan(batch.sampled_logprobs[i]) & batch.loss_mask[i].bool()].tolist() for i, row in enumerate(batch.response_ids)]


RECORDS = [{"prompt": PROMPT, "secret": 3}] * 2


@pytest.mark.parametrize("how", [harness("talk"), command("talk"), {**harness("talk"), "turn_barrier": False}, harness("talk_streaming")],
                         ids=["callable", "command", "callable-as-ready", "streaming"])
def test_an_agents_episode_is_the_templates_render_of_its_conversation(recipe_document, builtin_registry, chatml, how):
    """Three turns of a harness that keeps the conversation as the endpoint returned it: one sample,
    equal to the template's render of the whole conversation at once (but for the newline the
    template puts after the last end token); only the model's ids are sampled; the harness's reward
    and figures are the episode's."""
    path, tokenizer = chatml
    turn = turn_ids(tokenizer, "7")
    trainer = agent_trainer(recipe_document, builtin_registry, path, tokenizer, [turn], **how)
    batch, metrics = rollout_with(trainer, RECORDS)
    conversation = [{"role": "user", "content": PROMPT}]
    for _ in range(2):
        conversation += [{"role": "assistant", "content": "7"}, {"role": "user", "content": "again"}]
    conversation.append({"role": "assistant", "content": "7"})
    assert (metrics["env/status_ok"], metrics["env/splits"], metrics["env/agent_rewrites"], metrics["env/turns"]) == (1.0, 0.0, 0.0, 3.0)
    assert metrics["env/reward"] == 1.0 and metrics["env/talked"] == 3.0 and metrics["env/agent_requests"] == 3.0
    assert metrics.get("env/streamed_ids", 1.0) == 1.0  # a streaming agent read the sampled ids from the last chunk
    # `usage`: the first turn was given the opening prompt; the last answer's total is the whole stream
    assert (metrics["env/opening_tokens"], metrics["env/last_total_tokens"]) == (batch.prompt_mask[0].sum().item(), len(rows_of(batch)[0]))
    assert rows_of(batch)[0] == render_ids(tokenizer, conversation)[:-1]
    assert sampled_of(batch) == [turn * 3] * 2
    assert batch.scores.tolist() == [1.0, 1.0]


def test_a_template_that_drops_earlier_thinking_splits_the_agents_episode_where_the_harness_did_not(recipe_document, builtin_registry,
                                                                                                     chatml):
    """The harness keeps every turn as returned, think block and all; the template strips the
    earlier turns' think blocks, so the stream is no prefix of the next render: each later turn
    starts a sample of its own (env/splits), and the harness is not counted as rewriting."""
    path, tokenizer = chatml
    turn = turn_ids(tokenizer, "<think>hm</think>7")
    trainer = agent_trainer(recipe_document, builtin_registry, path, tokenizer, [turn], **harness("talk"))
    batch, metrics = rollout_with(trainer, RECORDS)
    assert (metrics["env/splits"], metrics["env/agent_rewrites"], len(batch)) == (2.0, 0.0, 6)
    conversation = [{"role": "user", "content": PROMPT}]
    for sample in rows_of(batch)[:3]:
        assert sample == render_ids(tokenizer, conversation, generation_prompt=True) + turn
        conversation += [{"role": "assistant", "content": "<think>hm</think>7"}, {"role": "user", "content": "again"}]


def test_a_harness_that_changes_history_starts_a_new_sample_from_its_conversation(recipe_document, builtin_registry, chatml):
    path, tokenizer = chatml
    turn = turn_ids(tokenizer, "7")
    trainer = agent_trainer(recipe_document, builtin_registry, path, tokenizer, [turn], **harness("forgetful"))
    batch, metrics = rollout_with(trainer, RECORDS)
    assert (metrics["env/splits"], metrics["env/agent_rewrites"], metrics["env/reward"], len(batch)) == (1.0, 1.0, 0.5, 4)
    first, second = rows_of(batch)[:2]
    assert first == render_ids(tokenizer, [{"role": "user", "content": PROMPT}], generation_prompt=True) + turn
    assert second == render_ids(tokenizer, [{"role": "user", "content": PROMPT}, {"role": "user", "content": "again"}],
                                generation_prompt=True) + turn
    assert batch.episode_ids.tolist() == [0, 0, 1, 1] and batch.scores.tolist() == [0.5] * 4  # one episode, one score


@pytest.mark.parametrize("name", ["tool_user", "tool_user_streaming"])
def test_tool_calls_go_out_with_ids_and_their_results_come_back_rendered(recipe_document, builtin_registry, chatml, name):
    """The model's call (read by the template's tool-call format) reaches the harness as an OpenAI
    tool call with an id; the harness's result, sent by that id, is rendered as the template renders
    a tool result of that tool: the episode is the render of the conversation with its tools."""
    path, tokenizer = chatml
    call = turn_ids(tokenizer, '<tool_call>\n{"name": "lookup", "arguments": {"word": "fig"}}\n</tool_call>')
    answer = turn_ids(tokenizer, "done")
    trainer = agent_trainer(recipe_document, builtin_registry, path, tokenizer, [call, answer], **harness(name))
    batch, metrics = rollout_with(trainer, RECORDS)
    from tests.agent_harnesses import LOOKUP

    conversation = [{"role": "user", "content": PROMPT},
                    {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "lookup",
                                                                                                          "arguments": {"word": "fig"}}}]},
                    {"role": "tool", "name": "lookup", "content": "found"}, {"role": "assistant", "content": "done"}]
    text = tokenizer.apply_chat_template(conversation, tools=[LOOKUP], tokenize=False)
    assert (metrics["env/status_ok"], metrics["env/splits"], metrics["env/reward"]) == (1.0, 0.0, 1.0)
    assert rows_of(batch)[0] == tokenizer(text, add_special_tokens=False)["input_ids"][:-1]
    assert sampled_of(batch)[0] == call + answer


@pytest.mark.parametrize("name", ["tells_unreadable_calls", "tells_unreadable_calls_streaming"])
def test_an_unreadable_call_is_marked_for_the_harness_to_tell_it(recipe_document, builtin_registry, chatml, name):
    """A turn whose tool-call markup cannot be read is answered as text, with why in
    `choices[0].tool_call_error` (the stream's last chunk too): a harness that reads it tells the
    model and the episode goes on, as in the in-process environment; the turn is counted in
    env/unreadable_tool_calls."""
    path, tokenizer = chatml
    bad = turn_ids(tokenizer, '<tool_call>\n{"name": "lookup", "arguments": {"word": }\n</tool_call>')
    call = turn_ids(tokenizer, '<tool_call>\n{"name": "lookup", "arguments": {"word": "fig"}}\n</tool_call>')
    turns = [bad, call, turn_ids(tokenizer, "done")]
    trainer = agent_trainer(recipe_document, builtin_registry, path, tokenizer, turns, max_episode_tokens=800,
                            **harness(name))
    _, metrics = rollout_with(trainer, RECORDS)
    assert (metrics["env/status_ok"], metrics["env/turns"], metrics["env/reward"]) == (1.0, 3.0, 1.0)
    assert (metrics["env/told"], metrics["env/errors_only_there"]) == (1.0, 1.0)
    assert metrics["env/unreadable_tool_calls"] == 1.0
    assert (metrics["env/agent_tool_calls"], metrics["env/agent_tool_results"]) == (1.0, 1.0)


def test_each_answer_names_the_weights_that_sampled_it(recipe_document, builtin_registry, chatml):
    """`choices[0].weights_version`: the run's iterations done when the sampling weights were current,
    the same for every turn of an episode, one more after each update."""
    path, tokenizer = chatml
    trainer = agent_trainer(recipe_document, builtin_registry, path, tokenizer, [turn_ids(tokenizer, "7")], **harness("versions"))
    rows = [trainer.step() for _ in range(3)]
    assert [(row["env/weights_version"], row["env/one_version"], row["env/status_ok"]) for row in rows] == [(0.0, 1.0, 1.0), (1.0, 1.0, 1.0),
                                                                                                              (2.0, 1.0, 1.0)]


def test_log_probs_come_back_when_asked_one_per_sampled_id(recipe_document, builtin_registry, chatml):
    path, tokenizer = chatml
    turn = turn_ids(tokenizer, "7")
    trainer = agent_trainer(recipe_document, builtin_registry, path, tokenizer, [turn], **harness("talk_with_logprobs"))
    batch, metrics = rollout_with(trainer, RECORDS)
    assert metrics["env/logprobs_ok"] == 1.0 and len(turn) == 2
    assert metrics["env/logprob_sum"] == pytest.approx(-0.5 * 2 * len(turn))  # the scripted generator's -0.5 per sampled id
    sampled = batch.sampled_logprobs[0][batch.loss_mask[0].bool()]
    assert sampled.sum().item() == pytest.approx(metrics["env/logprob_sum"])


@pytest.mark.parametrize("name", ["wrong_tool_id", "hot", "stranger", "too_many"])
def test_every_bad_request_is_an_http_error_the_harness_reads_and_the_episode_goes_on(recipe_document, builtin_registry, chatml, name):
    """A tool result for a call nobody made, a temperature not the run's, another session's key or
    a session that does not exist, a request past max_turns: each refused with its code (the probe
    returns 1 only when it read that code), counted, and the episode ends as the harness ends it."""
    path, tokenizer = chatml
    call = turn_ids(tokenizer, '<tool_call>\n{"name": "lookup", "arguments": {"word": "fig"}}\n</tool_call>')
    turns = [call] if name == "wrong_tool_id" else [turn_ids(tokenizer, "7")]
    trainer = agent_trainer(recipe_document, builtin_registry, path, tokenizer, turns, **harness(name))
    _, metrics = rollout_with(trainer, RECORDS)
    assert (metrics["env/status_ok"], metrics["env/reward"]) == (1.0, 1.0)
    if name == "too_many":
        assert (metrics["env/answered"], metrics["env/agent_refused"]) == (3.0, 1.0)
    elif name != "stranger":  # refused before its session read it (another key, no such session): counted by nobody's episode
        assert metrics["env/agent_refused"] == 1.0


@pytest.mark.parametrize(("how", "status", "said"), [
    (harness("raises"), "error", "raised ValueError: the harness broke"),
    (harness("no_reward"), "error", "ended with None: a finite reward"),
    (harness("never_asks"), "error", "ended before its first request"),
    (harness("hangs"), "timeout", TIMED_OUT),
    (command("exits"), "error", "exited with status 3"),
    (command("silent"), "error", "printed no reward"),
    (command("hangs"), "timeout", TIMED_OUT),
], ids=["raises", "no-reward", "never-asks", "hangs", "exits-non-zero", "prints-nothing", "command-hangs"])
def test_every_failure_of_a_harness_is_a_status_never_a_score(recipe_document, builtin_registry, chatml, how, status, said):
    """Each said in a warning, with its reason: a timeout names the limit it ran past."""
    from rlkit_core.runtime.episodes import EnvironmentFault

    path, tokenizer = chatml
    wait = 2.0 if status == "timeout" else 60.0  # a step's limit: the command's start has its own (start_timeout_s)
    trainer = agent_trainer(recipe_document, builtin_registry, path, tokenizer, [turn_ids(tokenizer, "7")], step_timeout_s=wait, **how)
    with pytest.warns(EnvironmentFault, match=re.escape(said)):
        batch, metrics = rollout_with(trainer, RECORDS)
    assert metrics[f"env/status_{status}"] == 1.0
    assert int(batch.loss_mask.sum()) == 0  # nothing trained from it


def test_a_commands_start_has_a_budget_of_its_own_and_starts_take_turns(recipe_document, builtin_registry, chatml, tmp_path, monkeypatch):
    """Each command sends its first request 2 s after its imports, past step_timeout_s = 1.5 s and
    within start_timeout_s: every episode plays. With max_starting = 1, each is launched once the
    one before has sent its first request."""
    monkeypatch.setenv("RLKIT_TEST_START_S", "2")
    monkeypatch.setenv("RLKIT_TEST_AGENT_LOG", str(tmp_path))
    path, tokenizer = chatml
    trainer = agent_trainer(recipe_document, builtin_registry, path, tokenizer, [turn_ids(tokenizer, "7")], step_timeout_s=1.5,
                            start_timeout_s=60.0, max_starting=1, **command("slow_start"))
    _, metrics = rollout_with(trainer, RECORDS)
    assert metrics["env/status_ok"] == 1.0 and metrics["env/talked"] == 3.0
    first, second = sorted((json.loads(f.read_text()) for f in tmp_path.glob("*.start")), key=lambda start: start["launched"])
    assert second["launched"] > first["asked"]


def test_a_command_that_does_not_start_in_time_is_a_timeout_that_names_the_start_budget(recipe_document, builtin_registry, chatml,
                                                                                        monkeypatch):
    from rlkit_core.runtime.episodes import EnvironmentFault

    monkeypatch.setenv("RLKIT_TEST_START_S", "30")
    path, tokenizer = chatml
    trainer = agent_trainer(recipe_document, builtin_registry, path, tokenizer, [turn_ids(tokenizer, "7")], start_timeout_s=1.0,
                            max_starting=2, **command("slow_start"))
    with pytest.warns(EnvironmentFault, match=re.escape("the environment's reset timed out: the harness neither sent a request nor ended "
                                                        "within 1 s (environment.start_timeout_s = 1 s from the command's launch, with "
                                                        "up to environment.max_starting = 2 starting at once)")):
        _, metrics = rollout_with(trainer, RECORDS)
    assert metrics["env/status_timeout"] == 1.0


def test_a_callable_that_outlives_its_episode_is_a_hung_call_within_the_call_threads(recipe_document, builtin_registry, chatml):
    """`held` asks once, then waits for the test: each of its episodes times out, and its thread,
    still running, is counted in env/hung_calls and holds one of the two call threads, so that the
    next rollout cannot start and the run would stop. Released, they return their threads."""
    from rlkit_core.runtime.environment_calls import CallsHung, pool_for
    from rlkit_core.runtime.episodes import EnvironmentFault
    from tests.agent_harnesses import HELD

    path, tokenizer = chatml
    trainer = agent_trainer(recipe_document, builtin_registry, path, tokenizer, [turn_ids(tokenizer, "7")], step_timeout_s=1.0,
                            call_threads=2, **harness("held"))
    HELD.clear()
    try:
        with pytest.warns(EnvironmentFault, match=re.escape("the agent of 2 episode(s) that ended is still running")):
            _, metrics = rollout_with(trainer, RECORDS)
        assert (metrics["env/status_timeout"], metrics["env/hung_calls"]) == (1.0, 2.0)
        with pytest.raises(CallsHung, match=re.escape("every one of the environment's 2 call threads (environment.call_threads) is held by a "
                                                      "call that did not return within environment.step_timeout_s and is still running "
                                                      "(2 of them an agent still running after its episode ended)")):
            rollout_with(trainer, RECORDS)
    finally:
        HELD.set()
    pool = pool_for(trainer.components.environment, 2)
    deadline = time.monotonic() + 30
    while pool.hung and time.monotonic() < deadline:  # each returns its thread as it returns
        time.sleep(0.05)
    _, metrics = rollout_with(trainer, RECORDS)
    assert (metrics["env/status_ok"], metrics["env/hung_calls"]) == (1.0, 0.0)


class AfterTheHarnessReturned(Scripted):
    """Samples each turn only once every harness that is returning while it waits has returned
    (tests/agent_harnesses.py `leaves_a_request`): the race between a request and the harness's
    end, made certain."""

    def generate(self, prompt_ids, prompt_mask, greedy=False):
        from tests.agent_harnesses import RETURNED

        for thread in RETURNED:
            thread.join(timeout=60)
        return super().generate(prompt_ids, prompt_mask, greedy)


def racing_trainer(recipe_document, registry, chatml, name: str, **environment):
    """A trainer of the harness `name`, which returns while a request of its waits; the model says "7"."""
    path, tokenizer = chatml
    turn = turn_ids(tokenizer, "7")
    trainer = agent_trainer(recipe_document, registry, path, tokenizer, [turn], **harness(name), **environment)
    generator = AfterTheHarnessReturned([turn], tokenizer.pad_token_id)
    trainer.components = attrs.evolve(trainer.components, generator=generator)
    return trainer, turn


@pytest.mark.parametrize(("anew", "barrier"), [(False, True), (True, True), (False, False)],
                         ids=["extending", "new-sample", "extending-as-ready"])
def test_the_turn_a_harness_returned_before_seeing_is_not_trained(recipe_document, builtin_registry, chatml, anew,
                                                                   barrier):
    """The harness reads one turn, sends its second request from another thread and returns while
    that turn is sampled: the request is answered 410 'episode_ended', and the turn, with the
    message before it (or the sample it started), is cut from the episode: one turn, trained with
    the reward the harness returned after seeing that turn alone."""
    from tests import agent_harnesses

    name = "returns_while_asking_anew" if anew else "returns_while_asking"
    trainer, turn = racing_trainer(recipe_document, builtin_registry, chatml, name, turn_barrier=barrier)
    agent_harnesses.LEFT.clear()
    batch, metrics = rollout_with(trainer, RECORDS)
    for thread, _ in agent_harnesses.LEFT:
        thread.join(timeout=60)
    assert [answers for _, answers in agent_harnesses.LEFT] == [["episode_ended"]] * 2
    assert (metrics["env/status_ok"], metrics["env/turns"], metrics["env/splits"]) == (1.0, 1.0, 0.0)
    assert (metrics["env/reward"], metrics["env/agent_requests"], metrics["env/agent_refused"]) == (1.0, 2.0, 1.0)
    conversation = [{"role": "user", "content": PROMPT}, {"role": "assistant", "content": "7"}]
    assert rows_of(batch) == [render_ids(chatml[1], conversation)[:-1]] * 2
    assert sampled_of(batch) == [turn] * 2 and batch.scores.tolist() == [1.0, 1.0]
    assert batch.turn_rewards is not None  # the reward at the end of the turn the harness saw
    assert batch.turn_rewards.tolist() == [[0.0] * (len(turn) - 1) + [1.0]] * 2


def test_a_harness_that_returns_before_its_first_answer_ends_its_episode_as_an_error(recipe_document, builtin_registry,
                                                                                     chatml):
    from rlkit_core.runtime.episodes import EnvironmentFault

    trainer, _ = racing_trainer(recipe_document, builtin_registry, chatml, "returns_before_its_first_answer")
    with pytest.warns(EnvironmentFault, match="the harness returned before the model's first turn was answered"):
        batch, metrics = rollout_with(trainer, RECORDS)
    assert metrics["env/status_error"] == 1.0 and int(batch.loss_mask.sum()) == 0


def test_a_request_queued_or_in_flight_when_the_harness_returns_is_refused_and_never_played():
    """Driven through the session as the endpoint's handler and the episode drive it: the harness's
    end comes before a request it left queued, refuses one being answered (whose turn then is not
    the session's), and every later request reads 410 'episode_ended', never 'request_in_flight'."""
    from rlkit_core.endpoint import HarnessEnded, Limits, Request, agent_endpoint
    from rlkit_core.messages import Reply

    body = {"model": "policy", "messages": [{"role": "user", "content": "hi"}]}

    def codes(request: Request) -> str:
        return request.answer.result(timeout=5)[1]["error"]["code"]

    queued = agent_endpoint().open(Limits(max_turns=3, max_new_tokens=8, temperature=1.0))
    waiting = Request(body)
    queued.submit(waiting)
    queued.harness_ended(HarnessEnded(reward=1.0))
    assert queued.next_event(timeout=5) == HarnessEnded(reward=1.0) and codes(waiting) == "episode_ended"
    later = Request(body)
    queued.submit(later)
    assert codes(later) == "episode_ended" and (queued.turns, queued.refused) == (0, 1)

    taken = agent_endpoint().open(Limits(max_turns=3, max_new_tokens=8, temperature=1.0))
    sampled = Request(body)
    taken.submit(sampled)
    taken.next_event(timeout=5)
    taken.harness_ended(HarnessEnded(reward=1.0))
    assert codes(sampled) == "episode_ended"
    assert not taken.respond(Reply(text="7", turn=1, ids=(1, 2)), {"role": "assistant", "content": "7"})
    assert taken.turns == 0
    assert taken.next_event(timeout=5) == HarnessEnded(reward=1.0)
    later = Request(body)
    taken.submit(later)
    assert codes(later) == "episode_ended"
    queued.end("closed")
    taken.end("closed")


def test_a_turn_cut_off_ends_the_episode_and_its_request_is_refused(recipe_document, builtin_registry, chatml):
    """A turn without its end token ends the episode (trained as cut off); the request the harness
    waits on is answered 410 'episode_ended', which its client raises."""
    path, tokenizer = chatml
    trainer = agent_trainer(recipe_document, builtin_registry, path, tokenizer, [turn_ids(tokenizer, "7", end=False)], **harness("talk"))
    batch, metrics = rollout_with(trainer, RECORDS)
    assert metrics["env/status_cut_off"] == 1.0 and int(batch.loss_mask.sum()) > 0


NOT_A_NUMBER = {"text": "x", "nan": math.nan, "inf": math.inf, "none": None, "nested": {"solved": 1.0}, "list": [1.0]}


@pytest.mark.parametrize(("form", "kind"), [("callable", kind) for kind in NOT_A_NUMBER] + [("command", "text"),
                                                                                            ("command", "nan")])
def test_a_figure_that_is_not_a_finite_number_makes_the_episode_an_error(recipe_document, builtin_registry, chatml,
                                                                         form, kind):
    """The rule of every environment's `info`: a figure that is text, NaN, an infinity, None or a
    nested value is not averaged (nor dropped in silence): its episode ends as an error, said once,
    and trains nothing. A command prints it as JSON (`NaN` included)."""
    from rlkit_core.runtime.episodes import EnvironmentFault

    path, tokenizer = chatml
    how = harness("reports") if form == "callable" else command("reports")
    trainer = agent_trainer(recipe_document, builtin_registry, path, tokenizer, [turn_ids(tokenizer, "7")], **how)
    records = [{"prompt": PROMPT, "figures": {"solved": 1.0, "figure": NOT_A_NUMBER[kind]}}] * 2
    with pytest.warns(EnvironmentFault, match=r"returned info .*a dict of finite numbers is expected \('figure' is "):
        batch, metrics = rollout_with(trainer, records)
    assert metrics["env/status_error"] == 1.0 and int(batch.loss_mask.sum()) == 0
    assert "env/figure" not in metrics


@pytest.mark.parametrize("how", [harness("reports"), command("reports")], ids=["callable", "command"])
def test_a_bool_figure_counts_as_1_or_0(recipe_document, builtin_registry, chatml, how):
    path, tokenizer = chatml
    trainer = agent_trainer(recipe_document, builtin_registry, path, tokenizer, [turn_ids(tokenizer, "7")], **how)
    records = [{"prompt": PROMPT, "figures": {"solved": True}}, {"prompt": PROMPT, "figures": {"solved": False}}]
    _, metrics = rollout_with(trainer, records)
    assert (metrics["env/status_ok"], metrics["env/solved"]) == (1.0, 0.5)


@pytest.mark.parametrize(("how", "ending", "status"), [
    (harness("reports_when_ended"), {}, "cut_off"),
    (command("reports_when_ended"), {}, "cut_off"),
    (harness("reports_when_ended"), {"max_episode_tokens": 1}, "overflow"),
], ids=["cut-off", "cut-off-command", "overflow"])
def test_an_episode_the_runner_ends_keeps_the_figures_its_harness_returns_then(recipe_document, builtin_registry,
                                                                               chatml, how, ending, status):
    """The model's turn cut off (or past the token budget): the request the harness waits on is
    answered `episode_ended`, and what the harness returns then gives the episode its figures
    (`told_ended`, `solved`), never its reward (5 here): a cut-off episode's reward is its status's."""
    path, tokenizer = chatml
    turn = turn_ids(tokenizer, "7", end=status != "cut_off")
    trainer = agent_trainer(recipe_document, builtin_registry, path, tokenizer, [turn], **how, **ending)
    records = [{"prompt": PROMPT, "figures": {"solved": 0.0}}] * 2
    batch, metrics = rollout_with(trainer, records)
    assert (metrics[f"env/status_{status}"], metrics["env/told_ended"], metrics["env/solved"]) == (1.0, 1.0, 0.0)
    assert metrics["env/reward"] == 0.0 and batch.scores.tolist() == [0.0, 0.0]


def test_figures_returned_after_the_end_keep_the_rule_of_every_figure(recipe_document, builtin_registry, chatml):
    from rlkit_core.runtime.episodes import EnvironmentFault

    path, tokenizer = chatml
    trainer = agent_trainer(recipe_document, builtin_registry, path, tokenizer, [turn_ids(tokenizer, "7", end=False)],
                            **harness("reports_when_ended"))
    with pytest.warns(EnvironmentFault, match=r"the environment's close returned info .*\('solved' is nan\)"):
        batch, metrics = rollout_with(trainer, [{"prompt": PROMPT, "figures": {"solved": math.nan}}] * 2)
    assert metrics["env/status_error"] == 1.0 and int(batch.loss_mask.sum()) == 0


def test_a_harness_that_does_not_return_in_time_after_the_end_reports_no_figures(recipe_document, builtin_registry,
                                                                                  chatml):
    """What the harness returns after the end is waited for as a step is (within step_timeout_s);
    one that takes longer reports nothing, and its episode ends as the runner ended it."""
    path, tokenizer = chatml
    trainer = agent_trainer(recipe_document, builtin_registry, path, tokenizer, [turn_ids(tokenizer, "7", end=False)],
                            step_timeout_s=2.0, **harness("hangs_when_ended"))
    started = time.monotonic()
    batch, metrics = rollout_with(trainer, RECORDS)
    assert time.monotonic() - started < 25
    assert metrics["env/status_cut_off"] == 1.0 and "env/told_ended" not in metrics and int(batch.loss_mask.sum()) > 0


def test_a_request_after_the_episode_ended_reads_why(chatml):
    from rlkit_core.endpoint import Limits, agent_endpoint

    session = agent_endpoint().open(Limits(max_turns=2, max_new_tokens=8, temperature=1.0))
    session.end("closed")
    client = openai.OpenAI(base_url=session.base_url, api_key=session.key, max_retries=0)
    with pytest.raises(openai.APIStatusError) as raised:
        client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}])
    assert raised.value.status_code == 410 and raised.value.body["code"] == "episode_ended"


def test_the_end_keeps_the_harness_return_for_the_close_and_refuses_what_comes_after():
    """`Session.end` refuses what waits and keeps a return the harness made before it, which
    `returned` gives; a request after the end is refused as after it, and a session whose harness
    never returns gives nothing once its wait is over."""
    from rlkit_core.endpoint import HarnessEnded, Limits, Request, agent_endpoint

    limits = Limits(max_turns=2, max_new_tokens=8, temperature=1.0)
    session = agent_endpoint().open(limits)
    waiting = Request({"messages": [{"role": "user", "content": "hi"}]})
    session.submit(waiting)
    session.harness_ended(HarnessEnded(reward=1.0, info={"solved": 1.0}))
    session.end("closed")
    late = Request({"messages": [{"role": "user", "content": "hi"}]})
    session.submit(late)
    assert session.returned(5.0) == HarnessEnded(reward=1.0, info={"solved": 1.0})
    assert waiting.answer.result(timeout=1)[0] == 410 and late.answer.result(timeout=1)[0] == 410
    silent = agent_endpoint().open(limits)
    silent.end("closed")
    assert silent.returned(0.1) is None


def test_the_endpoint_lists_the_model_and_names_what_it_refuses_before_an_episode_reads_it():
    from rlkit_core.endpoint import Limits, agent_endpoint

    session = agent_endpoint().open(Limits(max_turns=2, max_new_tokens=8, temperature=1.0, model="tiny"))
    client = openai.OpenAI(base_url=session.base_url, api_key=session.key, max_retries=0)
    assert [m.id for m in client.models.list().data] == ["tiny"]
    cases = [({"n": 2}, "invalid_n"), ({"max_tokens": 4}, "invalid_max_tokens"),
             ({"tool_choice": "required"}, "tool_choice_unsupported"), ({"stop": ["x"]}, "stop_unsupported")]
    for fields, code in cases:
        with pytest.raises(openai.BadRequestError) as raised:
            client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], **fields)
        assert raised.value.body["code"] == code, fields
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model="tiny", messages=[])
    assert raised.value.body["code"] == "invalid_messages"
    session.end("closed")


def test_the_endpoint_keeps_an_idle_connection_longer_than_a_client_does():
    """A connection idle past httpx's 5 s expiry is still open on the server, so the client is the
    one that closes it and a request never meets a connection the server is closing."""
    import http.client
    from urllib.parse import urlsplit

    from rlkit_core.endpoint import Limits, agent_endpoint

    session = agent_endpoint().open(Limits(max_turns=2, max_new_tokens=8, temperature=1.0))
    url = urlsplit(session.base_url)
    connection = http.client.HTTPConnection(url.hostname, url.port, timeout=10)
    for _ in range(2):  # the second on the same connection, 6 s later: a closed one raises RemoteDisconnected
        connection.request("GET", f"{url.path}/models", headers={"Authorization": f"Bearer {session.key}"})
        response = connection.getresponse()
        assert response.status == 200 and response.read()
        time.sleep(6)
    connection.close()
    session.end("closed")


REFUSED_SETTINGS = [
    ({"top_p": 0.9}, "sampling_unsupported", "'top_p' 0.9 is not served: the policy samples with top_p = 1"),
    ({"presence_penalty": 0.5}, "sampling_unsupported", "leave 'presence_penalty' out or send 0"),
    ({"frequency_penalty": -1.0}, "sampling_unsupported", "'frequency_penalty' -1.0 is not served"),
    ({"logit_bias": {"7": 100}}, "sampling_unsupported", "'logit_bias' is not served"),
    ({"extra_body": {"top_k": 5}}, "sampling_unsupported", "'top_k' 5 is not served: the policy samples with top_k"),
    ({"extra_body": {"min_p": 0.1}}, "sampling_unsupported", "'min_p' 0.1 is not served"),
    ({"extra_body": {"repetition_penalty": 1.2}}, "sampling_unsupported", "leave 'repetition_penalty' out or send 1"),
    ({"logprobs": True, "top_logprobs": 5}, "top_logprobs_unsupported", "'top_logprobs' are not served"),
    ({"response_format": {"type": "json_object"}}, "response_format_unsupported", "'response_format' cannot be"),
    ({"parallel_tool_calls": False}, "parallel_tool_calls_unsupported", "'parallel_tool_calls' false cannot"),
    ({"reasoning_effort": "low"}, "reasoning_effort_unsupported", "'reasoning_effort' is not served"),
]


@pytest.mark.parametrize(("fields", "code", "said"), REFUSED_SETTINGS)
def test_a_setting_that_would_change_what_the_policy_samples_is_refused_by_name(fields, code, said):
    """What the endpoint does not serve is refused with the field's name and the fix, never ignored
    (docs/agents.md's table): a sampling setting other than the run's, a format or a limit on the
    calls it cannot enforce, log-probs it does not compute."""
    from rlkit_core.endpoint import Limits, agent_endpoint

    session = agent_endpoint().open(Limits(max_turns=2, max_new_tokens=8, temperature=1.0))
    client = openai.OpenAI(base_url=session.base_url, api_key=session.key, max_retries=0, timeout=10)
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}], **fields)
    session.end("closed")
    assert raised.value.body["code"] == code and said in raised.value.body["message"]


def test_top_p_and_top_k_are_taken_at_the_generators_values(recipe_document, builtin_registry, chatml):
    from rlkit_core.endpoint import Refused, checked_body

    path, tokenizer = chatml
    recipe_document["generator"].update(top_p=0.9, top_k=5)
    turn = turn_ids(tokenizer, "7")
    trainer = agent_trainer(recipe_document, builtin_registry, path, tokenizer, [turn], **harness("talk"))
    limits = trainer.components.environment.limits
    messages = [{"role": "user", "content": "hi"}]
    checked_body({"messages": messages, "top_p": 0.9, "top_k": 5}, limits)
    for fields in ({"top_p": 1.0}, {"top_k": 0}, {"top_k": -1}):
        with pytest.raises(Refused, match="the policy samples with top_[pk] = (0.9|5) "):
            checked_body({"messages": messages, **fields}, limits)


def test_settings_that_change_nothing_are_taken(recipe_document, builtin_registry, chatml):
    """Each setting at the value that changes nothing, and the fields taken without use (`seed`,
    `user`, `metadata`, `store`), are answered as a request without them."""
    path, tokenizer = chatml
    turn = turn_ids(tokenizer, "7")
    trainer = agent_trainer(recipe_document, builtin_registry, path, tokenizer, [turn], **harness("neutral"))
    _, metrics = rollout_with(trainer, RECORDS)
    assert (metrics["env/status_ok"], metrics["env/reward"], metrics["env/turns"]) == (1.0, 1.0, 2.0)
    assert metrics["env/agent_refused"] == 0.0


def test_a_recipe_names_its_agent_once_and_loadably(recipe_document, builtin_registry, chatml):
    from rlkit_core.errors import RecipeError

    path, tokenizer = chatml
    for environment, message in [({}, "exactly one of 'harness'"), ({**harness("talk"), **command("talk")}, "exactly one of 'harness'"),
                                 ({"harness": "tests.agent_harnesses:missing"}, "has no callable 'missing'"),
                                 ({"harness": "no/such/agent.py:play"}, "could not be loaded"),
                                 ({"harness": "play"}, "is not 'package.module:function'")]:
        with pytest.raises(RecipeError, match=message):
            agent_trainer(dict(recipe_document, reward={}), builtin_registry, path, tokenizer, [[1]], **environment)


@pytest.mark.slow
def test_the_default_agent_plays_the_ids_of_the_in_process_tool_environment(tmp_path, builtin_registry, monkeypatch):
    """recipes/ppo_agent_qwen3.toml against recipes/ppo_tool_qwen3.toml, on a small warm start of the
    same chat model, greedy: every episode in which the model wrote no call it could not read (where
    the in-process environment tells the model, and an OpenAI-client agent takes the text as its
    answer) is the same to the token, sampled ids, rendered ids and reward alike."""
    import tomllib

    from rlkit_core.recipe.document import parse_recipe
    from rlkit_core.runtime.episodes import EpisodeRunner
    from rlkit_core.runtime.trainer import Trainer

    pytest.importorskip("trl")
    root = Path(__file__).parent.parent
    monkeypatch.chdir(root)  # the recipe names its agent by a path from the working directory
    played = {}
    for name in ("ppo_tool_qwen3", "ppo_agent_qwen3"):
        document = tomllib.loads((root / "recipes" / f"{name}.toml").read_text())
        document["policy"].update(cache_dir=str(tmp_path / "cache"), n_embd=32, n_head=2, sft_steps=150, sft_examples=400, sft_batch_size=8)
        document["run"]["output_dir"] = str(tmp_path / name)
        trainer = Trainer(parse_recipe(document, builtin_registry))
        runner = EpisodeRunner(trainer.engine, trainer.components, trainer.recipe)
        played[name] = runner(trainer.stream.batch(0)[:16], list(range(16)), list(range(16)), greedy=True)
    pairs = [(a, b) for a, b in zip(played["ppo_tool_qwen3"], played["ppo_agent_qwen3"]) if not a.unreadable]
    assert len(pairs) >= 12 and sum(a.turns for a, _ in pairs) >= 2 * len(pairs)  # most episodes, and tool calls in them
    assert {a.reward for a, _ in pairs} == {0.0, 1.0}
    for a, b in pairs:
        assert [(s.prompt, s.ids, s.sampled) for s in a.samples] == [(s.prompt, s.ids, s.sampled) for s in b.samples]
        assert (a.status, a.turns, a.reward) == (b.status, b.turns, b.reward)


def test_the_docs_harness_environment_works_as_written():
    """docs/agents.md's `HarnessEnvironment` example, run as written: its reset returns the
    request its agent made, and its step answers it and ends with the agent's reward."""
    import re

    from rlkit_core import StandardEpisode
    from rlkit_core.messages import Reply

    page = (Path(__file__).parent.parent / "docs" / "agents.md").read_text()
    [source] = [block for block in re.findall(r"```python\n(.*?)```", page, re.S) if "HarnessEnvironment" in block]
    namespace: dict = {}
    exec(compile(source, "docs/agents.md", "exec"), namespace)
    environment = namespace["EchoAgent"](StandardEpisode(max_turns=1))
    opening = environment.reset({"prompt": "fig"}, seed=0)
    assert opening.messages == [{"role": "user", "content": "fig"}] and opening.tools == []
    end = environment.step(opening.state, Reply(text="a fig", turn=1, message={"role": "assistant", "content": "a fig"}))
    assert (end.done, end.reward, end.info["agent_requests"]) == (True, 1.0, 1.0)
    environment.close(opening.state)
    from rlkit_core.harness import cores_per_process

    assert (environment.start_timeout_s, environment.max_starting) == (30.0, 8 * cores_per_process())  # a plain StandardEpisode: the defaults


def test_commands_start_at_most_the_cores_of_a_process_at_once(monkeypatch):
    """max_starting = 0: 8 for each core this process may use, the cores shared among the processes torchrun started on the machine."""
    import os

    from rlkit_core import HarnessEnvironment, HarnessSettings

    cores = len(os.sched_getaffinity(0))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert HarnessEnvironment(HarnessSettings()).max_starting == 8 * max(1, cores // 2)
    assert HarnessEnvironment(HarnessSettings(max_starting=5)).max_starting == 5


def test_a_harness_module_in_the_working_directory_is_named_with_the_fix(recipe_document, builtin_registry, chatml, tmp_path, monkeypatch):
    """The rlkit command (a console script) does not put the working directory on Python's path, as
    pytest and `python -m` do: a harness module that is there but does not import is refused with
    the two fixes, and without the import machinery's frames."""
    from rlkit_core.errors import RecipeError

    path, tokenizer = chatml
    (tmp_path / "agents_here").mkdir()
    (tmp_path / "agents_here" / "__init__.py").write_text("")
    (tmp_path / "agents_here" / "mine.py").write_text("def play(record, client):\n    return 1.0\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(tmp_path))])
    with pytest.raises(RecipeError) as raised:
        agent_trainer(dict(recipe_document, reward={}), builtin_registry, path, tokenizer, [[1]], harness="agents_here.mine:play")
    said = str(raised.value)
    assert "(ModuleNotFoundError: No module named 'agents_here'); it is in the working directory (agents_here/mine.py)" in said
    assert "run with PYTHONPATH=. or name the file, harness = 'agents_here/mine.py:play'" in said
    assert "<frozen" not in said and "importlib" not in said
