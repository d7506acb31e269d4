# pyright: standard
"""Stage 1: episodes, played turn by turn against the environment; in a recipe without one, an
episode is one turn (the record's prompt, one response), on the same path.

The core owns every token of an episode. A training sample is the rendered first prompt followed
by one stream: the ids the generator sampled, as it sampled them (never decoded and re-encoded),
and between turns the ids the chat format renders for what is not sampled (the boundary after an
end token, the environment's messages, the next generation prompt). The environment only reads
decoded replies and answers with messages. When the chat template does not extend the stream (it
rewrote earlier turns), the episode goes on in a new sample that starts from the re-rendered
conversation, counted in `env/splits`: never a silent merge of what the model did not see.

A sample becomes one row of the `RolloutBatch`: its prompt in the prompt region, its stream in the
response region. `response_mask` covers the whole stream, `loss_mask` only the sampled tokens of an
episode that ended well, so every consumer (losses and their token counts, KL, GAE, lengths)
counts the sampled tokens alone. A turn's reward sits at the turn's last sampled token
(`turn_rewards`); the recipe's reward, if any, scores the whole transcript at the episode's end.
The samples of an episode that split share an `episode_ids` entry, and credit treats them as one
trajectory (`RolloutBatch.by_episode`): one score, one member of its group.

An episode ends with a status (`rlkit_core.messages.STATUSES`), counted in `env/status_<status>`.
One that the model cut off (a turn without its end token, or past the token budget) trains like a
single-turn response that never ended: `ended` is False. One that timed out or met an environment
error is kept out of training (`loss_mask` zero), never scored as 0.
"""

from __future__ import annotations

import contextlib
import math
import time
import warnings
from typing import Any, cast

import attrs
import torch

from rlkit_core.batch import RolloutBatch
from rlkit_core.chat_format import ChatFormat, TemplateAudit, audit, episode_format
from rlkit_core.episode_limits import StandardEpisode
from rlkit_core.errors import RecipeError
from rlkit_core.functional import left_padded
from rlkit_core.harness import HarnessEnvironment
from rlkit_core.interfaces import Completion, Environment, Generator
from rlkit_core.messages import STATUSES, TRAINED_STATUSES, Reply, Reset, Step
from rlkit_core.prompts import prompt_token_ids
from rlkit_core.recipe.assemble import Components
from rlkit_core.recipe.document import Recipe
from rlkit_core.runtime.engine import RolloutEngine
from rlkit_core.runtime.environment_calls import Call, CallsHung, pool_for
from rlkit_core.runtime.faults import BadReward

# A recipe without an environment: one turn, as long as the generator's response limit
ONE_TURN = StandardEpisode(max_turns=1, max_episode_tokens=0)


@attrs.define
class Sample:
    """One training row of an episode: its prompt ids and the stream after it."""

    prompt: list[int]
    ids: list[int] = attrs.field(factory=list)
    sampled: list[bool] = attrs.field(factory=list)
    logprobs: list[float] = attrs.field(factory=list)
    versions: list[int] = attrs.field(factory=list)  # the weights version that sampled each id, -1 where rendered
    rewards: dict[int, float] = attrs.field(factory=dict)  # stream position -> reward of the turn ending there
    # the conversation its ids render before its last turn (its opening's, else its last bridge's), its turns as read:
    # `rlkit check` compares them with that conversation rendered at once
    messages: list[dict] = attrs.field(factory=list)

    def extend(self, ids: list[int], logprobs: list[float] | None = None, version: int = -1) -> None:
        """`ids` sampled (with their `logprobs`, by the weights after `version` updates) or rendered (no logprobs)."""
        self.ids += ids
        self.sampled += [logprobs is not None] * len(ids)
        self.logprobs += logprobs if logprobs is not None else [math.nan] * len(ids)
        self.versions += [version if logprobs is not None else -1] * len(ids)


@attrs.define
class Episode:
    record: dict[str, Any]
    group: int
    state: Any = None
    messages: list[dict] = attrs.field(factory=list)
    samples: list[Sample] = attrs.field(factory=list)
    status: str | None = None  # None while it runs
    failure: str = ""  # why it ended "error" or "timeout" (`rlkit check` says it per episode)
    turns: int = 0
    tokens: int = 0  # after the first prompt, sampled and rendered alike
    reward: float = 0.0  # the environment's rewards, summed
    info: dict[str, float] = attrs.field(factory=dict)
    unreadable: int = 0  # replies whose tool-call markup could not be read
    started: float = 0.0
    reply: Reply | None = None
    tools: list[dict] = attrs.field(factory=list)  # the tools the model is shown (`Reset.tools`, else the environment's)
    # where it stood when its last answered turn ended (samples, that sample's ids, conversation, the
    # sample's conversation, tokens): what a turn the environment did not see (`Step.unseen`) is cut back to
    turn_end: tuple[int, int, list[dict], list[dict], int] | None = None

    @property
    def sample(self) -> Sample:
        return self.samples[-1]

    def finish(self, status: str, failure: str = "") -> None:
        self.status, self.failure = status, failure


class EnvironmentFault(UserWarning):
    """An environment's fault, said once per environment (`EpisodeRunner._say_once`): a reset or step
    that failed or timed out, an episode past its time, an opening past the context, a close that
    failed, an agent still running after its episode ended."""


def answer_problem(answer: Any, expected: type) -> str | None:
    """Why what an environment's `reset` (expected `Reset`) or `step` (`Step`) returned breaks its
    contract, or None."""
    if not isinstance(answer, expected):
        return f"returned {type(answer).__name__}, not a {expected.__name__}"
    lists = [("messages", answer.messages)] + ([("history", answer.history)] if isinstance(answer, Step) and answer.history is not None else [])
    for name, messages in lists:
        if not isinstance(messages, list) or not all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                                     and isinstance(m.get("content"), str) for m in messages):
            return f"returned {name} that are not a list of dicts with a string 'role' and 'content'"
    messages = answer.messages
    if problem := info_problem(answer.info):
        return problem
    if isinstance(answer, Reset):
        return None if messages else "returned no opening messages"
    if not isinstance(answer.done, bool):
        return f"returned done={answer.done!r}; an environment says True or False"
    if answer.status not in ("ok", "error"):
        return f"returned status {answer.status!r}; an environment says 'ok' or 'error'"
    if answer.reward is not None and (isinstance(answer.reward, bool) or not isinstance(answer.reward, (int, float))):
        return f"returned a reward of {answer.reward!r}, not a number or None"
    return None


def info_problem(info: Any) -> str | None:
    """Why `info` (a reset's, a step's or a close's) is not a dict of names to finite numbers, or
    None. A bool is a number (1 or 0); text, None, nested values, NaN and infinities are not: one rule
    for every environment, an agent's figures included, and an episode that breaks it is an error."""
    if not isinstance(info, dict):
        return f"returned info {info!r}: a dict of finite numbers is expected"
    for name, value in info.items():
        if not isinstance(name, str) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return f"returned info {info!r}: a dict of finite numbers is expected ({name!r} is {value!r})"
    return None


class EpisodeRunner:
    """Plays a batch of episodes with the run's generator and environment (one turn each where the recipe has none)."""

    def __init__(self, engine: RolloutEngine, components: Components, recipe: Recipe, max_prompt_tokens: int = 0):
        """`max_prompt_tokens`: where a recipe without an environment cuts its prompts from the left (0: not cut)."""
        policy, environment = components.policy, components.environment
        self.engine, self.components, self.max_prompt_tokens = engine, components, max_prompt_tokens
        self.response_limit = recipe["generator"].config.max_new_tokens
        self.environment, self.tokenizer = environment, policy.tokenizer
        self.context = policy.context_length
        self.eos = set(policy.eos_token_ids)
        if environment is None:  # one turn: the record's prompt as the data prepared it, then one response
            self.settings = ONE_TURN
            return
        self.settings = settings = recipe["environment"].config
        self.format: ChatFormat = episode_format(settings, policy.tokenizer, policy.eos_token_ids, recipe.registry)[0]
        self.tools = environment.tools()
        self.calls = pool_for(environment, settings.call_threads)
        # a harness bounds its resets itself (a command's start by start_timeout_s, once one of max_starting places is free)
        self.reset_timeout_s = settings.step_timeout_s
        if isinstance(environment, HarnessEnvironment):
            environment.hold_thread = self.calls.held  # a callable agent that outlives its episode holds a call thread
            self.reset_timeout_s = 0.0

    def token_limit(self, prompt_length: int) -> int:
        """The episode's token budget after a prompt of `prompt_length` ids, within the policy's context."""
        settings = self.settings
        limit = settings.max_episode_tokens or settings.max_turns * self.response_limit
        if self.context:
            limit = min(limit, self.context - prompt_length)
        return limit

    def room_for_a_turn(self, sample: Sample) -> bool:
        """Whether a whole turn (the generator's response limit) fits after `sample`'s stream in the
        policy's context: the generator cannot stop a turn at the context's end."""
        return not self.context or len(sample.prompt) + len(sample.ids) + self.response_limit <= self.context

    def __call__(self, records: list[dict], groups: list[int], seeds: list[int], greedy: bool = False) -> list[Episode]:
        """One episode per record, all turns, every one ended with a status. Then, on every process
        alike: a `RecipeError` an environment raised on any process (bad input: the run stops, exit
        2), `CallsHung`, or the recipe's bad-reward policy for a reward that is not a finite number."""
        self.bad_rewards: list[str] = []
        self.stopped_by: RecipeError | CallsHung | None = None
        self.streams = contextlib.ExitStack()  # each turn continues its episode's stream, while the weights stay the same
        with self.streams:
            if self.settings.max_turns > 1:  # a turn may follow: its stream is continued
                self.streams.enter_context(self.components.generator.continuing_streams())
            episodes = self._play(records, groups, seeds, greedy)
        if self.environment is None:  # one-turn episodes: no environment's fault for the processes to agree on
            return episodes
        stop = self.stopped_by
        mine = (stop.problems if isinstance(stop, RecipeError) else str(stop) if stop else None, self.bad_rewards[0] if self.bad_rewards else None)
        found = self.engine.processes.gather_objects(mine)
        if stopped := next((s for s, _ in found if s), None):
            raise RecipeError(stopped) if isinstance(stopped, list) else CallsHung(stopped)
        if problem := next((b for _, b in found if b), None):
            rows = [{"prompt": str(e.record["prompt"]), "status": e.status} for e in episodes]
            raise BadReward(f"the environment {problem}", {"rows": rows})
        return episodes

    def _call(self, calls: list[tuple[Any, tuple]], what: str, timeout: float | None = None) -> list[tuple[str, Any]]:
        """The environment's calls in its pool (`rlkit_core.runtime.environment_calls`), each within
        `timeout` seconds (None: step_timeout_s). A `RecipeError` among them, or a pool whose every
        thread hung, is kept for `__call__` (which raises it on every process) and ends this batch's episodes."""
        try:
            return self.calls.run(calls, self.settings.step_timeout_s if timeout is None else timeout, what)
        except (RecipeError, CallsHung) as exc:
            self.stopped_by = self.stopped_by or exc
            return [("stopped", None)] * len(calls)

    def _play(self, records: list[dict], groups: list[int], seeds: list[int], greedy: bool = False) -> list[Episode]:
        from rlkit_core.runtime.rollout import sampling

        episodes = [Episode(record=r, group=g) for r, g in zip(records, groups)]
        timings = {"generate": 0.0, "environment": 0.0}
        if self.environment is None:
            for episode in episodes:
                episode.samples.append(Sample(prompt=self._prompt_ids(episode.record)))
        else:
            started = time.perf_counter()
            self._reset(episodes, seeds)
            timings["environment"] += time.perf_counter() - started
        ready = [e for e in episodes if e.status is None]
        # one block for the rollout in every process, whatever its episodes do: under FSDP entering
        # it gathers the weights (a collective), and the weights do not change within a rollout
        with sampling(self.engine, self.components, [self._padded(ready)] if ready else []) as generator:
            if self.settings.turn_barrier:
                self._play_in_turns(generator, episodes, greedy, timings)
            elif ready:
                self._play_as_ready(generator, ready, greedy, timings)
        for episode in episodes:
            if episode.status is None:
                episode.finish("ok")
        if self.environment is not None:
            began = time.perf_counter()
            self._close([e for e in episodes if e.state is not None])
            timings["environment"] += time.perf_counter() - began
            if self.calls.outside:
                self._say_once("outlived", f"the agent of {self.calls.outside} episode(s) that ended is still running (a callable that has "
                                           "not returned: Python cannot stop its thread): each is counted in env/hung_calls and holds one "
                                           f"of environment.call_threads = {self.calls.size} threads until it returns, and when every one "
                                           "is held the run stops; make the agent return when its requests are refused (410 "
                                           "episode_ended), or run it as a command, whose process is killed when its episode ends")
        self.timings = timings
        self.hung_calls = self.calls.hung if self.environment is not None else 0
        return episodes

    def _prompt_ids(self, record: dict) -> list[int]:
        """A one-turn episode's prompt: the record's ids as every prompt is encoded (`encode_prompts`), cut to `max_prompt_tokens`."""
        ids = prompt_token_ids(self.tokenizer, record)
        return ids[-self.max_prompt_tokens:] if self.max_prompt_tokens else ids

    def _reset(self, episodes: list[Episode], seeds: list[int]) -> None:
        """The environment's reset of each episode: its opening messages as the first sample's prompt,
        or the episode ended for the environment's fault, or as "overflow" when no turn fits after it."""
        environment = self.environment
        assert environment is not None  # one-turn episodes have none: no reset, step or close
        resets = self._call([(environment.reset, (e.record, seed)) for e, seed in zip(episodes, seeds)], "reset", self.reset_timeout_s)
        for episode, (status, reset) in zip(episodes, resets):
            episode.started = time.monotonic()
            problem = answer_problem(reset, Reset) if status == "ok" else None
            if status != "ok" or problem:
                self._fail(episode, status, problem or reset, "reset")
                # a row for the batch all the same, never trained: the prompt as the user's message
                episode.samples.append(self._unplayed(self.format.opening([{"role": "user", "content": str(episode.record["prompt"])}], [])))
                continue
            episode.state, episode.messages, episode.info = reset.state, list(reset.messages), dict(reset.info)
            episode.tools = self.tools if reset.tools is None else list(reset.tools)
            episode.samples.append(Sample(prompt=self.format.opening(episode.messages, episode.tools), messages=list(episode.messages)))
            if not self.room_for_a_turn(episode.sample):
                self._opening_overflow(episode)

    def _play_in_turns(self, generator: Generator, episodes: list[Episode], greedy: bool, timings: dict[str, float]) -> None:
        """Every episode's turns with the barrier: each turn, every running episode is generated in
        one call, then every environment answers."""
        for turn in range(1, self.settings.max_turns + 1):
            if turn > 1 and self.engine.between_turns():  # newer weights loaded (a producer's worker, `scheduler.partial_rollouts`)
                self._weights_changed(generator)
            for episode in episodes:
                if episode.status is None and not self.room_for_a_turn(episode.sample):
                    episode.finish("overflow")
            running = [e for e in episodes if e.status is None]
            if not running:
                break
            began = time.perf_counter()
            generation = generator.generate(*self._padded(running), greedy=greedy)
            timings["generate"] += time.perf_counter() - began
            for episode, completion in zip(running, generation.completions()):
                self._take_turn(episode, completion, turn)
            replying = [e for e in running if e.status is None]
            if not replying:  # every one ended with its turn (one-turn episodes always do)
                continue
            began = time.perf_counter()
            assert self.environment is not None  # a one-turn episode ends with its turn
            steps = self._call([(self.environment.step, (e.state, e.reply)) for e in replying], "step")
            timings["environment"] += time.perf_counter() - began
            for episode, (status, step) in zip(replying, steps):
                self._answer(episode, status, step, last_turn=turn == self.settings.max_turns)

    def _weights_changed(self, generator: Generator) -> None:
        """After newer weights were loaded between turns: pushed to an engine of the generator's own
        and checked, and the episodes' kept caches, computed with the older weights, dropped."""
        generator.sync_weights(self.components.policy)
        self.engine.push_check.after_push(self.engine, generator, self.components.policy, [])
        self.streams.close()
        self.streams.enter_context(generator.continuing_streams())

    def _play_as_ready(self, generator: Generator, ready: list[Episode], greedy: bool, timings: dict[str, float]) -> None:
        """Every episode's turns without a barrier across episodes (`turn_barrier = false`): each turn
        is a request to the generator's `serve` as soon as its episode's environment has answered,
        and each step goes to the environment's pool as soon as its turn is sampled. The time the
        generator waited with nothing to decode is counted as the environment's, the rest as
        generating."""
        turns = TurnRequests(self, ready)
        began = time.perf_counter()
        generator.serve(turns, greedy)
        timings["generate"] += time.perf_counter() - began - turns.waited
        timings["environment"] += turns.waited

    def _stepped(self, calls: list[Call], wait: bool) -> list[tuple[Call, tuple[str, Any]]]:
        """The steps among `calls` that have ended, each with its outcome, as `_call` gives them: a
        step that raised a `RecipeError` is kept for `__call__` and ends its episode, and a pool
        whose every thread hung ends every episode still stepping."""
        try:
            ended = self.calls.ended(calls, self.settings.step_timeout_s, "step", wait=wait)
        except CallsHung as exc:
            self.stopped_by = self.stopped_by or exc
            return [(call, ("stopped", None)) for call in calls]
        for call in ended:
            if call.recipe_error:
                self.stopped_by = self.stopped_by or call.recipe_error
        return [(call, ("stopped", None) if call.recipe_error else cast(tuple[str, Any], call.outcome)) for call in ended]

    def _close(self, ended: list[Episode]) -> None:
        """`Environment.close` for each ended episode, the figures it returns merged into the
        episode's info (figures that break `info`'s rule make the episode an error, as a step's
        do). A close that fails or times out is warned of once and changes nothing else: the episode
        has ended and trains as it ended. An environment that keeps the default (nothing to release)
        takes no thread of the pool."""
        if getattr(type(self.environment), "close", Environment.close) is Environment.close:
            return
        assert self.environment is not None  # one-turn episodes have no state to close
        closes = self._call([(self.environment.close, (e.state,)) for e in ended], "close")
        for episode, (status, figures) in zip(ended, closes):
            if status == "ok" and figures is not None:
                if problem := info_problem(figures):
                    self._fail(episode, status, problem, "close")
                else:
                    episode.info.update(figures)
        failed = [(status, why) for status, why in closes if status not in ("ok", "stopped")]
        if failed:
            status, why = failed[0]
            verb = f"did not return within environment.step_timeout_s = {self.settings.step_timeout_s:g} s" if status == "timeout" else "failed"
            self._say_once("close", f"the environment's close {verb} in {len(failed)} of {len(ended)} episodes, so what they hold may not "
                                    "have been released" + (f": {why}" if status != "timeout" else ""))

    def _fail(self, episode: Episode, status: str, why: Any, call: str) -> None:
        """End the episode for the environment's fault: "timeout" or "error", the reason `why` said
        once per environment (a timeout once per call it hit: its seconds vary). `why` of a timeout is
        None when the pool timed the call out (it still runs), else what the call's TimeoutError said.
        An episode stopped by another's recipe error ("stopped") ends silently: the run is about to
        stop with that error."""
        if status == "timeout":
            if why is None:
                said = f"the environment's {call} did not return within environment.step_timeout_s = {self.settings.step_timeout_s:g} s"
                self._say_once("hung", f"{said}: the episode ends as a timeout, kept out of training (env/status_timeout), and the call is "
                                       f"left running in one of environment.call_threads = {self.calls.size} threads until it returns "
                                       "(env/hung_calls counts them; when every one is held, the run stops)")
            else:
                said = f"the environment's {call} timed out: {why}"
                self._say_once(f"timeout {call}", f"{said}; the episode ends as a timeout, kept out of training (env/status_timeout): "
                                                  "raise the limit named (0: no limit), or find what is slow")
            return episode.finish("timeout", said)
        if status != "stopped":
            said = f"the environment's {call} {'raised ' if status == 'error' else ''}{why}"
            text = f"{said}; the episode is kept out of training (env/status_error)"
            self._say_once(text, text)
            return episode.finish("error", said)
        return episode.finish("error")

    def _say_once(self, key: str, text: str) -> None:
        """Warn of an environment's fault once per environment, by rlkit's own record of what it said
        (`CallPool.said`): Python's once-only registry is reset by any library's warnings filter."""
        if key not in self.calls.said:
            self.calls.said.add(key)
            warnings.warn(text, EnvironmentFault, stacklevel=4)

    def _unplayed(self, prompt: list[int]) -> Sample:
        """A sample for an episode that samples nothing, its prompt cut from the left to fit the
        policy's context: it is a row of the batch (never trained), and the forward passes read it."""
        return Sample(prompt=prompt[-(self.context - 1):] if self.context and len(prompt) >= self.context else prompt)

    def _opening_overflow(self, episode: Episode) -> None:
        """The environment's opening leaves no room for a turn: the episode ends as "overflow"
        before it samples, said once per environment."""
        length = len(episode.sample.prompt)
        text = (f"the environment's reset returned opening messages that render to {length} tokens, which with a turn of "
                f"{self.response_limit} (generator.max_new_tokens) do not fit the policy's context of {self.context} tokens; "
                "such episodes end as overflow before they sample (env/status_overflow): shorten the opening messages")
        self._say_once("opening", text)
        episode.samples[-1] = self._unplayed(episode.sample.prompt)
        episode.finish("overflow")

    def _padded(self, running: list[Episode]) -> tuple[torch.Tensor, torch.Tensor]:
        """The running episodes' streams so far (prompt and sample), left-padded: (ids, mask) on the device."""
        return left_padded([e.sample.prompt + e.sample.ids for e in running], self.tokenizer.pad_token_id, self.engine.device)

    def _take_turn(self, episode: Episode, completion: Completion, turn: int) -> None:
        """Append what the generator sampled for `episode`, verbatim; end it when the turn was cut
        off or the budget ran out, else read the reply."""
        ids, logprobs, length = completion.ids, completion.logprobs, len(completion.ids)
        episode.turns = turn
        left = self.token_limit(len(episode.samples[0].prompt)) - episode.tokens
        over = length > left
        if over:
            ids, logprobs = ids[:left], logprobs[:left]
        episode.sample.extend(ids, logprobs, self.components.policy.weights_version)
        episode.tokens += len(ids)
        if over:
            return episode.finish("overflow")
        if not ids or ids[-1] not in self.eos:
            return episode.finish("cut_off")
        if self.environment is None:  # a one-turn episode ends with its response
            return episode.finish("ok")
        reply = self.format.read(ids, turn, episode.tools)
        stream = episode.sample
        reply = attrs.evolve(reply, ids=tuple(ids), logprobs=tuple(logprobs), message=self.format.assistant_message(reply),
                             weights_version=self.components.policy.weights_version, prompt_tokens=len(stream.prompt) + len(stream.ids) - len(ids))
        episode.unreadable += reply.parse_error is not None
        episode.messages.append(reply.message)
        episode.reply = reply

    def _answer(self, episode: Episode, status: str, step: Step, last_turn: bool) -> None:
        """The environment's answer to the episode's turn: its reward at the turn's last sampled
        token, then the end of the episode or the ids of what comes next."""
        problem = answer_problem(step, Step) if status == "ok" else None
        if not problem and status == "ok" and step.unseen and episode.turn_end is None:
            problem = "returned unseen=True for the episode's first turn: no turn is left to train"
        if status != "ok" or problem:
            return self._fail(episode, status, problem or step, "step")
        if step.unseen:
            self._cut_last_turn(episode)
        if step.reward is not None:
            reward = float(step.reward)
            if not math.isfinite(reward):
                self.bad_rewards.append(f"returned a reward that is not finite ({step.reward!r}) in turn {episode.turns}")
                return episode.finish("error", f"the environment's step {self.bad_rewards[-1]}")
            position = len(episode.sample.ids) - 1
            episode.sample.rewards[position] = episode.sample.rewards.get(position, 0.0) + reward
            episode.reward += reward
        episode.info.update(step.info)
        if step.status == "error":
            return episode.finish("error", "the environment's step returned status 'error'")
        if step.done or step.unseen or last_turn:
            return episode.finish("ok")
        if self.settings.episode_timeout_s and time.monotonic() - episode.started > self.settings.episode_timeout_s:
            said = f"the episode ran past environment.episode_timeout_s = {self.settings.episode_timeout_s:g} s"
            self._say_once("episode timeout", f"{said} (its turns' generation and the environment's calls, from its reset): it ends as a "
                                              "timeout, kept out of training (env/status_timeout); raise the limit (0: no limit)")
            return episode.finish("timeout", said)
        episode.turn_end = (len(episode.samples), len(episode.sample.ids), list(episode.messages),
                            episode.sample.messages, episode.tokens)
        if step.history is not None:  # the environment changed the conversation: a new sample starts from it
            episode.messages = list(step.history)
            return self._start_sample(episode)
        bridge = self.format.bridge(episode.sample.prompt + episode.sample.ids, episode.messages, step.messages, episode.tools)
        episode.messages += step.messages
        if bridge is None:  # the template rewrote the history: the next turn starts a new sample
            return self._start_sample(episode)
        if episode.tokens + len(bridge) >= self.token_limit(len(episode.samples[0].prompt)):
            return episode.finish("overflow")
        episode.sample.extend(bridge)
        episode.sample.messages = list(episode.messages)
        episode.tokens += len(bridge)
        return None

    def _cut_last_turn(self, episode: Episode) -> None:
        """Take the episode back to the end of its turn before the last (`Episode.turn_end`): the last
        turn's ids, what was said before it and a sample it started are cut, never trained."""
        assert episode.turn_end is not None and episode.reply is not None  # `_answer` refuses an unseen first turn
        samples, length, messages, said, tokens = episode.turn_end
        del episode.samples[samples:]
        sample = episode.sample
        for values in (sample.ids, sample.sampled, sample.logprobs, sample.versions):
            del values[length:]
        sample.messages, episode.messages, episode.tokens = said, messages, tokens
        episode.turns -= 1
        episode.unreadable -= episode.reply.parse_error is not None

    def _start_sample(self, episode: Episode) -> None:
        """The next turn starts a new sample from the conversation rendered whole (one that leaves
        no room for a turn ends the episode as "overflow" before that turn)."""
        episode.samples.append(Sample(prompt=self.format.opening(episode.messages, episode.tools), messages=list(episode.messages)))


class TurnRequests:
    """The turns of episodes that do not wait on each other, as requests to `Generator.serve`: a
    request arrives when its episode's environment has answered (the first turns at once), and a
    completed turn is read and its step given to the environment's pool at once."""

    def __init__(self, runner: EpisodeRunner, ready: list[Episode]):
        self.runner, self.ready = runner, ready
        self.pad_id, self.device = runner.tokenizer.pad_token_id, runner.engine.device
        self.stepping: dict[Call, Episode] = {}
        self.waited = 0.0  # seconds the generator waited with nothing to decode

    def arrived(self, wait: bool) -> list[tuple[Any, list[int]]]:
        runner, began = self.runner, time.perf_counter()
        while True:
            if self.stepping:
                for call, (status, step) in runner._stepped(list(self.stepping), wait=wait and not self.ready):
                    episode = self.stepping.pop(call)
                    runner._answer(episode, status, step, last_turn=episode.turns == runner.settings.max_turns)
                    self.ready.append(episode)
            for episode in self.ready:
                if episode.status is None and not runner.room_for_a_turn(episode.sample):
                    episode.finish("overflow")
            ready, self.ready = [e for e in self.ready if e.status is None], []
            if ready or not wait or not self.stepping:
                break
        if wait:
            self.waited += time.perf_counter() - began
        return [(episode, episode.sample.prompt + episode.sample.ids) for episode in ready]

    def completed(self, key: Any, completion: Completion) -> None:
        episode: Episode = key
        self.runner._take_turn(episode, completion, episode.turns + 1)
        if episode.status is None:
            environment = self.runner.environment
            assert environment is not None  # a one-turn episode ends with its turn
            self.stepping[self.runner.calls.submit(environment.step, (episode.state, episode.reply))] = episode


def chat_audit(recipe, policy) -> TemplateAudit:
    """How the policy's chat template renders an episode's turns, read in the recipe's tool-call format (`rlkit_core.chat_format.audit`)."""
    settings = recipe["environment"].config
    chat, how = episode_format(settings, policy.tokenizer, policy.eos_token_ids, recipe.registry)
    return audit(policy.tokenizer, policy.eos_token_ids, chat.name, chat.tool_calls, how, settings.thinking_in_history, chat)


def episode_totals(episodes: list[Episode]) -> dict[str, tuple[float, int]]:
    """Each `env/...` figure of `episodes` as (sum, episodes counted): every episode for the
    runner's own figures, those that reported the name for what the environment said about the
    episode last (`Reset.info`, then each step's, then its close's). Totals add up over processes
    and batches, where means do not (`figure_means`)."""
    count = len(episodes)
    totals = {f"env/status_{status}": (float(sum(e.status == status for e in episodes)), count) for status in STATUSES}
    totals.update({
        "env/turns": (float(sum(e.turns for e in episodes)), count),
        "env/tokens": (float(sum(e.tokens for e in episodes)), count),
        "env/reward": (sum(e.reward for e in episodes), count),
        "env/unreadable_tool_calls": (float(sum(e.unreadable for e in episodes)), count),
        "env/splits": (float(sum(len(e.samples) - 1 for e in episodes)), count),
    })
    for name in sorted({name for e in episodes for name in e.info}):
        values = [float(e.info[name]) for e in episodes if name in e.info]
        totals[f"env/{name}"] = (sum(values), len(values))
    return totals


def figure_means(parts: list[dict[str, tuple[float, int]]]) -> dict[str, float]:
    """The means of `episode_totals` added up over `parts` (processes, batches): each figure's sums
    over its counts, so that a part where fewer episodes reported a name weighs less."""
    added: dict[str, tuple[float, int]] = {}
    for totals in parts:
        for name, (total, count) in totals.items():
            known_total, known_count = added.get(name, (0.0, 0))
            added[name] = (known_total + total, known_count + count)
    return {name: total / count for name, (total, count) in added.items()}


def episode_metrics(episodes: list[Episode]) -> dict[str, float]:
    """`env/...` means over the episodes (the batch's, on this process)."""
    return figure_means([episode_totals(episodes)])


def episodes_batch(episodes: list[Episode], scores: list[float], pad: int, device, first_id: int = 0, turn_rewards: bool = True) -> RolloutBatch:
    """The episodes' samples as rows (see the module), with the episode's score on each and its
    id (`first_id` + its index) in `episode_ids`: the score is paid once per episode
    (`RolloutBatch.by_episode`). `turn_rewards`: whether turns can be rewarded (not without an environment)."""
    rows = [(e, s, score) for e, score in zip(episodes, scores) for s in e.samples]
    episode_ids = [first_id + index for index, e in enumerate(episodes) for _ in e.samples]
    prompt_width = max(len(s.prompt) for _, s, _ in rows)
    width = max(1, max(len(s.ids) for _, s, _ in rows))
    count = len(rows)
    prompt_ids = torch.full((count, prompt_width), pad, dtype=torch.long)
    prompt_mask = torch.zeros((count, prompt_width), dtype=torch.long)
    response_ids = torch.full((count, width), pad, dtype=torch.long)
    response_mask = torch.zeros((count, width), dtype=torch.long)
    loss_mask = torch.zeros((count, width), dtype=torch.long)
    logprobs = torch.full((count, width), math.nan)
    versions = torch.full((count, width), -1, dtype=torch.long)
    rewards = torch.zeros((count, width))
    for row, (episode, sample, _) in enumerate(rows):
        prompt_ids[row, prompt_width - len(sample.prompt):] = torch.tensor(sample.prompt, dtype=torch.long)
        prompt_mask[row, prompt_width - len(sample.prompt):] = 1
        n = len(sample.ids)
        if n:
            response_ids[row, :n] = torch.tensor(sample.ids, dtype=torch.long)
            response_mask[row, :n] = 1
            logprobs[row, :n] = torch.tensor(sample.logprobs)
            versions[row, :n] = torch.tensor(sample.versions, dtype=torch.long)
            if episode.status in TRAINED_STATUSES:
                loss_mask[row, :n] = torch.tensor(sample.sampled, dtype=torch.long)
        for position, reward in sample.rewards.items():
            rewards[row, position] = reward
    records = [e.record for e, _, _ in rows]
    from rlkit_core.runtime.rollout import record_columns

    return RolloutBatch(
        prompts=[str(r.get("prompt", "")) for r in records], columns=record_columns(records),
        group_ids=torch.tensor([e.group for e, _, _ in rows], dtype=torch.long, device=device),
        prompt_ids=prompt_ids.to(device), prompt_mask=prompt_mask.to(device), response_ids=response_ids.to(device),
        response_mask=response_mask.to(device), loss_mask=loss_mask.to(device), sampled_logprobs=logprobs.to(device),
        ended=torch.tensor([e.status == "ok" for e, _, _ in rows], device=device),
        scores=torch.tensor([score for _, _, score in rows], dtype=torch.float32, device=device),
        turn_rewards=rewards.to(device) if turn_rewards else None,
        sampled_versions=versions.to(device), episode_ids=torch.tensor(episode_ids, dtype=torch.long, device=device),
    )


def transcript(tokenizer, episode: Episode) -> str:
    """What the episode said after its first prompt, as text for a reward: its stream decoded. An
    episode that split has the conversation as its last sample's prompt renders it after the first
    prompt (the environment's messages included, earlier turns as the template rewrote them), then
    that sample's stream."""
    first, last = episode.samples[0], episode.samples[-1]
    if len(episode.samples) == 1:
        return tokenizer.decode(first.ids, skip_special_tokens=True)
    shared = next((i for i, (a, b) in enumerate(zip(first.prompt, last.prompt)) if a != b), min(len(first.prompt), len(last.prompt)))
    return tokenizer.decode(last.prompt[shared:] + last.ids, skip_special_tokens=True)
