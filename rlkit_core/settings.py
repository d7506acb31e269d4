"""The settings of other plugins that rlkit itself reads, declared in bases their config classes inherit.

rlkit checks a recipe across tables: a prompt and the longest response must fit the policy's
context, the memory estimate needs the response length and whether activations are checkpointed,
fp16 and FSDP refuse low-precision weights. It reads those settings through these bases' properties
only, never a field by name, so a third-party config gets every such check by inheriting the base.

A base names the settings it reads by the built-in plugins' field names (`reads`). A config
whose field is named otherwise says so in `renamed`; a setting it does not have maps to None, and
rlkit then uses the default in `reads`. The registry checks the names when the plugin registers:

    @attrs.frozen
    class MyGeneratorConfig(SamplingSettings):
        renamed = {"max_new_tokens": "max_tokens", "batch_size": None}
        max_tokens: int = setting(128, help="longest response in tokens")
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import attrs

from rlkit_core.prompts import PromptLengthLimit

__all__ = ["CoreSettings", "EpisodeSettings", "ModelSettings", "PolicySettings", "PromptLengthLimit", "SamplingSettings"]


@attrs.frozen
class CoreSettings:
    """The machinery of the bases below; inherit one of them, not this."""

    reads: ClassVar[Mapping[str, Any]] = {}  # setting rlkit reads, by its built-in name -> the value when a config has none
    renamed: ClassVar[Mapping[str, str | None]] = {}  # built-in name -> this config's field, or None: it has no such setting

    @classmethod
    def field_name(cls, setting: str) -> str | None:
        """The config's field that holds `setting`, for reading it and for locating errors about it."""
        return cls.renamed.get(setting, setting)

    def _value(self, setting: str):
        name = self.field_name(setting)
        return self.reads[setting] if name is None else getattr(self, name)

    @classmethod
    def naming_problems(cls) -> list[str]:
        """What the registry refuses: a renamed setting this base does not read, or a read one the config lacks."""
        fields = {f.name for f in attrs.fields(cls)}
        problems = [f"{cls.__name__}.renamed names {setting!r}, which rlkit does not read from it (it reads: "
                    f"{', '.join(cls.reads)})" for setting in cls.renamed if setting not in cls.reads]
        for setting in cls.reads:
            name = cls.field_name(setting)
            if name is not None and name not in fields:
                problems.append(f"{cls.__name__} has no field {name!r} for the setting {setting!r} that rlkit reads; add it, "
                                f"or say which field holds it in `renamed = {{{setting!r}: 'your_field'}}` (None: it has none)")
        return problems


@attrs.frozen
class SamplingSettings(CoreSettings):
    """A generator's settings that rlkit reads."""

    reads: ClassVar[Mapping[str, Any]] = {"max_new_tokens": 0, "batch_size": 0}

    @property
    def response_limit(self) -> int:
        """The longest response in tokens (0: none known). The prompt-fits-the-context check, the memory
        estimate, DAPO's overlong buffer and Dr. GRPO's default norm count with it."""
        return self._value("max_new_tokens")

    @property
    def generate_batch(self) -> int:
        """Prompts per generate call, for the memory estimate (0: the whole batch at once)."""
        return self._value("batch_size")


@attrs.frozen
class ModelSettings(CoreSettings):
    """A component that loads a transformers model (a policy, a reward model, a critic)."""

    reads: ClassVar[Mapping[str, Any]] = {"model": "", "trust_remote_code": False}

    @property
    def model_name(self) -> str:
        """The model directory or hub name ("" when the component makes its own)."""
        return self._value("model")

    @property
    def runs_model_code(self) -> bool:
        """Whether transformers may run Python code that ships with the model (rlkit check warns)."""
        return self._value("trust_remote_code") is True


@attrs.frozen
class PolicySettings(ModelSettings):
    """A policy's settings that rlkit reads."""

    reads: ClassVar[Mapping[str, Any]] = {**ModelSettings.reads, "dtype": "float32", "gradient_checkpointing": False,
                                          "tokenizer": ""}

    @property
    def tokenizer_name(self) -> str:
        """Where the policy's tokenizer comes from: its own setting, else the model's directory
        ("" when the policy builds both); a separate critic is checked against it."""
        return self._value("tokenizer") or self.model_name

    @property
    def weights_dtype(self) -> str:
        """'float32', 'bfloat16' or 'float16': fp16 mixed precision and FSDP refuse low-precision weights."""
        return self._value("dtype")

    @property
    def checkpoints_activations(self) -> bool:
        """Whether the training forward pass recomputes activations (the memory estimate)."""
        return self._value("gradient_checkpointing")


@attrs.frozen
class EpisodeSettings(CoreSettings):
    """An environment's settings that rlkit reads: the bounds of an episode, which the core's
    episode runner enforces (the environment never sees a token), and how turns are rendered."""

    reads: ClassVar[Mapping[str, Any]] = {"max_turns": 1, "max_episode_tokens": 0, "step_timeout_s": 0.0,
                                          "episode_timeout_s": 0.0, "chat_format": "auto", "call_threads": 64}

    @property
    def turn_limit(self) -> int:
        """The most turns the model takes in an episode."""
        return self._value("max_turns")

    @property
    def episode_token_limit(self) -> int:
        """The most tokens after the first prompt (sampled and environment alike; 0: the generator's
        response limit times the turns). Every turn may sample at most what is left of it."""
        return self._value("max_episode_tokens")

    @property
    def step_timeout(self) -> float:
        """Seconds an environment's `reset` or `step` may take (0: no limit)."""
        return self._value("step_timeout_s")

    @property
    def episode_timeout(self) -> float:
        """Seconds an episode may take from its reset, checked between turns (0: no limit)."""
        return self._value("episode_timeout_s")

    @property
    def call_thread_limit(self) -> int:
        """The most `reset`/`step` calls running at once, hung ones included
        (`rlkit_core.runtime.environment_calls`)."""
        return self._value("call_threads")

    @property
    def format_name(self) -> str:
        """How messages become tokens: "template" (the tokenizer's chat template), "plain" (text
        lines, for models without one) or "auto" (the template when the tokenizer has one)."""
        return self._value("chat_format")


def field_of(config, setting: str) -> str:
    """The name `config` gives `setting`, for an error's location (the built-in name without a base)."""
    return (config.field_name(setting) if isinstance(config, CoreSettings) else None) or setting
