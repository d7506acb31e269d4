"""A third-party plugin written with `rlkit_core`'s one import (tests/test_third_party.py installs
it): a policy and a generator whose configs inherit the settings bases, so that rlkit reads their
model, dtype, checkpointing and response length as it reads the built-ins', and a group estimator.
The policy and generator hand their work to the built-in `hf` classes."""

import attrs
import torch
from rlkit_plugins.hf_generator import HFGenerator, HFGeneratorConfig
from rlkit_plugins.hf_policy import HFPolicy, HFPolicyConfig

from rlkit_core import (
    AdvantageEstimator,
    ModelSettings,
    PolicySettings,
    SamplingSettings,
    greater_than,
    hookimpl,
    setting,
)


@attrs.frozen
class LMConfig(PolicySettings, ModelSettings):
    pass


def as_hf(config: LMConfig) -> HFPolicyConfig:
    return HFPolicyConfig(model=config.model, tokenizer=config.tokenizer, dtype=config.dtype,
                          gradient_checkpointing=config.gradient_checkpointing, trust_remote_code=config.trust_remote_code)


class LM(HFPolicy):
    def __init__(self, config: LMConfig, context=None):
        super().__init__(as_hf(config), context)

    @staticmethod
    def check(config, recipe, where):
        return HFPolicy.check(as_hf(config), recipe, where)

    @staticmethod
    def shape(config):
        return HFPolicy.shape(as_hf(config))

    @staticmethod
    def describe(config):
        return HFPolicy.describe(as_hf(config))


@attrs.frozen
class SamplerConfig(SamplingSettings):
    max_new_tokens: int = setting(16, help="longest response in tokens", validator=greater_than(0))


class Sampler(HFGenerator):
    def __init__(self, config: SamplerConfig, context):
        super().__init__(HFGeneratorConfig(max_new_tokens=config.max_new_tokens, batch_size=config.batch_size), context)


@attrs.frozen
class CentredConfig:
    scale: float = setting(1.0, help="advantages are multiplied by this", validator=greater_than(0))


class Centred(AdvantageEstimator):
    """Each response's score less its prompt's mean score: it compares a prompt's samples."""

    needs_values = False
    needs_groups = True

    def __init__(self, config: CentredConfig, context=None):
        self.scale = config.scale

    def estimate(self, batch):
        groups = batch.group_ids
        means = torch.zeros(int(groups.max()) + 1).index_reduce_(0, groups, batch.scores, "mean", include_self=False)
        advantages = self.scale * (batch.scores - means[groups]).unsqueeze(1) * batch.loss_mask
        return advantages, advantages


@hookimpl
def register_policies(register):
    register("demo-lm", LM, LMConfig)


@hookimpl
def register_generators(register):
    register("demo-sampler", Sampler, SamplerConfig)


@hookimpl
def register_advantage_estimators(register):
    register("demo-centred", Centred, CentredConfig)
