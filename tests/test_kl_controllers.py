"""KL controllers against the worked example of docs/ppo_reference.md."""

import pytest
from rlkit_plugins.kl import AdaptiveKL, AdaptiveKLConfig, FixedKL, FixedKLConfig


def test_adaptive_clips_the_error_upwards():
    # e = clip(8/6 − 1 = 0.333, ±0.2) = 0.2; β = 0.15 · (1 + 0.2 · 512/10000) = 0.15 · 1.01024
    controller = AdaptiveKL(AdaptiveKLConfig(beta=0.15, target=6, horizon=10000))
    controller.update(kl=8.0, n_samples=512)
    assert controller.beta == pytest.approx(0.151536, abs=1e-12)


def test_adaptive_clips_the_error_downwards():
    # e = clip(3/6 − 1 = −0.5, ±0.2) = −0.2; β = 0.15 · (1 − 0.2 · 0.0512) = 0.148464
    controller = AdaptiveKL(AdaptiveKLConfig(beta=0.15, target=6, horizon=10000))
    controller.update(kl=3.0, n_samples=512)
    assert controller.beta == pytest.approx(0.148464, abs=1e-12)


def test_adaptive_inside_the_clip_is_proportional():
    # e = 6.6/6 − 1 = 0.1; β = 0.1 · (1 + 0.1 · 1000/10000) = 0.101
    controller = AdaptiveKL(AdaptiveKLConfig(beta=0.1, target=6, horizon=10000))
    controller.update(kl=6.6, n_samples=1000)
    assert controller.beta == pytest.approx(0.101, abs=1e-12)


def test_fixed_never_moves_and_state_round_trips():
    controller = FixedKL(FixedKLConfig(beta=0.05))
    controller.update(kl=100.0, n_samples=512)
    assert controller.beta == 0.05
    adaptive = AdaptiveKL(AdaptiveKLConfig())
    adaptive.load_state_dict({"beta": 0.3})
    assert adaptive.state_dict() == {"beta": 0.3}
