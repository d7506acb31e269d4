"""The contract kit's own parts for the tables a recipe must have besides the one under test: a
prompt source, a reward and a tracker that do nothing worth testing, so that a contract test
depends on no task's plugins. The kit adds them to its registry (`add_to`) as the plugin
`rlkit-contract-kit`."""

from __future__ import annotations

import attrs

from rlkit_core import Component, PromptSource, RewardSource, SilentTracker, __version__, setting
from rlkit_core.recipe.registry import Registry

PLUGIN = "rlkit-contract-kit"
PROMPTS, REWARD, TRACKER = "rlkit-contract-prompts", "rlkit-contract-reward", "rlkit-contract-tracker"


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


class StandInTracker(SilentTracker):
    """Records nothing."""

    def __init__(self, config: NoSettings, context=None):
        self.config = config


def add_to(registry: Registry) -> None:
    """Register the stand-ins in `registry`, unless it has them already."""
    for kind, name, factory, config_class in (("prompt_source", PROMPTS, StandInPrompts, StandInPromptsConfig),
                                               ("reward", REWARD, StandInReward, NoSettings),
                                               ("tracker", TRACKER, StandInTracker, NoSettings)):
        if registry.find(kind, name) is None:
            registry.add(Component(kind, name, factory, config_class, PLUGIN, "rlkit", __version__))
