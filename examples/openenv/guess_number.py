"""Guess-the-number as an OpenEnv environment, written with OpenEnv's own server API
(`openenv.core.env_server`) as an `openenv init` environment is, for recipes/grpo_openenv.toml. It
thinks of a number, the model guesses, and it answers "higher: 51-100" or "lower: 1-49" (the range
still open) until the model says the number or its guesses run out. rlkit plays it in process, one
instance per episode, through the `openenv` environment's `factory`:

    [environment]
    type = "openenv"
    factory = "examples/openenv/guess_number.py:make"
    action_class = "examples/openenv/guess_number.py:GuessAction"
    observation_field = "prompt"
    reset_columns = ["secret"]        # the game: the record's secret, so a group's episodes play the same one

The same class serves over HTTP, as every OpenEnv environment does, for `url = ...` in place of the
factory: `uvicorn guess_number:app --factory --app-dir examples/openenv --port 8000` (its `app`
builds OpenEnv's server). Nothing here knows about rlkit.

A reply is a guess when it is a whole number and nothing else (a trailing full stop allowed); any
other reply is told so and counts as a guess. The right guess earns 1 and ends the game; a wrong
one costs `TURN_COST`; the game ends after `MAX_GUESSES`. Binary search wins every game of 1-100
within 7 guesses. The metadata's numbers, `won` and `guesses`, are rlkit's `env/won` and
`env/guesses`.
"""

from __future__ import annotations

import random
import re
from typing import Any
from uuid import uuid4

from openenv.core.env_server import Action, Environment, Observation, State

LOW, HIGH = 1, 100  # the numbers it may think of, unless reset is given others
MAX_GUESSES = 7  # binary search needs 7 over 1-100: the recipe's environment.max_turns
TURN_COST = 0.05  # reward of each wrong guess (negated): the fewer guesses, the higher the return
NUMBER = re.compile(r"\s*(\d{1,4})\.?\s*")


class GuessAction(Action):
    message: str  # the model's reply, as rlkit's `text_field` puts it


class GuessObservation(Observation):
    prompt: str = ""  # what the model reads: rlkit's `observation_field`


class GuessNumber(Environment):
    """One game per instance; its state is the secret and the range still open."""

    SUPPORTS_CONCURRENT_SESSIONS = True  # served, each session has an instance of its own

    def __init__(self):
        super().__init__()
        self._state = State(episode_id=str(uuid4()))
        self.secret, self.low, self.high, self.guesses = LOW, LOW, HIGH, 0

    def reset(self, seed: int | None = None, episode_id: str | None = None, secret: int | None = None, low: int = LOW, high: int = HIGH,
              **kwargs: Any) -> GuessObservation:
        """A new game: `secret` when given (a record's), else drawn from `seed`."""
        if high <= low:
            raise ValueError(f"high ({high}) must be above low ({low})")
        self.low, self.high, self.guesses = int(low), int(high), 0
        self.secret = random.Random(seed).randint(self.low, self.high) if secret is None else int(secret)
        if not self.low <= self.secret <= self.high:
            raise ValueError(f"the secret {self.secret} is not within {self.low}-{self.high}")
        self._state = State(episode_id=episode_id or str(uuid4()))
        text = (f"I am thinking of a whole number from {self.low} to {self.high}. Guess it: reply with the number alone. After each "
                f"guess I say higher or lower, and the range still open. You have {MAX_GUESSES} guesses.")
        return GuessObservation(prompt=text, metadata={"won": 0, "guesses": 0})

    def step(self, action: GuessAction, timeout_s: float | None = None, **kwargs: Any) -> GuessObservation:  # type: ignore[override]
        self.guesses += 1
        self._state.step_count = self.guesses
        match = NUMBER.fullmatch(action.message)
        guess = int(match.group(1)) if match else None
        if guess == self.secret:
            return GuessObservation(prompt="right", reward=1.0, done=True, metadata={"won": 1, "guesses": self.guesses})
        if guess is not None and self.low <= guess <= self.high:
            if guess < self.secret:
                text, self.low = "higher", guess + 1
            else:
                text, self.high = "lower", guess - 1
            text = f"{text}: {self.low}-{self.high}"
        else:
            text = f"say one number from {self.low} to {self.high}, and nothing else"
        left = MAX_GUESSES - self.guesses
        return GuessObservation(prompt=f"{text} ({left} guess{'es' if left != 1 else ''} left)", reward=-TURN_COST, done=left == 0,
                                metadata={"won": 0, "guesses": self.guesses})

    @property
    def state(self) -> State:
        return self._state


def make() -> GuessNumber:
    """The factory rlkit calls once per episode."""
    return GuessNumber()


def app():
    """OpenEnv's server for the environment (`uvicorn ... --factory`): a session per episode."""
    from openenv.core.env_server import create_app

    return create_app(GuessNumber, GuessAction, GuessObservation, env_name="guess_number", max_concurrent_envs=256)
