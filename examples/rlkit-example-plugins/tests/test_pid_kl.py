"""The PID KL controller: rlkit's KL controller contract, then the control law term by term."""

import math

import pytest
from rlkit_example_plugins.pid_kl import PIDKL, PIDKLConfig

from rlkit_core.testing.contracts import KLControllerContract


class TestPIDContract(KLControllerContract):
    component = "pid"
    config = {"target": 6.0, "kp": 0.5, "ki": 0.1, "kd": 0.2}


def controller(**settings):
    return PIDKL(PIDKLConfig(**{"beta": 0.1, "target": 6.0, "kp": 0.5, "ki": 0.1, "kd": 0.2, **settings}))


def test_on_target_beta_stays():
    pid = controller()
    pid.update(kl=6.0, n_samples=64)
    assert pid.beta == 0.1


def test_first_update_above_target():
    # e = 9/6 − 1 = 0.5, I = 0.5, D = 0.5 − 0; β = 0.1 · exp(0.5·0.5 + 0.1·0.5 + 0.2·0.5)
    pid = controller()
    pid.update(kl=9.0, n_samples=64)
    assert pid.beta == pytest.approx(0.1 * math.exp(0.4))


def test_the_integral_keeps_beta_raised_after_kl_returns_to_target():
    pid = controller(kd=0.0)
    for _ in range(3):
        pid.update(kl=9.0, n_samples=64)
    pid.update(kl=6.0, n_samples=64)
    assert pid.integral == pytest.approx(1.5)
    assert pid.beta == pytest.approx(0.1 * math.exp(0.1 * 1.5))


def test_error_is_clipped_and_the_integral_cannot_wind_up():
    pid = controller(kd=0.0, error_clip=1.0, integral_limit=2.0)
    for _ in range(100):
        pid.update(kl=1e6, n_samples=64)
    assert pid.previous_error == 1.0 and pid.integral == 2.0
    assert pid.beta == pytest.approx(0.1 * math.exp(0.5 * 1.0 + 0.1 * 2.0))


def test_state_of_another_controller_is_refused_with_the_fix():
    with pytest.raises(ValueError, match="lacks integral, previous_error .* resume with that kl.type"):
        controller().load_state_dict({"beta": 0.2})
