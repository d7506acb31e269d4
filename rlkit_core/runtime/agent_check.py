# pyright: standard
"""`rlkit check`'s conformance run of an agent recipe (the `agent` environment, or another
`HarnessEnvironment`, whose episodes an outside agent plays through the endpoint): a few episodes
played as `rlkit run` plays them, before any training. The policy is built, the recipe's generator
samples it, the harness talks to the endpoint and `EpisodeRunner` plays the turns; then each
episode is reported as the training samples it made: the harness's requests and refusals, the
turns merged into the stream or split into a new sample (by the harness changing the history, or
by the chat template), the tool calls the harness answered and those the model wrote unreadably,
the status and reward, and whether each sample's ids are its conversation rendered at once by the
chat format, compared by ids.

An agent recipe is the only one for which `rlkit check` builds the policy: its episodes are someone
else's program, whose conformance shows only when it plays against a model. A harness that fails
(status "error" or "timeout") is a problem, exit 2, with its reason: a run keeps such episodes out
of training. A harness that changes the history on every turn is named, with what it costs.
"""

from __future__ import annotations

import shlex
import warnings

import attrs
import torch

from rlkit_core.chat_format import ChatFormat
from rlkit_core.context import BuildContext
from rlkit_core.errors import RecipeError
from rlkit_core.harness import HarnessEnvironment
from rlkit_core.hf import is_local, offline
from rlkit_core.interfaces import NullTracker
from rlkit_core.launch import ONE_PROCESS
from rlkit_core.prompts import PromptLengthLimit, prepare_prompts, within_context
from rlkit_core.recipe.assemble import Components
from rlkit_core.recipe.document import Recipe
from rlkit_core.runtime.engine import RolloutEngine, StandaloneEngine
from rlkit_core.runtime.episodes import EnvironmentFault, Episode, EpisodeRunner, Sample

EPISODES = 2  # played by default (rlkit check --agent-episodes N)
FAILED = ("error", "timeout")  # kept out of training by a run


def is_agent_recipe(recipe: Recipe) -> bool:
    """Whether the recipe's environment is a `HarnessEnvironment` (by its class: nothing is built)."""
    return "environment" in recipe.components and issubclass(recipe["environment"].component.factory, HarnessEnvironment)


@attrs.frozen
class SampleCheck:
    """One training sample of an episode, against its conversation rendered at once (`rendered`)."""

    prompt: int  # ids of its prompt
    stream: int  # ids after it, sampled and rendered
    matches: bool
    parting: str = ""  # where its ids and the render part, for the printout


@attrs.frozen
class EpisodeCheck:
    """What one episode did to the training samples (see the module)."""

    status: str
    failure: str
    reward: float
    requests: int
    refused: int
    rewrites: int  # requests whose history the harness had changed
    tool_calls: int  # made by the model
    tool_results: int  # of those, answered by the harness with a tool result
    unreadable: int  # turns whose call markup could not be read, answered as text with `tool_call_error`
    turns: int
    merged: int  # turns after a sample's first that went on in its stream
    samples: tuple[SampleCheck, ...]

    @property
    def splits(self) -> int:
        return len(self.samples) - 1

    @property
    def template_splits(self) -> int:
        return max(0, self.splits - self.rewrites)

    @property
    def every_turn_rewritten(self) -> bool:
        return self.turns > 1 and self.rewrites >= self.turns - 1

    @property
    def rendered_again(self) -> int:
        """Prompt ids of the samples after the first: the conversation rendered again for each."""
        return sum(s.prompt for s in self.samples[1:])


def uncached_hub_models(recipe: Recipe) -> list[str]:
    """With HF_HUB_OFFLINE (`rlkit check --offline`), the policy's model and tokenizer names that are
    hub names missing from the local cache: the episodes cannot be played, which is not the recipe's fault."""
    if not offline():
        return []
    from huggingface_hub import try_to_load_from_cache

    config = recipe["policy"].config
    names = dict.fromkeys(n for n in (getattr(config, "model", ""), getattr(config, "tokenizer", "")) if isinstance(n, str) and n)
    return [name for name in names if not is_local(name)
            and not any(isinstance(try_to_load_from_cache(name, file), str) for file in ("config.json", "tokenizer_config.json"))]


def agent_episodes(recipe: Recipe, count: int = EPISODES) -> tuple[list[str], list[str], list[str]]:
    """The plan's `ResetProbe` for an agent recipe: `count` episodes on the first records of the
    data, reported (lines, problems, notes). Parts that do not build without what the check lacks
    (a hub model with --offline) are a note; the recipe's own errors are problems."""
    if missing := uncached_hub_models(recipe):
        return [], [], [f"$.policy: no agent episode played: {', '.join(map(repr, missing))} is a hub name not in the local cache, and "
                        "--offline reads nothing else (run the check with network once, or give a local model directory)"]
    run = recipe.run
    if run.threads:
        torch.set_num_threads(run.threads)
    torch.manual_seed(run.seed)
    try:
        engine = StandaloneEngine(recipe)
        components, records = parts(recipe, engine.device)
    except RecipeError as exc:
        return [], exc.problems, []
    except Exception as exc:  # a model not in the cache with --offline, a device that is not there
        return [], [], [f"$.environment: no agent episode played: building the policy, its generator, the data or the environment "
                        f"raised {type(exc).__name__}: {exc}"]
    if not records:
        return [], [], ["$.data: no record to play an agent episode on"]
    timed, late = command_starts(recipe, components, records)
    records = records[:count]
    try:
        with warnings.catch_warnings():  # each failure is said below, per episode
            warnings.simplefilter("ignore", EnvironmentFault)
            checks = play(engine, components, recipe, records)
    except RecipeError as exc:  # the environment found the recipe at fault, as it would stop a run
        return [], late + exc.problems, []
    settings = recipe["environment"].config
    spec = getattr(settings, "harness", "") or shlex.join(getattr(settings, "command", None) or [])  # the `agent` environment's
    harness = f"the harness {spec}" if spec else f"the {recipe['environment'].component.name} environment's agent"
    head = [f"agent episodes      {len(checks)}, on the data's first {len(records)} record(s) (rlkit check --agent-episodes N; 0: none), "
            f"played as a run plays them: {harness} through the endpoint,",
            "                    the policy built for them (rlkit check builds it for agent recipes only) and sampled by the generator"]
    lines = head + timed + describe(checks, harness, "reward" in recipe.components)
    return lines, late + failures(checks), []


def command_starts(recipe: Recipe, components: Components, records: list[dict]) -> tuple[list[str], list[str]]:
    """A command harness's start, timed as a run starts it: as many commands launched at once as a
    run launches (a batch's episodes, at most environment.max_starting), each timed from its launch
    to its first request (lines, problems). A start past environment.start_timeout_s is a problem:
    in a run, such episodes end as timeouts before their first turn."""
    environment = components.environment
    if not isinstance(environment, HarnessEnvironment) or environment.command(records[0]) is None:
        return [], []
    budget, most = environment.start_timeout_s, environment.max_starting
    if not budget:
        return ["command start       not timed: environment.start_timeout_s = 0 gives it no limit"], []
    count = min(recipe.ppo.batch_size, most)
    how = f"as a run launches them (a batch's {recipe.ppo.batch_size} episodes, environment.max_starting = {most} at a time)"
    times = environment.start_times([records[i % len(records)] for i in range(count)])
    started = sorted(t for t in times if t is not None)
    took = f"{started[0]:.1f}–{started[-1]:.1f} s" if started else ""
    if len(started) == len(times):  # none timed when every one ended before its first request: the episodes below say why
        return ([f"command start       {count} launched at once {how}: {took} from launch to first request, within "
                 f"environment.start_timeout_s = {budget:g} s"] if started else []), []
    return [], [f"$.environment.start_timeout_s: {len(times) - len(started)} of {count} commands launched at once {how} sent no first "
                f"request within {budget:g} s of their launch" + (f" (the others took {took})" if took else "") + "; in a run such "
                "episodes end as timeouts before their first turn: raise environment.start_timeout_s, or lower environment.max_starting"]


def parts(recipe: Recipe, device: torch.device) -> tuple[Components, list[dict]]:
    """The components the runner reads, built as a run builds them (in this process), and the
    data's records as a run prepares them. The critic, the reward, the tracker and a batch source
    are not built: the episodes need none of them."""
    context = BuildContext(recipe=recipe, device=device, output_dir=str(recipe.run.output_dir), seed=recipe.run.seed, launch=ONE_PROCESS)
    policy = context.build(recipe["policy"])
    context.policy = policy
    components = Components(policy=policy, value_head=None, generator=context.build(recipe["generator"]), reward=None,
                            kl=context.build(recipe["kl"]), advantage=context.build(recipe["advantage"]), loss=context.build(recipe["loss"]),
                            environment=context.build(recipe["environment"]), data=context.build(recipe["data"]), tracker=NullTracker(),
                            batch_source=None)
    limit = recipe["data"].config if isinstance(recipe["data"].config, PromptLengthLimit) else None
    limit = within_context(limit, policy.context_length, recipe["generator"].config.max_new_tokens)
    records, _ = prepare_prompts(components.data.load(), policy.tokenizer, limit)
    return components, records


def play(engine: RolloutEngine, components: Components, recipe: Recipe, records: list[dict]) -> list[EpisodeCheck]:
    """An episode per record through `EpisodeRunner`, each checked."""
    runner = EpisodeRunner(engine, components, recipe)
    episodes = runner(records, list(range(len(records))), [recipe.run.seed + i for i in range(len(records))])
    return [checked(runner.format, episode) for episode in episodes]


def checked(chat: ChatFormat, episode: Episode) -> EpisodeCheck:
    info = episode.info
    sampling = sum(any(s.sampled) for s in episode.samples)  # samples with a turn: each turn after a sample's first merged
    return EpisodeCheck(status=episode.status or "ok", failure=episode.failure, reward=episode.reward,
                        requests=int(info.get("agent_requests", 0)), refused=int(info.get("agent_refused", 0)),
                        rewrites=int(info.get("agent_rewrites", 0)), tool_calls=int(info.get("agent_tool_calls", 0)),
                        tool_results=int(info.get("agent_tool_results", 0)), unreadable=episode.unreadable,
                        turns=episode.turns, merged=episode.turns - sampling,
                        samples=tuple(sample_check(chat, s, episode.tools) for s in episode.samples))


def sample_check(chat: ChatFormat, sample: Sample, tools: list[dict]) -> SampleCheck:
    """Whether the sample's ids (prompt, then stream) are its conversation before its last turn
    rendered at once with the generation prompt (`ChatFormat.opening`), then that turn as sampled:
    every turn it trains on was sampled after exactly what a deployed model is shown."""
    if not sample.messages:  # the row of an episode that ended at its reset (a failure, an opening past the context): nothing played
        return SampleCheck(prompt=len(sample.prompt), stream=len(sample.ids), matches=True)
    ids = sample.prompt + sample.ids
    render = chat.opening(sample.messages, tools)
    tail = len(render) - len(sample.prompt)  # where the last turn starts in the stream
    parted = next((i for i, (a, b) in enumerate(zip(ids, render)) if a != b), None)
    if parted is None and len(ids) < len(render):
        parted = len(ids)
    if parted is None and tail >= 0 and all(sample.sampled[tail:]):
        return SampleCheck(prompt=len(sample.prompt), stream=len(sample.ids), matches=True)
    if parted is None:  # the render is a prefix, but more than one turn's sampled ids follow it
        parted = len(render)
    return SampleCheck(prompt=len(sample.prompt), stream=len(sample.ids), matches=False,
                       parting=f"at id {parted} the sample has {_pieces(chat, ids[parted:parted + 6])} where the render has "
                               f"{_pieces(chat, render[parted:parted + 6])}")


def describe(checks: list[EpisodeCheck], harness: str, scored: bool) -> list[str]:
    """The printout: each episode, then the harness's history rewrites over them all."""
    lines = []
    for number, c in enumerate(checks, 1):
        reward = "" if c.status in FAILED else f", reward {c.reward:g} (the harness's" + (
            "; the [reward] table is not scored here)" if scored else ")")
        failure = c.failure.replace("\n", "\n" + " " * 20)  # a traceback's lines under the status
        lines += [f"episode {number}:          status {c.status}{reward}" + (f": {failure}" if failure else ""),
                  f"  requests          {c.requests}, {c.refused} refused",
                  f"  turns             {c.turns}: {c.merged} merged into the stream, {c.splits} started a new sample "
                  f"({c.rewrites} by history rewrites of the harness, {c.template_splits} by the chat template)",
                  f"  tool calls        {c.tool_calls} made by the model, {c.tool_results} answered by the harness "
                  f"with a tool result, {c.unreadable} unreadable (answered as text, with choices[0].tool_call_error)"]
        differing = [(i, s) for i, s in enumerate(c.samples, 1) if not s.matches]
        size = f"{len(c.samples)} sample(s), {sum(s.prompt + s.stream for s in c.samples)} ids"
        if c.status in FAILED:
            lines.append(f"  samples           {size}: kept out of training")
        elif not differing:
            lines.append(f"  samples           {size}: each one's ids are its conversation rendered at once, then its last turn as sampled")
        else:
            lines.append(f"  samples           {size}: " + "; ".join(f"sample {i}'s ids are not its conversation rendered at once ({s.parting})"
                                                             for i, s in differing))
    return lines + harness_lines(checks, harness)


def harness_lines(checks: list[EpisodeCheck], harness: str) -> list[str]:
    """How often the harness changed the history, and what a harness that does it every turn costs."""
    later = [c for c in checks if c.turns > 1]
    turns = sum(c.turns - 1 for c in later)
    rewrites = sum(min(c.rewrites, c.turns - 1) for c in later)
    if not later:
        return [f"harness             no episode went past its first turn: whether {harness} keeps the history is not seen"]
    if not rewrites:
        return [f"harness             kept the conversation as the endpoint returned it in each of its {turns} later turn(s)"]
    if not all(c.every_turn_rewritten for c in later):
        return [f"harness             changed the history in {rewrites} of its {turns} later turn(s): each such turn starts a new training "
                "sample (env/agent_rewrites, env/splits)"]
    samples, ids = sum(len(c.samples) for c in later), sum(c.rendered_again for c in later)
    sampled = sum(s.stream for c in later for s in c.samples)
    return [f"harness             REWRITES THE HISTORY ON EVERY TURN: {harness} changed what came before in each of its {turns} later "
            f"turn(s), so every turn starts a training sample of its own: {samples} samples for {len(later)} episode(s), one an episode "
            f"when turns extend the stream; {ids} prompt ids rendered again for them (the conversation so far, in each new sample's "
            f"prompt, read again by every forward pass), against {sampled} ids in their streams. Send the messages the endpoint "
            "returned as they were, and append to them"]


def failures(checks: list[EpisodeCheck]) -> list[str]:
    """A problem per episode the harness failed: a run keeps it out of training."""
    problems = []
    for number, c in enumerate(checks, 1):
        if c.status in FAILED:
            problems.append(f"$.environment: agent episode {number} of {len(checks)} (record {number} of the data) ended with status "
                            f"{c.status}: {c.failure or 'no reason given'}; a run keeps such episodes out of training "
                            f"(env/status_{c.status})")
    return problems


def _pieces(chat: ChatFormat, ids: list[int]) -> str:
    return " + ".join(repr(chat.decode([i])) for i in ids) or "nothing"
