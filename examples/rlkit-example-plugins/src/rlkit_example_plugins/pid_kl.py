"""KL controller `pid`: β steered towards a target KL by a PID controller acting on log β.

After each iteration the loop reports the batch's mean per-sequence KL. With target κ:

    e_t = clip(KL_t / κ − 1, −error_clip, error_clip)          relative error
    I_t = clip(I_{t−1} + e_t, −integral_limit, integral_limit)  integral, with anti-windup
    D_t = e_t − e_{t−1}                                         derivative (e_0 = 0)
    β_t = β_0 · exp(kp · e_t + ki · I_t + kd · D_t)

Why log β: β stays positive, and an error moves β by the same factor whatever β's scale. Why the
clips: one runaway batch cannot swing β by more than exp(kp · error_clip), and a long stretch off
target cannot wind the integral up beyond recovery, so β is always within
β_0 · exp(±(kp · error_clip + ki · integral_limit + 2 · kd · error_clip)).
The integral is what removes a steady offset: back on target (e = 0), β stays at β_0 · exp(ki · I).

One update per iteration: unlike `adaptive`, the step does not scale with the batch's sample count.
"""

import math

import attrs

from rlkit_core import KLController, at_least, greater_than, hookimpl, setting

STATE_KEYS = ("beta", "integral", "previous_error")


@attrs.frozen
class PIDKLConfig:
    beta: float = setting(0.05, help="β_0: the KL coefficient at the start, and the set point the controller multiplies", validator=greater_than(0))
    target: float = setting(6.0, help="target KL in nats: mean over the batch of the per-sequence sum of per-token KL", validator=greater_than(0))
    kp: float = setting(0.5, help="proportional gain: log β moves by kp × the relative KL error", validator=at_least(0))
    ki: float = setting(0.05, help="integral gain: log β moves by ki × the accumulated relative error", validator=at_least(0))
    kd: float = setting(0.0, help="derivative gain: log β moves by kd × the change of the relative error since the last iteration", validator=at_least(0))
    error_clip: float = setting(1.0, help="the relative error is clipped to ±error_clip before it is used", validator=greater_than(0))
    integral_limit: float = setting(50.0, help="the accumulated error is clipped to ±integral_limit (anti-windup)", validator=greater_than(0))


def _clip(value: float, limit: float) -> float:
    return min(max(value, -limit), limit)


class PIDKL(KLController):
    def __init__(self, config: PIDKLConfig, context=None):
        self.config = config
        self.target = config.target  # the KL the run's `kl_over_target` health check compares with
        self._beta = config.beta
        self.integral = 0.0
        self.previous_error = 0.0

    @property
    def beta(self) -> float:
        return self._beta

    def update(self, kl: float, n_samples: int) -> None:
        c = self.config
        error = _clip(kl / c.target - 1.0, c.error_clip)
        self.integral = _clip(self.integral + error, c.integral_limit)
        derivative = error - self.previous_error
        self.previous_error = error
        self._beta = c.beta * math.exp(c.kp * error + c.ki * self.integral + c.kd * derivative)

    def state_dict(self) -> dict[str, float]:
        return {"beta": self._beta, "integral": self.integral, "previous_error": self.previous_error}

    def load_state_dict(self, state) -> None:
        missing = [key for key in STATE_KEYS if key not in state]
        if missing:
            raise ValueError(f"pid KL controller state lacks {', '.join(missing)} (has: {', '.join(state) or 'nothing'}); "
                             "it was written by another KL controller: resume with that kl.type, or start a new run")
        self._beta = float(state["beta"])
        self.integral = float(state["integral"])
        self.previous_error = float(state["previous_error"])


@hookimpl
def register_kl_controllers(register):
    register("pid", PIDKL, PIDKLConfig)
