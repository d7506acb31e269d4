"""Loss `ppo-clip`: clipped policy term, clipped value term, optional entropy bonus."""

import attrs

from rlkit_core import hookimpl
from rlkit_core.config import at_least, greater_than, setting
from rlkit_core.functional import masked_mean, masked_sum, policy_loss, value_loss
from rlkit_core.interfaces import Loss


@attrs.frozen
class PPOClipConfig:
    clip: float = setting(0.2, help="policy ratio clip ε", validator=greater_than(0))
    value_clip: float = setting(0.2, help="value clip ε_v around the rollout's values", validator=greater_than(0))
    vf_coef: float = setting(0.1, help="weight c_v of the value loss", validator=at_least(0))
    entropy_coef: float = setting(0.0, help="weight c_e of the entropy bonus (usually 0 for language models)", validator=at_least(0))


class PPOClip(Loss):
    def __init__(self, config: PPOClipConfig, context=None):
        self.config = config
        self.entropy_in_loss = config.entropy_coef > 0

    def __call__(self, minibatch, current, token_count):
        mask = minibatch.response_mask
        pg = policy_loss(current.logprobs, minibatch.old_logprobs, minibatch.advantages, mask, self.config.clip, token_count)
        terms = {
            "loss_policy": pg["loss"],
            "clipfrac": pg["clipfrac"],
            "approx_kl": pg["approx_kl"],
            "ratio_mean": pg["ratio_mean"],
            "ratio_max": pg["ratio_max"],
            "entropy": masked_mean(current.entropy, mask).detach(),
        }
        if current.values is not None:
            vf = value_loss(current.values, minibatch.values, minibatch.returns, mask, self.config.value_clip, token_count)
            terms["loss_value"] = self.config.vf_coef * vf["loss"]
            # diagnostics are means over the minibatch's own tokens (see `Loss`)
            terms["value_loss"] = value_loss(current.values, minibatch.values, minibatch.returns, mask, self.config.value_clip, mask.sum())["loss"].detach()
            terms["value_clipfrac"] = vf["clipfrac"]
        if self.config.entropy_coef:
            terms["loss_entropy"] = -self.config.entropy_coef * masked_sum(current.entropy, mask) / token_count
        return terms


@hookimpl
def register_losses(register):
    register("ppo-clip", PPOClip, PPOClipConfig)
