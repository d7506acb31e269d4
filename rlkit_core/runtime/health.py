# pyright: standard
"""Health checks: the ways a run trains on nothing, or on garbage, without crashing.

Each check reads the metrics of the iterations so far (and, for groups, the latest batch's scores)
and says when the run has stopped learning for a reason the user can act on: no reward signal,
every response cut at the length limit, a generator sampling from other weights than the
policy's, a collapsed or runaway policy, gradients that are exactly zero. Each fires once per run
(the first time), as a warning on the terminal, a `health/<check>` metric holding the value that
triggered it, and a note in metrics.jsonl and the tracker; `health.stop_on` makes it stop the run.

The detection is pure functions of metric sequences (`detect`), so that each rule is tested on
hand-built numbers; `HealthMonitor` feeds them from the loop.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import attrs
import torch

from rlkit_core.errors import RunError
from rlkit_core.recipe.schema import HealthConfig

TINY = 1e-12  # a standard deviation or gradient norm this small is zero (float rounding of equal numbers)
KL_WINDOW = 5  # iterations whose mean kl/ref kl_over_target reads: one noisy batch is not a runaway


@attrs.frozen
class Finding:
    check: str
    value: float  # the metric value that triggered it
    text: str  # what was seen and what to look at


def group_zero_variance_share(scores: torch.Tensor, group_ids: torch.Tensor) -> float:
    """The share of groups (responses to one prompt) whose scores are all equal."""
    groups = group_ids.unique()
    equal = sum(float(scores[group_ids == g].std(unbiased=False)) <= TINY for g in groups)
    return equal / len(groups)


def detect(config: HealthConfig, history: list[dict], group_share: float | None = None,
           kl_target: float | None = None) -> list[Finding]:
    """The checks that the latest row of `history` (the metrics of every trained iteration so far,
    oldest first) trips. `group_share`: `group_zero_variance_share` of the latest batch (None with
    one sample per prompt); `kl_target`: the KL controller's target, if it has one."""
    now, earlier = history[-1], history[:-1]
    found = []
    std = now.get("score/std")
    if config.zero_reward_variance and std is not None and std <= TINY:
        found.append(Finding("zero_reward_variance", std, f"score/std = {std:g}: every response of the batch scored "
                             f"{now.get('score/mean', float('nan')):g}, so no advantage has a sign to learn from; look at the "
                             "reward (does it score these responses at all?) and at sample responses"))
    elif config.zero_reward_variance and group_share is not None and group_share >= config.zero_variance_groups:
        found.append(Finding("zero_reward_variance", group_share, f"{group_share:.0%} of the groups have equal scores "
                             "in every response, so the group estimator gives them zero advantage; make the prompts harder "
                             "or easier, the reward finer-grained, or raise ppo.samples_per_prompt"))
    if config.all_truncated:
        recent = [row.get("response/eos_rate") for row in history[-config.all_truncated:]]
        if len(recent) == config.all_truncated and all(rate == 0 for rate in recent):
            found.append(Finding("all_truncated", 0.0, f"response/eos_rate = 0 for {config.all_truncated} iterations: every "
                                 "response was cut at generator.max_new_tokens; raise it, or check that the policy's EOS token "
                                 "is the one it was trained to end with"))
    # a batch made ahead (`async/staleness` above 0) was sampled by older weights: its gap measures the updates since,
    # not the sync (each push there has its own check), so only batches sampled by the weights that train are compared
    gap = now.get("check/logprob_gap") if not now.get("async/staleness") else None
    earlier_gaps = [row["check/logprob_gap"] for row in earlier if "check/logprob_gap" in row and not row.get("async/staleness")]
    if config.logprob_gap_jump and gap is not None and earlier_gaps:
        usual = sum(earlier_gaps) / len(earlier_gaps)
        if gap > config.logprob_gap_floor and gap > config.logprob_gap_jump * usual:
            found.append(Finding("logprob_gap_jump", gap, f"check/logprob_gap = {gap:.4g} nats per token, against {usual:.3g} "
                                 "on average before: the generator's log-probs no longer match the policy's, so it samples "
                                 "from other (stale or wrong) weights; look at the generator's weight sync"))
    entropy = now.get("train/entropy")  # the update's own, whatever the loss (absent before the first update)
    first = next((row["train/entropy"] for row in history if "train/entropy" in row), None)
    if config.entropy_collapse and entropy is not None and first and entropy < config.entropy_collapse * first:
        found.append(Finding("entropy_collapse", entropy, f"train/entropy = {entropy:.4g}, down from {first:.4g} in the first "
                             "iteration: the policy samples almost one response; lower optim.learning_rate, raise the KL "
                             "penalty, or add loss.entropy_coef"))
    recent_kl = [row["kl/ref"] for row in history[-KL_WINDOW:] if "kl/ref" in row]
    kl = sum(recent_kl) / len(recent_kl) if recent_kl else None
    if config.kl_over_target and kl is not None and kl_target and kl > config.kl_over_target * kl_target:
        found.append(Finding("kl_over_target", kl, f"kl/ref = {kl:.4g} nats on average over the last {len(recent_kl)} iterations, "
                             f"{kl / kl_target:.1f} times the KL controller's target of {kl_target:g}: the policy runs away from "
                             "the reference faster than β (kl/beta) catches up; lower optim.learning_rate, start from a larger "
                             "kl.beta or shorten kl.horizon"))
    norm = now.get("train/grad_norm")
    if config.zero_gradients and norm is not None and math.isfinite(norm) and norm <= TINY and now.get("train/nonfinite", 0) < 1:
        found.append(Finding("zero_gradients", norm, "train/grad_norm = 0 with finite steps: the loss does not depend on the "
                             "trainable weights (zero advantages, every step skipped by loss.ratio_threshold, or frozen "
                             "parameters); look at score/std, train/skipped and the policy's trainable parameters"))
    return found


class HealthStop(RunError):
    """A health check in `health.stop_on` fired: the run stops with exit code 3."""

    exit_code = 3


class HealthMonitor:
    """Feeds `detect` from the loop and reports each check the first time it fires."""

    def __init__(self, config: HealthConfig, earlier: Sequence[dict] = ()):
        """`earlier`: the rows of metrics.jsonl a resumed run continues (checks that fired there stay quiet)."""
        self.config = config
        self.history = [row for row in earlier if "score/mean" in row]
        self.fired = {name.removeprefix("health/") for row in earlier for name in row if name.startswith("health/")}

    def observe(self, metrics: dict, batch, kl_target: float | None) -> list[Finding]:
        """The checks that fire for the first time on this iteration's metrics; adds `health/<check>`
        (the triggering value) to `metrics`. Iterations without training (a skipped batch) are passed over."""
        if "score/mean" not in metrics:
            return []
        self.history.append(metrics)
        share = None
        if batch is not None and batch.group_ids is not None and len(batch.group_ids.unique()) < len(batch.group_ids):
            share = group_zero_variance_share(batch.scores, batch.group_ids)
        new = [f for f in detect(self.config, self.history, share, kl_target) if f.check not in self.fired]
        for finding in new:
            self.fired.add(finding.check)
            metrics[f"health/{finding.check}"] = finding.value
        return new

    def stops(self, findings: list[Finding]) -> Finding | None:
        stop_on = self.config.stop_on
        return next((f for f in findings if "all" in stop_on or f.check in stop_on), None)
