"""Advantage estimator `gae`: generalised advantage estimation over per-token rewards."""

import attrs

from rlkit_core import AdvantageEstimator, between, hookimpl, setting
from rlkit_core.functional import gae, masked_whiten


@attrs.frozen
class GAEConfig:
    gamma: float = setting(1.0, help="discount γ per token", validator=between(0.0, 1.0))
    lam: float = setting(0.95, help="GAE λ: 1 is Monte-Carlo returns, 0 is one-step TD", validator=between(0.0, 1.0))
    lam_per_turn: bool = setting(
        False, help="apply λ between an episode's turns, not between tokens: a turn's credit fades with the turns after it, "
                    "not with their length in tokens (within a turn λ = 1)")
    whiten: bool = setting(
        True, help="normalise advantages to mean 0, std 1 over the whole batch's counted tokens, so the step size does not depend on the reward's scale")


class GAE(AdvantageEstimator):
    needs_values = True

    def __init__(self, config: GAEConfig, context=None):
        self.config = config

    def estimate(self, batch):
        assert batch.rewards is not None and batch.values is not None  # the loop adds them before it estimates (needs_values)
        advantages, returns = gae(batch.rewards, batch.values, batch.loss_mask, self.config.gamma, self.config.lam,
                                 self.config.lam_per_turn)
        if self.config.whiten:
            advantages = masked_whiten(advantages, batch.loss_mask)
        return advantages, returns


@hookimpl
def register_advantage_estimators(register):
    register("gae", GAE, GAEConfig)
