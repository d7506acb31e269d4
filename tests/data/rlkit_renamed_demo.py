"""A third-party plugin whose settings are named otherwise than the built-ins' (tests/test_third_party.py
installs it): a policy, a generator and a group estimator written with `rlkit_core`'s one import.
The policy and generator hand their work to the built-in `hf` classes under the built-in names."""

import attrs
import torch
from rlkit_plugins.hf_generator import HFGenerator, HFGeneratorConfig
from rlkit_plugins.hf_policy import HFPolicy, HFPolicyConfig

from rlkit_core import (
    AdvantageEstimator,
    PolicySettings,
    SamplingSettings,
    greater_than,
    hookimpl,
    one_of,
    setting,
)


@attrs.frozen
class LMConfig(PolicySettings):
    renamed = {"model": "checkpoint", "dtype": "precision", "gradient_checkpointing": "recompute",
               "trust_remote_code": "run_model_code", "tokenizer": None}
    checkpoint: str = setting(help="the model directory")
    precision: str = setting("float32", help="weights dtype", validator=one_of("float32", "bfloat16", "float16"))
    recompute: bool = setting(False, help="recompute activations in the backward pass")
    run_model_code: bool = setting(False, help="let transformers run the model's own code")


def as_hf(config: LMConfig) -> HFPolicyConfig:
    return HFPolicyConfig(model=config.checkpoint, dtype=config.precision, gradient_checkpointing=config.recompute,
                          trust_remote_code=config.run_model_code)


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
    renamed = {"max_new_tokens": "max_tokens", "batch_size": "prompts_per_call"}
    max_tokens: int = setting(16, help="longest response in tokens", validator=greater_than(0))
    prompts_per_call: int = setting(0, help="prompts per generate call (0: all)")


class Sampler(HFGenerator):
    def __init__(self, config: SamplerConfig, context):
        super().__init__(HFGeneratorConfig(max_new_tokens=config.max_tokens, batch_size=config.prompts_per_call), context)


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
    register("renamed-lm", LM, LMConfig)


@hookimpl
def register_generators(register):
    register("renamed-sampler", Sampler, SamplerConfig)


@hookimpl
def register_advantage_estimators(register):
    register("renamed-centred", Centred, CentredConfig)

