"""The contract kit's own parts for the tables a recipe must have besides the one under test: a
policy on a model directory (the tiny model the kit writes), a prompt source, a reward and a
tracker, each as plain as its kind allows, so that a contract test depends on no task's plugins. The kit
adds them to its registry (`add_to`) as the plugin `rlkit-contract-kit`. And what a batch source is
given to sample with, for its contract (`SamplingStandIn`)."""

from __future__ import annotations

import copy
from types import SimpleNamespace
from typing import Any

import attrs
import torch

from rlkit_core import (
    Component,
    ModelSettings,
    NullTracker,
    Policy,
    PolicyOutput,
    PolicySettings,
    PromptSource,
    RewardSource,
    __version__,
    setting,
    switch_off_dropout,
)
from rlkit_core.hf import DTYPES, context_length, settle_pad, shard_units
from rlkit_core.recipe.registry import Registry

PLUGIN = "rlkit-contract-kit"
POLICY, PROMPTS = "rlkit-contract-policy", "rlkit-contract-prompts"
REWARD, TRACKER = "rlkit-contract-reward", "rlkit-contract-tracker"


@attrs.frozen
class StandInPolicyConfig(PolicySettings, ModelSettings):
    model: str = setting(help="a local transformers causal LM directory, with its tokenizer", kw_only=True)


class StandInPolicy(Policy):
    """A transformers causal LM, every weight trained, a frozen copy as its reference."""

    def __init__(self, config: StandInPolicyConfig, context=None):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.config = config
        self.tokenizer = AutoTokenizer.from_pretrained(config.tokenizer or config.model, trust_remote_code=config.trust_remote_code)
        self.tokenizer.padding_side = "left"
        model = AutoModelForCausalLM.from_pretrained(config.model, dtype=DTYPES[config.dtype], trust_remote_code=config.trust_remote_code)
        if config.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.eos_token_ids = (self.tokenizer.eos_token_id,)
        if settle_pad(self.tokenizer, self.eos_token_ids):
            self.suppressed_token_ids = (self.tokenizer.pad_token_id,)
            model.resize_token_embeddings(len(self.tokenizer))
        model.config.pad_token_id = self.tokenizer.pad_token_id
        switch_off_dropout(model)
        self.context_length = context_length(model.config)
        self._model = model.to(context.device) if context is not None else model
        self._reference = copy.deepcopy(self._model).eval().requires_grad_(False)

    @property
    def model(self) -> torch.nn.Module:
        return self._model

    def shard_units(self) -> list[type]:
        return shard_units(self._model)

    def forward(self, input_ids, attention_mask, position_ids, start: int = 0) -> PolicyOutput:
        out = self._model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False,
                          output_hidden_states=True)
        return PolicyOutput(logits=out.logits[:, start:], hidden=out.hidden_states[-1])

    @torch.no_grad()
    def reference_logits(self, input_ids, attention_mask, position_ids, start: int = 0) -> torch.Tensor:
        return self._reference(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False).logits[:, start:]

    def parameters(self):
        return list(self._model.parameters())

    def state_dict(self):
        return {name: p.detach().clone() for name, p in self._model.named_parameters()}

    def load_state_dict(self, state) -> None:
        with torch.no_grad():
            for name, p in self._model.named_parameters():
                p.copy_(state[name])

    def save_pretrained(self, path: str, merge_adapters: bool = True) -> None:
        self._model.save_pretrained(path)
        self.tokenizer.save_pretrained(path)


@attrs.frozen
class StandInPromptsConfig:
    size: int = setting(16, help="prompt records to make")


class StandInPrompts(PromptSource):
    """`size` short prompts, each with a `reference` column."""

    def __init__(self, config: StandInPromptsConfig, context=None):
        self.config = config

    def load(self):
        return [{"prompt": f"Item {index}:", "reference": f"item {index}"} for index in range(self.config.size)]


@attrs.frozen
class NoSettings:
    """A stand-in that takes no settings."""


class StandInReward(RewardSource):
    """The length of each response in characters, over 100."""

    def __init__(self, config: NoSettings, context=None):
        self.config = config

    def score(self, prompts, responses, **columns):
        return [len(response) / 100 for response in responses]


def add_to(registry: Registry) -> None:
    """Register the stand-ins in `registry`, unless it has them already."""
    for kind, name, factory, config_class in (("policy", POLICY, StandInPolicy, StandInPolicyConfig),
                                               ("prompt_source", PROMPTS, StandInPrompts, StandInPromptsConfig),
                                               ("reward", REWARD, StandInReward, NoSettings),
                                               ("tracker", TRACKER, NullTracker, NoSettings)):
        if registry.find(kind, name) is None:
            registry.add(Component(kind, name, factory, config_class, PLUGIN, "rlkit", __version__))


@attrs.frozen
class SamplingStandIn:
    """The view a batch source samples with (`rlkit_core.runtime.batch_sources.SamplingView`), as
    far as a contract needs it: `records(j)`, and `rollout(j)` a scored batch of them (the kit's
    `rollout_batch`, drawn from j), `engine.processes` one process, the recipe and the build
    context; no components, no rollout engine beyond that."""

    recipe: Any
    context: Any
    engine: Any = SimpleNamespace(processes=SimpleNamespace(index=0, count=1, is_main=True))
    components: Any = None

    def records(self, iteration: int) -> list[dict]:
        return [{"prompt": f"prompt {group}", "reference": f"ref {group}"} for group in range(3)]

    def rollout(self, iteration: int, components: Any = None, engine: Any = None):
        from rlkit_core.testing import rollout_batch

        batch = rollout_batch(seed=iteration)
        assert batch.scores is not None  # the kit's batch is scored
        return batch, {"score/mean": float(batch.scores.mean())}
