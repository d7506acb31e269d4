"""OpenEnv environments for tests/test_openenv.py, written with OpenEnv's own server API
(`openenv.core.env_server`): `slow_app`, a text environment that can be told to hang, and
`tools_app`, an MCP environment (`MCPEnvironment`) whose tools give rewards, and `one_app`, the
text environment with OpenEnv's default of one session at a time. `app` serves the three under
/slow, /tools and /one (`uvicorn openenv_servers:app`); `Slow` and `Tools` are also played in process."""

from __future__ import annotations

import time
from typing import Any
from uuid import uuid4

from fastmcp import FastMCP
from openenv.core.env_server import Action, CallToolAction, CallToolObservation, Environment, Observation, State, create_app
from openenv.core.env_server.mcp_environment import MCPEnvironment
from starlette.applications import Starlette
from starlette.routing import Mount


class SlowAction(Action):
    message: str


class SlowObservation(Observation):
    text: str = ""


class Slow(Environment):
    """Says back what it was told; "hang" makes the step sleep for 30 s first."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        super().__init__()
        self._state = State(episode_id=str(uuid4()))

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> SlowObservation:
        return SlowObservation(text="say something")

    def step(self, action: SlowAction, timeout_s: float | None = None, **kwargs: Any) -> SlowObservation:  # type: ignore[override]
        if action.message == "hang":
            time.sleep(30)
        return SlowObservation(text=action.message, reward=1.0)

    @property
    def state(self) -> State:
        return self._state


class NumberObservation(Observation):
    prompt: str = ""


class Tools(MCPEnvironment):
    """A number to find with two tools: `hint` says higher or lower (no reward), `submit` ends the
    episode with reward 1 when right and 0 when wrong. The number comes from reset's `secret`."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        self.secret = 0
        mcp = FastMCP("numbers")

        @mcp.tool
        def hint(guess: int) -> str:
            """Whether the secret number is higher or lower than a guess."""
            return "right" if guess == self.secret else ("higher" if self.secret > guess else "lower")

        @mcp.tool
        def submit(answer: int) -> str:
            """Give the answer; this ends the game."""
            return "right" if answer == self.secret else "wrong"

        super().__init__(mcp)
        self._state = State(episode_id=str(uuid4()))

    def reset(self, seed: int | None = None, episode_id: str | None = None, secret: int = 5, **kwargs: Any) -> Observation:
        self.secret = int(secret)
        self._state = State(episode_id=str(uuid4()))
        return NumberObservation(prompt="Find the number between 1 and 9.", metadata={"tools": 2})

    def ended(self, observation: Observation, action: Action) -> Observation:
        """`submit` ends the episode and scores it: 1 when right."""
        if isinstance(action, CallToolAction) and action.tool_name == "submit" and isinstance(observation, CallToolObservation):
            observation.done = True
            observation.reward = 1.0 if action.arguments.get("answer") == self.secret else 0.0
        return observation

    def step(self, action: Action, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        return self.ended(super().step(action, timeout_s=timeout_s, **kwargs), action)

    async def step_async(self, action: Action, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        return self.ended(await super().step_async(action, timeout_s=timeout_s, **kwargs), action)

    def _step_impl(self, action: Action, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        return Observation(metadata={"error": f"no such action: {type(action).__name__}"})

    @property
    def state(self) -> State:
        return self._state


def slow() -> Slow:
    return Slow()


def tools() -> Tools:
    return Tools()


slow_app = create_app(Slow, SlowAction, SlowObservation, env_name="slow", max_concurrent_envs=16)
one_app = create_app(Slow, SlowAction, SlowObservation, env_name="one", max_concurrent_envs=1)  # OpenEnv's default: one session
tools_app = create_app(Tools, CallToolAction, CallToolObservation, env_name="tools", max_concurrent_envs=16)
# all three in one process, each under its own path: its base URL is the server's and the path
app = Starlette(routes=[Mount("/slow", app=slow_app), Mount("/one", app=one_app), Mount("/tools", app=tools_app)])
