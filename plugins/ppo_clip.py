"""Loss `ppo-clip`: clipped policy term, clipped value term, optional entropy bonus."""

import attrs

from rlkit_core import Loss, RecipeError, at_least, building_at, field_of, greater_than, hookimpl, one_of, setting
from rlkit_core.functional import (
    AGGREGATIONS,
    IS_MODES,
    RATIO_LEVELS,
    aggregation_weights,
    importance_weights,
    kl_per_token,
    masked_mean,
    masked_sum,
    policy_loss,
    value_loss,
)


def dual_clip_constant(instance, attribute, value):
    if value and value <= 1:
        raise ValueError(f"must be 0 (off) or > 1, got {value!r}; 3 is usual")


@attrs.frozen
class PPOClipConfig:
    clip: float = setting(0.2, help="policy ratio clip ε (both sides unless clip_low / clip_high say otherwise)", validator=greater_than(0))
    clip_low: float = setting(attrs.Factory(lambda c: c.clip, takes_self=True), help="ε below 1: the ratio is clipped at 1 - clip_low (default: clip)", validator=greater_than(0))
    clip_high: float = setting(attrs.Factory(lambda c: c.clip, takes_self=True), help="ε above 1: the ratio is clipped at 1 + clip_high (default: clip; larger is DAPO's clip-higher, e.g. 0.28 with clip_low 0.2)", validator=greater_than(0))
    dual_clip: float = setting(0.0, help="dual-clip constant c > 1: a token with A < 0 costs at most -c·A however far its ratio grew (0: off; 3 is usual)", validator=dual_clip_constant)
    ratio_level: str = setting("token", help="'token': each token's ratio π_θ/π_old (PPO); 'sequence': one length-normalised ratio per response (GSPO; use a clip near 3e-4..4e-4)", validator=one_of(*RATIO_LEVELS))
    value_clip: float = setting(0.2, help="value clip ε_v around the rollout's values", validator=greater_than(0))
    vf_coef: float = setting(0.1, help="weight c_v of the value loss", validator=at_least(0))
    entropy_coef: float = setting(0.0, help="weight c_e of the entropy bonus (usually 0 for language models)", validator=at_least(0))
    ratio_threshold: float = setting(10.0, help="skip a minibatch whose mean ratio π_θ/π_old exceeds this (0: never); a guard against one destructive step", validator=at_least(0))
    tis_cap: float = setting(0.0, help="importance sampling for the sampler/learner mismatch: weight each token by min(π_old/π_sampler, cap) (0: off; e.g. 2 with the vllm generator); is_level and is_mode refine it", validator=at_least(0))
    is_level: str = setting("token", help="with tis_cap: 'token' weighs each token by its own π_old/π_sampler; 'sequence' by the whole response's (the product over its tokens)", validator=one_of(*RATIO_LEVELS))
    is_mode: str = setting("truncate", help="with tis_cap: 'truncate' caps a weight above tis_cap at tis_cap (TIS); 'mask' sets it to 0 (MIS)", validator=one_of(*IS_MODES))
    aggregation: str = setting("token-mean", help="how per-token terms make the loss: token-mean, seq-mean-token-mean (GRPO) or seq-mean-token-sum-norm (Dr. GRPO)", validator=one_of(*AGGREGATIONS))
    token_sum_norm: float = setting(0.0, help="the constant seq-mean-token-sum-norm divides each response's token sum by (0: the generator's max_new_tokens)", validator=at_least(0))
    mask_truncated: bool = setting(False, help="leave responses that never emitted EOS (cut at the length limit) out of every loss term (DAPO's overlong filtering); they still count in the divisor")


class PPOClip(Loss):
    """The clipped surrogate of docs/ppo_reference.md, optionally reweighted for a sampler that is not
    the learner (`tis_cap`). A minibatch whose mean ratio exploded (the policy moved far from the one that sampled it,
    usually after one bad step) is reported as `skipped` and the loop leaves the weights alone:
    the clipped objective bounds each token's push but not the damage of following it.

    Every `loss_*` term (policy, value, entropy, and β·KL with `ppo.kl_penalty = "loss"`) aggregates
    as `aggregation` says (`rlkit_core.functional.aggregation_weights`); the per-response forms
    divide by the rollouts of an optimiser step, `ppo.minibatch_size`, which is the same whatever
    the split."""

    takes_kl_penalty = True

    def __init__(self, config: PPOClipConfig, context):
        self.config = config
        self.entropy_in_loss = config.entropy_coef > 0
        self.responses_per_step = context.recipe.ppo.minibatch_size
        generator = context.recipe["generator"].config
        self.norm = config.token_sum_norm or generator.response_limit
        if config.aggregation == "seq-mean-token-sum-norm" and not self.norm:
            raise RecipeError([f"{building_at(context, 'loss')}.token_sum_norm: the generator has no {field_of(generator, 'max_new_tokens')} to divide by; set "
                               "token_sum_norm to the longest response in tokens"])

    def aggregation(self, minibatch, token_count):
        """(per-token weights or None, divisor): every `loss_*` term is Σ_counted w·x / divisor."""
        weights = aggregation_weights(minibatch.response_mask, self.config.aggregation, self.norm)
        divisor = token_count if weights is None else self.responses_per_step
        if self.config.mask_truncated:
            kept = minibatch.ended.float().unsqueeze(1).expand(minibatch.response_mask.shape)
            weights = kept if weights is None else weights * kept
        return weights, divisor

    def __call__(self, minibatch, current, token_count):
        config, mask = self.config, minibatch.response_mask
        weights, divisor = self.aggregation(minibatch, token_count)
        policy_weights, tis = weights, None
        if config.tis_cap:
            tis = importance_weights(minibatch.old_logprobs, minibatch.sampled_logprobs, mask, config.tis_cap, config.is_level, config.is_mode)
            policy_weights = tis if weights is None else weights * tis
        pg = policy_loss(current.logprobs, minibatch.old_logprobs, minibatch.advantages, mask, config.clip_low, divisor, policy_weights,
                         clip_high=config.clip_high, dual_clip=config.dual_clip, ratio_level=config.ratio_level)
        terms = {
            "loss_policy": pg["loss"],
            "clipfrac": pg["clipfrac"],
            "approx_kl": pg["approx_kl"],
            "ratio_mean": pg["ratio_mean"],
            "ratio_max": pg["ratio_max"],
            "entropy": masked_mean(current.entropy, mask).detach(),
        }
        if config.dual_clip:
            terms["dual_clipfrac"] = pg["dual_clipfrac"]
        if tis is not None:
            terms["tis_weight_mean"] = masked_mean(tis, mask)
            # truncate: the weights at the cap; mask: the ones set to 0
            capped = tis >= config.tis_cap if config.is_mode == "truncate" else tis == 0
            terms["tis_capped_frac"] = masked_mean(capped.float(), mask)
        if current.values is not None:
            vf = value_loss(current.values, minibatch.values, minibatch.returns, mask, self.config.value_clip, divisor, weights)
            terms["loss_value"] = self.config.vf_coef * vf["loss"]
            # diagnostics are means over the minibatch's own tokens (see `Loss`)
            terms["value_loss"] = value_loss(current.values, minibatch.values, minibatch.returns, mask, self.config.value_clip, mask.sum())["loss"].detach()
            terms["value_clipfrac"] = vf["clipfrac"]
        if self.config.entropy_coef:
            entropy = current.entropy if weights is None else weights * current.entropy
            terms["loss_entropy"] = -self.config.entropy_coef * masked_sum(entropy, mask) / divisor
        if current.kl_coef:
            kl = kl_per_token(current.logprobs, minibatch.ref_logprobs, current.kl_estimator)
            terms["loss_kl"] = current.kl_coef * masked_sum(kl if weights is None else weights * kl, mask) / divisor
        threshold = self.config.ratio_threshold or float("inf")
        terms["skipped"] = (pg["ratio_mean"] > threshold).float()  # a tensor: the loop reads it once per step
        return terms


@hookimpl
def register_losses(register):
    register("ppo-clip", PPOClip, PPOClipConfig)
