"""Sort-the-numbers as a verifiers (0.4.0) environment, for recipes/grpo_verifiers.toml: a taskset
whose tasks are made here from a seed, scored by its own `@vf.reward`, and a harness that plays each
task as one chat request in this process. Nothing is downloaded, where verifiers' own harnesses
(`null`, `bash`) install their program with uv from the network, and nothing is installed: the
recipe names `build` by its path,

    [environment]
    type = "verifiers"
    environment = "examples/verifiers/sort_numbers.py:build"
    env_args = { num_tasks = 10000, seed = 0 }

and `build` puts this folder on the path, so that verifiers finds the taskset and the harness by
their id, `sort_numbers`, as it finds an installed environment package's (`vf.load_environment`).

Each task gives 4 to 8 whole numbers from 0 to 99 and asks for them sorted from smallest to
largest. The reward `correct` is 1 when the numbers of the reply, in order, are exactly the sorted
ones; the metric `in_place` is the share of the sorted numbers that the reply has in their place.
"""

from __future__ import annotations

import random
import re
import sys
from pathlib import Path
from typing import Any

import verifiers.v1 as vf
from openai import AsyncOpenAI

ID = Path(__file__).stem  # the id verifiers imports the taskset and the harness by
NUMBER = re.compile(r"-?\d+")


def numbers_in(text: str) -> list[int]:
    return [int(found) for found in NUMBER.findall(text)]


class SortData(vf.TaskData):
    numbers: list[int]  # as given; the answer is them sorted


class SortTask(vf.Task[SortData]):
    @vf.reward
    async def correct(self, trace: vf.Trace) -> float:
        return float(numbers_in(trace.last_reply) == sorted(self.data.numbers))

    @vf.metric
    async def in_place(self, trace: vf.Trace) -> float:
        said, right = numbers_in(trace.last_reply), sorted(self.data.numbers)
        return sum(a == b for a, b in zip(said, right)) / len(right)


class SortConfig(vf.TasksetConfig):
    num_tasks: int = 10000
    seed: int = 0  # the same seed makes the same tasks
    min_count: int = 4
    max_count: int = 8
    max_value: int = 99


class SortTaskset(vf.Taskset[SortTask, SortConfig]):
    def load(self):
        config = self.config
        rng = random.Random(f"sort/{config.seed}")
        for index in range(config.num_tasks):
            numbers = [rng.randint(0, config.max_value) for _ in range(rng.randint(config.min_count, config.max_count))]
            prompt = (f"Sort these numbers from smallest to largest: {', '.join(map(str, numbers))}. Reply with the sorted numbers, "
                      "separated by commas, and nothing else.")
            yield SortTask(SortData(prompt=prompt, numbers=numbers, id=f"sort-{config.seed}-{index}"), config.task)


class ChatConfig(vf.HarnessConfig):
    pass


class Chat(vf.Harness[ChatConfig]):
    """One chat request in this process, through the interception's `endpoint` with its `secret`
    (the contract of vf.Harness.launch); its answer is the reply the task scores."""

    APPENDS_SYSTEM_PROMPT = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx: vf.ModelContext, trace: vf.Trace, runtime: vf.Runtime, endpoint: str, secret: str,
                     mcp_urls: dict[str, str], data: vf.TaskData, **kwargs: Any) -> vf.ProgramResult:
        system, prompt = self.resolve_prompt(data)
        messages: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
        messages += [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [m.model_dump(exclude_none=True) for m in prompt or []]
        async with AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0) as client:
            await client.chat.completions.create(model=ctx.model, messages=messages)  # type: ignore[arg-type]
        return vf.ProgramResult(exit_code=0, stdout="", stderr="")


def build(**settings: Any) -> vf.Env:
    """The environment, as the recipe's `environment` names it: `settings` are the taskset's
    (num_tasks, seed, min_count, max_count, max_value)."""
    folder = str(Path(__file__).resolve().parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    config = vf.SingleAgentEnvConfig(taskset={"id": ID, **settings}, agent={"runtime": {"type": "subprocess"}, "harness": {"id": ID}})
    return vf.SingleAgentEnv(config)


__all__ = ["Chat", "SortTaskset"]
