"""KL controllers: `fixed` and `adaptive` (Ziegler et al. 2019)."""

import attrs

from rlkit_core import KLController, at_least, greater_than, hookimpl, setting


@attrs.frozen
class FixedKLConfig:
    beta: float = setting(0.05, help="the KL coefficient β, constant for the whole run", validator=at_least(0))


@attrs.frozen
class AdaptiveKLConfig:
    beta: float = setting(0.05, help="initial KL coefficient β", validator=greater_than(0))
    target: float = setting(6.0, help="target KL in nats: mean over the batch of the per-sequence SUM of per-token KL", validator=greater_than(0))
    horizon: float = setting(
        500.0, help="samples over which β moves by the clipped proportional error: 500 lets it move 2.6% an iteration of 64 rollouts, "
                    "where 10000 (Ziegler et al.'s, TRL's) moves it at most 21% in 150 such iterations, in effect a fixed β",
        validator=greater_than(0))


class FixedKL(KLController):
    def __init__(self, config: FixedKLConfig, context=None):
        self._beta = config.beta

    @property
    def beta(self) -> float:
        return self._beta

    def update(self, kl: float, n_samples: int) -> None:
        """β is fixed: nothing moves."""

    def load_state_dict(self, state) -> None:
        self._beta = float(state["beta"])


class AdaptiveKL(KLController):
    """β ← β · (1 + clip(KL/target − 1, −0.2, 0.2) · n / horizon)."""

    def __init__(self, config: AdaptiveKLConfig, context=None):
        self._beta = config.beta
        self.target: float = config.target
        self.horizon = config.horizon

    @property
    def beta(self) -> float:
        return self._beta

    def update(self, kl: float, n_samples: int) -> None:
        error = min(max(kl / self.target - 1.0, -0.2), 0.2)
        self._beta *= 1.0 + error * n_samples / self.horizon

    def load_state_dict(self, state) -> None:
        self._beta = float(state["beta"])


@hookimpl
def register_kl_controllers(register):
    register("fixed", FixedKL, FixedKLConfig)
    register("adaptive", AdaptiveKL, AdaptiveKLConfig)
