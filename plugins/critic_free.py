"""Critic-free advantage estimators: `grpo`, `rloo`, `reinforce++` and `remax`.

None of them learns a value function (they run with `value_head.type = "none"`): the baseline a
sampled response is measured against comes from other responses to the same prompt (grpo, rloo),
from the whole batch (reinforce++) or from a greedy response (remax). A response's reward R_i is
the sum of its per-token rewards: the shaped score on its last token, plus −β·KL on every token
when the KL penalty is in the reward (`ppo.kl_penalty = "reward"`); with the penalty in the loss
(as GRPO has it) R_i is the score.

The estimators see the whole rollout batch (over every process), so a prompt's group is always
complete. The returns they give back are the rewards-to-go; no critic learns from them.
"""

from abc import abstractmethod

import attrs
import torch

from rlkit_core import AdvantageEstimator, between, hookimpl, setting
from rlkit_core.functional import discounted_returns, group_normalized, leave_one_out, masked_whiten, per_token, sequence_rewards


@attrs.frozen
class GRPOConfig:
    scale_by_std: bool = setting(True, help="divide by the group's std (GRPO); false only centres on the group mean (Dr. GRPO)")


@attrs.frozen
class RLOOConfig:
    pass


@attrs.frozen
class ReinforcePlusPlusConfig:
    gamma: float = setting(1.0, help="discount γ per token of the rewards-to-go", validator=between(0.0, 1.0))


@attrs.frozen
class ReMaxConfig:
    pass


class CriticFree(AdvantageEstimator):
    """No values read: the loop builds no critic (`value_head.type = "none"`)."""

    needs_values = False

    def __init__(self, config, context=None):
        self.config = config


class GroupRelative(CriticFree):
    """Sequence-level advantages: every token of a response gets its reward R_i measured against
    the rewards of its group (the responses to the same prompt)."""

    needs_groups = True

    @abstractmethod
    def against_group(self, totals: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
        """[B] rewards, [B] group ids -> [B] advantages."""

    def estimate(self, batch):
        mask, rewards = batch.loss_mask, batch.rewards
        assert rewards is not None  # the loop adds the rewards before it estimates
        totals, groups = sequence_rewards(rewards, mask), batch.group_ids
        # an episode kept out of training (a fault: no counted token) is no member of its group, and a
        # sample left alone in its group has nothing to be measured against
        trained = mask.any(dim=1)
        _, index, counts = torch.unique(torch.where(trained, groups, groups.min() - 1), return_inverse=True, return_counts=True)
        members = trained & (counts[index] > 1)
        advantages = torch.zeros_like(totals)
        if members.any():
            advantages[members] = self.against_group(totals[members], groups[members])
        return per_token(advantages, mask), discounted_returns(rewards, mask, 1.0)


class GRPO(GroupRelative):
    """Group-relative advantages (Shao et al. 2024, "DeepSeekMath", outcome supervision): every
    token of response i gets (R_i − mean_g R) / (std_g R + 1e-6) over the responses g to the same
    prompt, std unbiased. `scale_by_std = false` is Dr. GRPO's correction (Liu et al. 2025,
    "Understanding R1-Zero-Like Training"): dividing by the std up-weights prompts whose
    responses all score nearly alike; Dr. GRPO pairs it with `loss.aggregation =
    "seq-mean-token-sum-norm"`."""

    def against_group(self, totals, group_ids):
        return group_normalized(totals, group_ids, self.config.scale_by_std)


class RLOO(GroupRelative):
    """REINFORCE with a leave-one-out baseline (Ahmadian et al. 2024, "Back to Basics: Revisiting
    REINFORCE Style Optimization for Learning from Human Feedback in LLMs"; Kool et al. 2019):
    every token of response i gets R_i − mean of R_j over the other responses j to the same prompt.
    The baseline does not contain R_i, so the estimate stays unbiased."""

    def against_group(self, totals, group_ids):
        return leave_one_out(totals, group_ids)


class ReinforcePlusPlus(CriticFree):
    """REINFORCE++ (Hu 2025, "REINFORCE++: A Simple and Efficient Approach for Aligning Large
    Language Models"): token t's advantage is its reward-to-go G_t = Σ_{s ≥ t} γ^(s−t) r_s, with
    the per-token KL penalty in r, normalised to mean 0 and std 1 over the counted tokens of the
    whole batch (biased std, as `masked_whiten`). The batch mean is the baseline, so one sample
    per prompt is enough; use `ppo.kl_penalty = "reward"` to get the KL into r."""

    def estimate(self, batch):
        mask = batch.loss_mask
        assert batch.rewards is not None  # the loop adds the rewards before it estimates
        returns = discounted_returns(batch.rewards, mask, self.config.gamma)
        return masked_whiten(returns, mask), returns


class ReMax(CriticFree):
    """REINFORCE with the greedy response as baseline (Li et al. 2023, "ReMax: A Simple, Effective,
    and Efficient Reinforcement Learning Method for Aligning Large Language Models"): token t's
    advantage is its reward-to-go G_t = Σ_{s ≥ t} r_s minus the shaped score of the response the
    policy gives to the same prompt when it always takes its likeliest token. The loop generates
    and scores that response (one extra greedy generation per prompt, through the generator);
    it is not sampled, so the baseline does not depend on the sample and the estimate stays unbiased."""

    needs_baseline_scores = True

    def estimate(self, batch):
        mask = batch.loss_mask
        assert batch.rewards is not None and batch.baseline_scores is not None  # added by the loop (needs_baseline_scores)
        returns = discounted_returns(batch.rewards, mask, 1.0)
        return returns - per_token(batch.baseline_scores, mask), returns


@hookimpl
def register_advantage_estimators(register):
    register("grpo", GRPO, GRPOConfig)
    register("rloo", RLOO, RLOOConfig)
    register("reinforce++", ReinforcePlusPlus, ReinforcePlusPlusConfig)
    register("remax", ReMax, ReMaxConfig)
