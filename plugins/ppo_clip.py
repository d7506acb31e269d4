"""Loss `ppo-clip`: clipped policy term, clipped value term, optional entropy bonus."""

import attrs
import torch

from rlkit_core import hookimpl
from rlkit_core.config import at_least, greater_than, setting
from rlkit_core.functional import masked_mean, masked_sum, policy_loss, truncated_is_weights, value_loss
from rlkit_core.interfaces import Loss


@attrs.frozen
class PPOClipConfig:
    clip: float = setting(0.2, help="policy ratio clip ε", validator=greater_than(0))
    value_clip: float = setting(0.2, help="value clip ε_v around the rollout's values", validator=greater_than(0))
    vf_coef: float = setting(0.1, help="weight c_v of the value loss", validator=at_least(0))
    entropy_coef: float = setting(0.0, help="weight c_e of the entropy bonus (usually 0 for language models)", validator=at_least(0))
    ratio_threshold: float = setting(10.0, help="skip a minibatch whose mean ratio π_θ/π_old exceeds this (0: never); a guard against one destructive step", validator=at_least(0))
    tis_cap: float = setting(0.0, help="truncated importance sampling: weight each token by min(π_old/π_sampler, cap) (0: off; e.g. 2 with the vllm generator)", validator=at_least(0))


class PPOClip(Loss):
    """The clipped surrogate of PPO_REFERENCE.md, optionally reweighted for a sampler that is not
    the learner (`tis_cap`). A minibatch whose mean ratio exploded (the policy moved far from the one that sampled it,
    usually after one bad step) is reported as `skipped` and the loop leaves the weights alone:
    the clipped objective bounds each token's push but not the damage of following it."""

    def __init__(self, config: PPOClipConfig, context=None):
        self.config = config
        self.entropy_in_loss = config.entropy_coef > 0

    def __call__(self, minibatch, current, token_count):
        mask = minibatch.response_mask
        weights = None
        if self.config.tis_cap:
            weights = truncated_is_weights(minibatch.old_logprobs, minibatch.sampled_logprobs, mask, self.config.tis_cap)
        pg = policy_loss(current.logprobs, minibatch.old_logprobs, minibatch.advantages, mask, self.config.clip, token_count, weights)
        terms = {
            "loss_policy": pg["loss"],
            "clipfrac": pg["clipfrac"],
            "approx_kl": pg["approx_kl"],
            "ratio_mean": pg["ratio_mean"],
            "ratio_max": pg["ratio_max"],
            "entropy": masked_mean(current.entropy, mask).detach(),
        }
        if weights is not None:
            terms["tis_weight_mean"] = masked_mean(weights, mask)
            terms["tis_capped_frac"] = masked_mean((weights >= self.config.tis_cap).float(), mask)
        if current.values is not None:
            vf = value_loss(current.values, minibatch.values, minibatch.returns, mask, self.config.value_clip, token_count)
            terms["loss_value"] = self.config.vf_coef * vf["loss"]
            # diagnostics are means over the minibatch's own tokens (see `Loss`)
            terms["value_loss"] = value_loss(current.values, minibatch.values, minibatch.returns, mask, self.config.value_clip, mask.sum())["loss"].detach()
            terms["value_clipfrac"] = vf["clipfrac"]
        if self.config.entropy_coef:
            terms["loss_entropy"] = -self.config.entropy_coef * masked_sum(current.entropy, mask) / token_count
        threshold = self.config.ratio_threshold or float("inf")
        terms["skipped"] = (pg["ratio_mean"] > threshold).float()  # a tensor: the loop reads it once per step
        return terms


@hookimpl
def register_losses(register):
    register("ppo-clip", PPOClip, PPOClipConfig)
