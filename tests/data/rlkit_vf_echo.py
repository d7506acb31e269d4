"""A verifiers (0.4.0) environment for the tests of the `verifiers` environment, built as a verifiers
environment package is (`vf init`): a module exporting its `vf.Taskset` and the `vf.Harness` it
bundles through `__all__`, so that `vf.load_environment` finds both by the id `rlkit_vf_echo`
(the tests put tests/data on the path). Nothing is downloaded: the tasks are made here, and the
harness is an in-process chat loop, where verifiers' own `bash` and `null` harnesses install
their program with uv from the network.

Each task asks the model to say `answer`; `correct` (weight 1) is 1 when the last reply is the
answer, `polite` (weight 0.5) when it says please, and the metric `words` counts the last reply's
words. The harness speaks `turns` times, saying "again" between them, as an OpenAI client:
streamed (`stream = true`) or whole, with the extra request fields `request` names."""

from __future__ import annotations

import asyncio
from typing import Any

import verifiers.v1 as vf
from openai import AsyncOpenAI

WORDS = ["7", "8", "fig", "plum", "7 please", "seven"]


class EchoData(vf.TaskData):
    answer: str
    turns: int = 1
    broken: bool = False  # the reward raises: scoring fails


class EchoTask(vf.Task[EchoData]):
    @vf.reward
    async def correct(self, trace: vf.Trace) -> float:
        if self.data.broken:
            raise ValueError("the scorer broke")
        return float(trace.last_reply == self.data.answer)

    @vf.reward(weight=0.5)
    async def polite(self, trace: vf.Trace) -> float:
        return float("please" in trace.last_reply)

    @vf.metric
    async def words(self, trace: vf.Trace) -> float:
        return float(len(trace.last_reply.split()))


class EchoConfig(vf.TasksetConfig):
    num_tasks: int = 4
    turns: int = 1
    system_prompt_text: str = ""
    infinite: bool = False


class EchoTaskset(vf.Taskset[EchoTask, EchoConfig]):
    @property
    def INFINITE(self) -> bool:  # type: ignore[override]  # noqa: N802 (verifiers' name)
        return self.config.infinite

    def load(self):
        index = 0
        while self.config.infinite or index < self.config.num_tasks:
            word = WORDS[index % len(WORDS)]
            data = EchoData(prompt=f"Say {word}.", answer=word, turns=self.config.turns, id=f"echo-{index}",
                            system_prompt=self.config.system_prompt_text or None)
            yield EchoTask(data, self.config.task)
            index += 1


LOOKUP = {"type": "function", "function": {"name": "lookup", "description": "Look a word up.",
                                           "parameters": {"type": "object", "properties": {"word": {"type": "string"}},
                                                          "required": ["word"]}}}


class ChatHarnessConfig(vf.HarnessConfig):
    stream: bool = False
    request: dict[str, Any] = {}
    tools: bool = False  # offer `lookup`, answer each call by its id with "found", until a turn makes none
    hang: bool = False  # after the first answer, wait for ever


class ChatHarness(vf.Harness[ChatHarnessConfig]):
    """A chat loop in this process: every model call goes through the interception's `endpoint`
    with its `secret`, which is the contract (vf.Harness.launch)."""

    APPENDS_SYSTEM_PROMPT = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx: vf.ModelContext, trace: vf.Trace, runtime: vf.Runtime, endpoint: str, secret: str,
                     mcp_urls: dict[str, str], data: vf.TaskData, **kwargs: Any) -> vf.ProgramResult:
        system, prompt = self.resolve_prompt(data)
        messages: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
        messages += [{"role": "user", "content": prompt}] if isinstance(prompt, str) else \
            [m.model_dump(exclude_none=True) for m in prompt or []]
        async with AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0) as client:
            for turn in range(getattr(data, "turns", 1)):
                if turn:
                    messages.append({"role": "user", "content": "again"})
                while True:
                    reply = await self.ask(client, ctx.model, messages)
                    messages.append(reply)
                    if self.config.hang:
                        await asyncio.sleep(3600)
                    if not reply.get("tool_calls"):
                        break
                    messages += [{"role": "tool", "tool_call_id": call["id"], "content": "found"} for call in reply["tool_calls"]]
        return vf.ProgramResult(exit_code=0, stdout="", stderr="")

    async def ask(self, client: AsyncOpenAI, model: str, messages: list[dict[str, Any]]) -> dict[str, Any]:
        fields = {**self.config.request, **({"tools": [LOOKUP]} if self.config.tools else {})}
        if not self.config.stream:
            reply = await client.chat.completions.create(model=model, messages=messages, **fields)  # type: ignore[arg-type]
            return reply.choices[0].message.model_dump(exclude_none=True)
        stream = await client.chat.completions.create(model=model, messages=messages, stream=True,  # type: ignore[arg-type]
                                                      stream_options={"include_usage": True}, **fields)
        message: dict[str, Any] = {"role": "assistant", "content": ""}
        calls: dict[int, dict[str, Any]] = {}
        async for chunk in stream:
            if not chunk.choices:
                continue
            delta = chunk.choices[0].delta
            message["content"] += delta.content or ""
            for call in delta.tool_calls or []:
                entry = calls.setdefault(call.index, {"id": "", "type": "function", "function": {"name": "", "arguments": ""}})
                entry["id"] += call.id or ""
                entry["function"]["name"] += call.function.name or "" if call.function else ""
                entry["function"]["arguments"] += call.function.arguments or "" if call.function else ""
        if calls:
            message["tool_calls"] = [calls[index] for index in sorted(calls)]
        return message


def build(**settings: Any) -> vf.Env:
    """The environment in code, as a recipe's `environment = "rlkit_vf_echo:build"` names it:
    `settings` are the taskset's (num_tasks, turns, ...), and `harness` the harness's."""
    harness = settings.pop("harness", {})
    config = vf.SingleAgentEnvConfig(taskset={"id": "rlkit_vf_echo", **settings},
                                     agent={"runtime": {"type": "subprocess"}, "harness": {"id": "rlkit_vf_echo", **harness}})
    return vf.SingleAgentEnv(config)


__all__ = ["ChatHarness", "EchoTaskset"]
