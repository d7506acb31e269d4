"""The multi-turn default recipe's parts: the `guess-number` environment, its games
(`guess-number-games`), and a byte-level policy warm-started on games played at random
(`warm-start-guesser`). Everything is made here, offline.

The environment thinks of a number from `low` to `high`; the model says a number each turn and is
told "higher" or "lower", with the range still open ("higher: 9-16"), until it says the number or
its turns run out. Each wrong guess costs `turn_cost`, the right one earns 1. Halving the open range
every turn (binary search) is optimal: over 1..16 it wins every game within 5 turns, in 3.375 turns
on average (one game in 16 needs the fifth), so its mean return is 1 − 2.375 · turn_cost.

The warm start is trained on games whose guesses are drawn uniformly from the open range: it learns
the format and to stay inside the range. Played exactly so, such guessing wins 77% of games within
5 turns and takes 3.81 turns a game; PPO then has to learn to aim for the middle.
"""

from __future__ import annotations

import random
import re

import attrs

from rlkit_core import (
    Environment,
    PromptSource,
    RecipeError,
    Reset,
    StandardEpisode,
    Step,
    at_least,
    building_at,
    chat_format_for,
    greater_than,
    hookimpl,
    setting,
)

from .warm_start import Example, WarmStartConfig, WarmStartPolicy

NUMBER = re.compile(r"\s*(\d{1,3})\s*")


def opening(low: int, high: int) -> str:
    return f"Guess my number, {low}-{high}."


def feedback(guess: int, secret: int, low: int, high: int) -> tuple[str, int, int]:
    """What the environment says to a wrong guess inside the range, and the range left open."""
    if guess < secret:
        return f"higher: {guess + 1}-{high}", guess + 1, high
    return f"lower: {low}-{guess - 1}", low, guess - 1


@attrs.frozen
class GuessNumberConfig(StandardEpisode):
    max_turns: int = setting(5, help="guesses before the game is lost (binary search needs 5 over 1..16)", validator=greater_than(0))
    low: int = setting(1, help="the smallest number the environment may think of")
    high: int = setting(16, help="the largest number the environment may think of")
    turn_cost: float = setting(0.1, help="reward of each wrong guess (negated): the fewer turns to win, the higher the return",
                               validator=at_least(0))


@attrs.define
class Game:
    secret: int
    low: int
    high: int
    turns: int = 0


class GuessNumber(Environment):
    """Higher/lower feedback with the open range; the secret is the record's `secret` column."""

    def __init__(self, config: GuessNumberConfig, context=None):
        if config.high <= config.low:
            raise RecipeError([f"{building_at(context, 'environment')}.high: {config.high} is not above low={config.low}"])
        self.config = config
        self.where = building_at(context, "environment")

    def reset(self, record, seed):
        secret = record.get("secret")
        if not isinstance(secret, int) or not self.config.low <= secret <= self.config.high:
            raise RecipeError([f"{self.where}: a record's 'secret' column is {secret!r}, not a number from "
                               f"{self.config.low} to {self.config.high}"])
        return Reset([{"role": "user", "content": opening(self.config.low, self.config.high)}],
                     Game(secret, self.config.low, self.config.high), info={"won": 0.0})

    def step(self, state: Game, reply):
        state.turns += 1
        match = NUMBER.fullmatch(reply.text)
        guess = int(match.group(1)) if match else None
        if guess == state.secret:
            return Step(reward=1.0, done=True, info={"won": 1.0, "turns_to_win": float(state.turns), "in_range": 1.0})
        in_range = guess is not None and state.low <= guess <= state.high
        if in_range:
            assert guess is not None
            text, state.low, state.high = feedback(guess, state.secret, state.low, state.high)
        else:
            text = f"say a number: {state.low}-{state.high}"
        return Step(messages=[{"role": "user", "content": text}], reward=-self.config.turn_cost,
                    info={"won": 0.0, "in_range": float(in_range)})


@attrs.frozen
class GamesConfig:
    size: int = setting(4096, help="games to generate", validator=greater_than(0))
    seed: int = setting(0, help="seed of the secrets (the same seed gives the same games)")
    low: int = setting(1, help="the smallest secret")
    high: int = setting(16, help="the largest secret")


class Games(PromptSource):
    def __init__(self, config: GamesConfig, context=None):
        self.config = config

    def load(self):
        rng = random.Random(f"games/{self.config.seed}")
        low, high = self.config.low, self.config.high
        return [{"prompt": opening(low, high), "secret": rng.randint(low, high)} for _ in range(self.config.size)]


def random_game(rng: random.Random, low: int, high: int, max_turns: int) -> list[tuple[str, str]]:
    """A game with guesses drawn uniformly from the open range: (guess, the environment's answer)
    per turn, the last answer "" when the guess won."""
    secret, turns = rng.randint(low, high), []
    for _ in range(max_turns):
        guess = rng.randint(low, high)
        if guess == secret:
            turns.append((str(guess), ""))
            break
        text, low, high = feedback(guess, secret, low, high)
        turns.append((str(guess), text))
    return turns


def sft_examples(tokenizer, size: int, seed: int, low: int = 1, high: int = 16, max_turns: int = 5) -> list[Example]:
    """Games played at random, rendered by the same chat format as the episodes (so the warm start
    sees the tokens it will meet), each with the mask of the tokens the loss counts: the guesses and
    their end tokens."""
    rng = random.Random(f"sft/{seed}")
    eos = tokenizer.eos_token_id
    plain = chat_format_for("plain", tokenizer, (eos,))
    examples = []
    for _ in range(size):
        ids = plain.opening([{"role": "user", "content": opening(low, high)}], [])
        counted = [False] * len(ids)
        history: list[dict] = [{"role": "user", "content": opening(low, high)}]
        for guess, answer in random_game(rng, low, high, max_turns):
            sampled = tokenizer(guess, add_special_tokens=False)["input_ids"] + [eos]
            ids, counted = ids + sampled, counted + [True] * len(sampled)
            history.append({"role": "assistant", "content": guess})
            if answer:
                bridge = plain.bridge(ids, history, [{"role": "user", "content": answer}], [])
                assert bridge is not None  # the plain format always extends the stream
                ids, counted = ids + bridge, counted + [False] * len(bridge)
                history.append({"role": "user", "content": answer})
        examples.append((ids, counted))
    return examples


@attrs.frozen
class GuesserConfig(WarmStartConfig):
    sft_steps: int = setting(600, help="supervised steps on games played at random", validator=at_least(0))


class WarmStartGuesser(WarmStartPolicy):
    """The warm start supervised on games played at random (`sft_examples`)."""

    @staticmethod
    def folder_name(config) -> str:
        return f"guesser-l{config.n_layer}-d{config.n_embd}-h{config.n_head}-s{config.sft_steps}-seed{config.seed}"

    @staticmethod
    def corpus(config) -> dict:
        # as its builds have recorded it since the warm start knew no task but the summaries (whose
        # prompt separator and filler share it holds): kept, so that cached builds are reused
        return {"prompt_separator": "\nSummary: ", "filler_share": 0.0, "corpus": "guess-number"}

    @staticmethod
    def examples(config, tokenizer, size: int, seed: int) -> list[Example]:
        return sft_examples(tokenizer, size, seed)


@hookimpl
def register_environments(register):
    register("guess-number", GuessNumber, GuessNumberConfig)


@hookimpl
def register_prompt_sources(register):
    register("guess-number-games", Games, GamesConfig)


@hookimpl
def register_policies(register):
    register("warm-start-guesser", WarmStartGuesser, GuesserConfig)

