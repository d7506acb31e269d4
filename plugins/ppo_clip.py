"""Loss `ppo-clip`: a policy-gradient surrogate (PPO's clipped one by default), clipped value term,
optional entropy bonus; and the surrogates it ships, `ppo`, `gspo` and (from `cispo.py`, a module of
this plugin) `cispo`."""

from typing import ClassVar

import attrs
import torch

from rlkit_core import (
    ComponentChoice,
    Loss,
    LossTerms,
    RatioClip,
    RecipeError,
    SurrogateTerms,
    at_least,
    building_at,
    greater_than,
    hookimpl,
    nested_component,
    one_of,
    setting,
)
from rlkit_core.functional import (
    AGGREGATIONS,
    IS_MODES,
    RATIO_LEVELS,
    aggregation_weights,
    clipped_surrogate,
    clipped_value_error,
    importance_weights,
    kl_per_token,
    masked_mean,
    masked_sum,
    ratio_statistics,
    response_mean,
    token_log_ratio,
)

from .cispo import CISPOConfig, cispo


def dual_clip_constant(instance, attribute, value):
    if value and value <= 1:
        raise ValueError(f"must be 0 (off) or > 1, got {value!r}; 3 is usual")


@attrs.frozen
class PPOClipConfig:
    clip: float = setting(0.2, help="policy ratio clip ε, both sides unless clip_low or clip_high say otherwise", validator=greater_than(0))
    clip_low: float = setting(attrs.Factory(lambda c: c.clip, takes_self=True), help="ε below 1: the ratio is clipped at 1 - clip_low (default: clip)",
                              validator=greater_than(0))
    clip_high: float = setting(attrs.Factory(lambda c: c.clip, takes_self=True),
                               help="ε above 1: the ratio is clipped at 1 + clip_high (default: clip; larger is DAPO's clip-higher)", validator=greater_than(0))
    dual_clip: float = setting(0.0, help="dual-clip constant c > 1 bounding a token with A < 0 at -c·A (0: off; 3 is usual)", validator=dual_clip_constant)
    surrogate: ComponentChoice | None = nested_component(
        "surrogate", default_type="ppo", help="the policy-gradient surrogate, [loss.surrogate] with its type and settings, or its name "
        "alone: ppo and gspo (which clip by clip_low, clip_high, dual_clip), cispo, or a plugin's")
    value_clip: float = setting(0.2, help="value clip ε_v around the rollout's values", validator=greater_than(0))
    vf_coef: float = setting(0.1, help="weight c_v of the value loss", validator=at_least(0))
    entropy_coef: float = setting(0.0, help="weight c_e of the entropy bonus (usually 0 for language models)", validator=at_least(0))
    ratio_threshold: float = setting(10.0, help="skip a minibatch whose mean ratio π_θ/π_old exceeds this (0: never)", validator=at_least(0))
    tis_cap: float = setting(0.0, help="weight each token by min(π_old/π_sampler, cap) for the sampler/learner mismatch (0: off)", validator=at_least(0))
    is_level: str = setting("token", help="with tis_cap: each token's own π_old/π_sampler ('token') or its response's ('sequence')",
                            validator=one_of(*RATIO_LEVELS))
    is_mode: str = setting("truncate", help="with tis_cap: a weight above the cap is capped ('truncate', TIS) or set to 0 ('mask', MIS)",
                           validator=one_of(*IS_MODES))
    aggregation: str = setting("token-mean", help="how per-token terms make the loss: token-mean, seq-mean-token-mean or seq-mean-token-sum-norm",
                               validator=one_of(*AGGREGATIONS))
    token_sum_norm: float = setting(0.0, help="what seq-mean-token-sum-norm divides a response's token sum by (0: max_new_tokens)", validator=at_least(0))
    mask_truncated: bool = setting(False, help="leave responses that never emitted EOS out of every loss term (DAPO's overlong filtering)")

    refused_keys: ClassVar[dict[str, str]] = {  # a setting it no longer has, with what to write instead
        "ratio_level": 'removed; ratio_level = "sequence" is GSPO\'s one ratio per response: write surrogate = "gspo" instead '
                       '(ratio_level = "token" was the default: drop it)',
    }


class PPOClip(Loss):
    """The policy-gradient loss of docs/ppo_reference.md around a registered surrogate
    (`[loss.surrogate]`, `rlkit_core.surrogates`), which says what each token's policy loss is; this
    class owns what every surrogate shares. Per minibatch, in order:

    1. aggregation: per-token weights and divisor (`aggregation`);
    2. importance correction for a sampler that is not the learner (`tis_cap`, `is_level`, `is_mode`);
    3. the surrogate over the log-ratio log π_θ - log π_old, and its ratio diagnostics;
    4. the clipped value loss, the entropy bonus and β·KL with `ppo.kl_penalty = "loss"`, all
       aggregated as the policy term;
    5. the skip: a minibatch whose mean ratio exploded (the policy moved far from the one that
       sampled it, usually after one bad step) leaves the weights alone; the clipped objective
       bounds each token's push but not the damage of following it.

    The per-response aggregations divide by the rollouts of an optimiser step,
    `ppo.minibatch_size`, which is the same whatever the split (see `LossTerms`)."""

    takes_kl_penalty = True
    needs_entropy_grad = True  # for the entropy bonus, when entropy_coef > 0

    @staticmethod
    def corrects_stale_samples(config) -> bool:
        return config.tis_cap > 0  # π_old/π_sampler, truncated or masked: the decoupled objective's behaviour weight

    def __init__(self, config: PPOClipConfig, context):
        self.config = config
        assert config.surrogate is not None, "the recipe reader fills [loss.surrogate] (ppo when the recipe leaves it out)"
        self.surrogate, self.surrogate_settings = config.surrogate.component.factory, config.surrogate.config
        self.clip = RatioClip(config.clip_low, config.clip_high, config.dual_clip)
        self.needs_entropy_grad = config.entropy_coef > 0
        self.responses_per_step = context.recipe.ppo.minibatch_size
        generator = context.recipe["generator"].config
        self.norm = config.token_sum_norm or generator.max_new_tokens
        if config.aggregation == "seq-mean-token-sum-norm" and not self.norm:
            raise RecipeError([f"{building_at(context, 'loss')}.token_sum_norm: the generator has no max_new_tokens to divide by; set "
                               "token_sum_norm to the longest response in tokens"])

    def aggregation(self, minibatch, token_count):
        """(per-token weights or None, divisor): every loss term is Σ_counted w·x / divisor."""
        weights = aggregation_weights(minibatch.loss_mask, self.config.aggregation, self.norm)
        divisor = token_count if weights is None else self.responses_per_step
        if self.config.mask_truncated:
            kept = minibatch.ended.float().unsqueeze(1).expand(minibatch.loss_mask.shape)
            weights = kept if weights is None else weights * kept
        return weights, divisor

    def __call__(self, minibatch, current, token_count):
        config, mask = self.config, minibatch.loss_mask
        old_logprobs, advantages = minibatch.old_logprobs, minibatch.advantages
        assert old_logprobs is not None and advantages is not None, "the loop fills both before the update"
        weights, divisor = self.aggregation(minibatch, token_count)
        policy_weights, tis = weights, None
        if config.tis_cap:
            tis = importance_weights(old_logprobs, minibatch.sampled_logprobs, mask, config.tis_cap, config.is_level, config.is_mode)
            policy_weights = tis if weights is None else weights * tis

        log_ratio = token_log_ratio(current.logprobs, old_logprobs, mask)
        pg = self.surrogate(log_ratio, advantages, mask, self.surrogate_settings, self.clip)
        ratio_mean, ratio_max = ratio_statistics(log_ratio if pg.log_ratio is None else pg.log_ratio, mask)
        losses = {"policy": masked_sum(pg.per_token if policy_weights is None else policy_weights * pg.per_token, mask) / divisor}
        diagnostics = {**pg.diagnostics, "ratio_mean": ratio_mean}  # the loop logs entropy and approx_kl itself
        if tis is not None:
            diagnostics["tis_weight_mean"] = masked_mean(tis, mask)
            # truncate: the weights at the cap; mask: the ones set to 0
            capped = tis >= config.tis_cap if config.is_mode == "truncate" else tis == 0
            diagnostics["tis_capped_frac"] = masked_mean(capped.float(), mask)

        if current.values is not None:
            assert minibatch.values is not None and minibatch.returns is not None, "a critic's rollouts carry values and returns"
            errors, clipped = clipped_value_error(current.values, minibatch.values, minibatch.returns, mask, config.value_clip)
            losses["value"] = config.vf_coef * (0.5 * masked_sum(errors if weights is None else weights * errors, mask) / divisor)
            diagnostics["value_loss"] = (0.5 * masked_sum(errors, mask) / mask.sum()).detach()  # its token mean, unweighted
            diagnostics["value_clipfrac"] = masked_mean(clipped.float(), mask)
        if config.entropy_coef:
            entropy = current.entropy if weights is None else weights * current.entropy
            losses["entropy"] = -config.entropy_coef * masked_sum(entropy, mask) / divisor
        if current.kl_coef:
            assert minibatch.ref_logprobs is not None, "the loop fills it before the update"
            # Δ = 0 where nothing counts: exp of garbage there would make its zero gradient nan
            reference = minibatch.ref_logprobs.where(mask.bool(), current.logprobs.detach())
            kl = kl_per_token(current.logprobs, reference, current.kl_estimator)
            losses["kl"] = current.kl_coef * masked_sum(kl if weights is None else weights * kl, mask) / divisor

        threshold = config.ratio_threshold or float("inf")
        skip = (ratio_mean > threshold).float()  # a tensor: the loop reads it once per step
        return LossTerms(losses=losses, diagnostics=diagnostics, maxima={"ratio_max": ratio_max}, skip=skip, log_ratio=pg.log_ratio)


@attrs.frozen
class LossClipConfig:
    """No settings of its own: the surrogate clips by the loss's clip_low, clip_high and dual_clip."""

    refused_keys: ClassVar[dict[str, str]] = {  # where a reader of `[loss.surrogate]` may look for them
        key: f"{key} is a setting of the loss, which ppo and gspo clip by: write it in [loss]" for key in ("clip", "clip_low", "clip_high", "dual_clip")}


def ppo(log_ratio, advantages, mask, settings: LossClipConfig, clip: RatioClip) -> SurrogateTerms:
    """PPO's clipped surrogate (Schulman et al. 2017) with its ratio clipped to [1 - clip.low,
    1 + clip.high] (a larger clip.high is DAPO's clip-higher) and optional dual-clip; clipfrac is
    the share of tokens whose clipped branch sets the loss."""
    per_token, clipped, dual_active = clipped_surrogate(log_ratio.exp(), advantages, clip.low, clip.high, clip.dual)
    diagnostics = {"clipfrac": masked_mean(clipped.float(), mask)}
    if dual_active is not None:
        diagnostics["dual_clipfrac"] = masked_mean(dual_active.float(), mask)
    return SurrogateTerms(per_token, diagnostics)


def gspo(log_ratio, advantages, mask, settings: LossClipConfig, clip: RatioClip) -> SurrogateTerms:
    """GSPO (Zheng et al. 2025, arXiv:2507.18071): PPO's clipped surrogate over one length-normalised
    ratio per response, exp of the mean of its tokens' log-ratios (`functional.sequence_log_ratio`);
    its clip is far narrower than PPO's (3e-4..4e-4). The ratio is 1 on padding, so that garbage
    advantages there cannot reach the response's gradient through its mean."""
    sequence = torch.where(mask.bool(), response_mean(log_ratio, mask), torch.zeros_like(log_ratio))
    return attrs.evolve(ppo(sequence, advantages, mask, settings, clip), log_ratio=sequence)


@hookimpl
def register_losses(register):
    register("ppo-clip", PPOClip, PPOClipConfig)


@hookimpl
def register_surrogates(register):
    register("ppo", ppo, LossClipConfig)
    register("gspo", gspo, LossClipConfig)
    register("cispo", cispo, CISPOConfig)  # plugins/cispo.py: a surrogate with a setting of its own, in one module
