"""skyrl-gym's text environments as the rlkit environment `skyrl-gym`: each episode makes the
skyrl-gym environment for its record with `skyrl_gym.make(env_id, env_config=..., extras=...)`,
opens with its `init(prompt)` and hands each of the model's turns, as text, to its `step`. So the
rewards are skyrl-gym's own and rlkit adds no scoring rule. The record's columns besides its prompt
are the `extras`, as skyrl-gym's own datasets give them (`reward_spec = {ground_truth = ...}`).
The package is imported only when the environment is checked or built, so that `rlkit plugins`
works without it.
"""

from __future__ import annotations

import difflib
import math
from typing import Any

import attrs

from rlkit_core import Environment, RecipeError, Reset, StandardEpisode, Step, building_at, hookimpl, setting

INSTALL = "pip install 'rlkit[skyrl-gym]'"
# the record's columns that are not extras: rlkit's prompt columns, and skyrl-gym's own name of the env
PROMPT_COLUMNS = ("prompt", "messages", "env_class")
# registered in skyrl-gym 0.4.0 but needing more than the package: they may work with what they
# need set up, but rlkit's tests do not run them (`rlkit check` notes it)
NEEDS = {
    "search": "a retrieval server over HTTP (env_config.search_url)",
    "searchcode": "a retrieval server over HTTP, and it runs the model's Python code on this machine",
    "text2sql": "SQLite database files (env_config.db_file_path)",
    "lcb": "it runs the model's code against the record's tests on this machine, unsandboxed",
}


@attrs.frozen
class SkyRLGymConfig(StandardEpisode):
    env_id: str = setting(help="a skyrl-gym environment id, e.g. 'gsm8k' (the keys of skyrl_gym.registry)")
    env_config: dict[str, Any] = setting(factory=dict, help="the environment's `env_config` table, as skyrl-gym passes it "
                                                             "(gsm8k and aime read none)")
    extras: dict[str, Any] = setting(factory=dict, help="extras every record gets, beneath the record's own columns "
                                                         "(e.g. {max_turns = 3} for gsm8k_multi_turn)")


def import_skyrl_gym(where: str):
    try:
        import skyrl_gym
    except ImportError:
        raise RecipeError([f"{where}.type: 'skyrl-gym' needs the skyrl-gym package: {INSTALL}"]) from None
    return skyrl_gym


def known_env(env_id: str, where: str):
    """The skyrl_gym module once `env_id` is registered in it; else a located error with the close ids."""
    skyrl_gym = import_skyrl_gym(where)
    known = sorted(skyrl_gym.registry)
    if env_id not in known:
        close = difflib.get_close_matches(env_id, known, n=3, cutoff=0.5)
        hint = f"did you mean {', '.join(map(repr, close))}?" if close else f"the registered ones: {', '.join(known)}"
        raise RecipeError([f"{where}.env_id: skyrl-gym has no environment {env_id!r}; {hint}"])
    return skyrl_gym


@attrs.define
class Episode:
    """One episode's skyrl-gym environment, closed by the core's `close` however the episode ended."""

    env: Any


def numbers(table: Any) -> dict[str, float]:
    """The finite numbers (bools as 0/1) of a skyrl-gym metadata or metrics dict: what `info` takes."""
    if not isinstance(table, dict):
        return {}
    found = {}
    for key, value in table.items():
        if isinstance(value, (bool, int, float)) and math.isfinite(float(value)):
            found[str(key)] = float(value)
    return found


class SkyRLGym(Environment):
    """A skyrl-gym environment per episode, made from the record's extras; its observations are the
    next messages, its reward is the turn's, its numeric metadata the episode's `info`."""

    requires = {"skyrl_gym": "rlkit[skyrl-gym]"}

    def __init__(self, config: SkyRLGymConfig, context=None):
        self.config = config
        self.where = building_at(context, "environment")
        self.skyrl_gym = known_env(config.env_id, self.where)
        from omegaconf import OmegaConf  # skyrl-gym's envs read env_config as an omegaconf table (`.get`, attributes)

        self.env_config = OmegaConf.create(dict(config.env_config))

    @staticmethod
    def check(config: SkyRLGymConfig, recipe, where: str) -> tuple[list[str], list[str]]:
        """(problems, notes): the package is there and knows `env_id`; an id that needs more than the
        package is noted. The first record's reset is the core's probe."""
        try:
            known_env(config.env_id, where)
        except RecipeError as exc:
            return exc.problems, []
        if config.env_id in NEEDS:
            return [], [f"{where}.env_id: {config.env_id!r} needs {NEEDS[config.env_id]}; rlkit does not test it"]
        return [], []

    def extras(self, record: dict[str, Any]) -> dict[str, Any]:
        """skyrl-gym's `extras` for a record: the table's, then the record's columns besides its prompt."""
        env_class = record.get("env_class")
        if env_class is not None and env_class != self.config.env_id:
            raise RecipeError([f"{self.where}.env_id: is {self.config.env_id!r}, but a record's `env_class` is {env_class!r}; "
                               "one recipe plays one skyrl-gym environment"])
        return {**self.config.extras, **{key: value for key, value in record.items() if key not in PROMPT_COLUMNS}}

    def reset(self, record, seed):
        extras = self.extras(record)
        try:
            env = self.skyrl_gym.make(self.config.env_id, env_config=self.env_config, extras=extras)
        except (AssertionError, KeyError, TypeError) as exc:  # skyrl-gym's envs assert on the extras they need
            columns = ", ".join(sorted(extras)) or "none"
            raise RecipeError([f"{self.where}: skyrl-gym's {self.config.env_id!r} refuses a record's extras (columns: {columns}): "
                               f"{type(exc).__name__}: {exc}; gsm8k and aime read reward_spec = {{ground_truth = ...}} "
                               "(aime: reward_model), and environment.extras adds a table to every record"]) from None
        episode = Episode(env)
        prompt = record["messages"] if record.get("prompt") is None and "messages" in record else [{"role": "user", "content": record["prompt"]}]
        messages, metadata = env.init([dict(message) for message in prompt])
        return Reset([dict(message) for message in messages], episode, info=numbers(metadata))

    def step(self, state: Episode, reply):
        out = state.env.step(reply.text)
        done = bool(out["done"])
        info = numbers(out.get("metadata"))
        if done:
            info.update(numbers(state.env.get_metrics()) if hasattr(state.env, "get_metrics") else {})
        reward = out["reward"]
        return Step(messages=[dict(message) for message in out["observations"] or []],
                    reward=None if reward is None else float(reward), done=done, info=info)


    def close(self, state: Episode) -> None:
        state.env.close()


@hookimpl
def register_environments(register):
    register("skyrl-gym", SkyRLGym, SkyRLGymConfig)
