"""The `agent` environment: an agent rlkit did not write (a harness) plays each episode through
the OpenAI-compatible endpoint (`rlkit_core.endpoint`), unchanged.

The harness is either a Python callable, `harness = "package.module:function"` or
`"path/to/agent.py:function"`, called once per episode as `function(record, client)` with the prompt
record and an `openai.OpenAI` client bound to the episode's session; or a command, `command =
["python", "agent.py"]`, run once per episode with `OPENAI_BASE_URL`, `OPENAI_API_KEY` and
`RLKIT_RECORD` (the record as JSON) in its environment and the record on its stdin. The callable
returns the episode's reward, or a dict with `"reward"` and other figures (each averaged into
`env/<name>`); the command prints that as its last line (a number, or a JSON object).

How an episode runs, and how each failure of a harness becomes a status, is
`rlkit_core.harness.HarnessEnvironment`'s, which this environment is.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs

from rlkit_core import HarnessEnvironment, HarnessSettings, RecipeError, building_at, hookimpl, load_module, setting


@attrs.frozen
class AgentConfig(HarnessSettings):
    harness: str = setting("", help="the agent as a Python callable 'package.module:function' or 'path/to/agent.py:function' (from the "
                               "working directory), called once per episode with the record and an openai.OpenAI client; it returns "
                               "the reward, or a dict with 'reward' and other figures")
    command: list[str] = setting(factory=list, help="the agent as a command run once per episode, with OPENAI_BASE_URL, OPENAI_API_KEY "
                                                    "and RLKIT_RECORD set and the record as JSON on stdin; its last line of output is "
                                                    "the reward (a number or a JSON object with 'reward')")
    model: str = setting("policy", help="the model name the endpoint lists and answers as")


def load_harness(spec: str, where: str) -> Callable:
    """The callable `spec` names: 'package.module:function' or 'path/to/file.py:function'."""
    module_name, _, name = spec.rpartition(":")
    if not module_name or not name:
        raise RecipeError([f"{where}.harness: {spec!r} is not 'package.module:function' or 'path/to/agent.py:function'"])
    try:
        module = load_module(module_name, "rlkit_harness")
    except Exception as exc:
        raise RecipeError([f"{where}.harness: {module_name!r} could not be loaded ({type(exc).__name__}: {exc}); "
                           f"{loading_hint(module_name, name, exc)}"]) from None
    function = getattr(module, name, None)
    if not callable(function):
        raise RecipeError([f"{where}.harness: {module_name!r} has no callable {name!r}"])
    return function


def loading_hint(module_name: str, name: str, exc: Exception) -> str:
    """The fix for a harness that did not load. A module that is not found although it is in the
    working directory: the `rlkit` command (a console script) does not put the working directory on
    Python's path, as `python -m` and pytest do."""
    missing = getattr(exc, "name", None) if isinstance(exc, ModuleNotFoundError) else None
    here = Path(*module_name.split("."))
    found = next((f for f in (here.with_suffix(".py"), here / "__init__.py") if f.is_file()), None) if not module_name.endswith(".py") else None
    if missing and found is not None and (module_name == missing or module_name.startswith(f"{missing}.")):
        return (f"it is in the working directory ({found}), which the rlkit command does not put on Python's path: run with "
                f"PYTHONPATH=. or name the file, harness = '{here.with_suffix('.py')}:{name}'")
    return "name an importable module or a file relative to the working directory"


class Agent(HarnessEnvironment):
    """The recipe's agent per episode, through the endpoint (see the module)."""

    requires = {"openai": "rlkit[agents]", "starlette": "rlkit[agents]", "uvicorn": "rlkit[agents]"}

    def __init__(self, config: AgentConfig, context=None):
        where = building_at(context, "environment")
        if bool(config.harness) == bool(config.command):
            raise RecipeError([f"{where}: name the agent as exactly one of 'harness' (a Python callable) and 'command' (a program)"])
        self.function = load_harness(config.harness, where) if config.harness else None
        if self.function is not None:
            try:
                import openai  # noqa: F401
            except ImportError:
                raise RecipeError([f"{where}.harness: a Python harness is handed an openai.OpenAI client, and the openai package is "
                                   "not installed; pip install 'rlkit[agents]' (or use 'command')"]) from None
        super().__init__(config, context, model=config.model)
        self.config = config

    def play(self, record: dict[str, Any], client: Any) -> Any:
        assert self.function is not None
        return self.function(record, client)

    def command(self, record: dict[str, Any]) -> list[str] | None:
        return list(self.config.command) or None


@hookimpl
def register_environments(register):
    register("agent", Agent, AgentConfig)
