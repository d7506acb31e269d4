# pyright: standard
"""Every weight push verified: a generator that samples with weights of its own (an engine's copy)
scores a fixed probe after each push, and its log-probs are compared with the policy's.

A push can fail without a word: an adapter never merged, an engine that ignores the update, a
reload that leaves layers behind. The run then samples from old weights while its numbers look
sane. Two rules catch it at that push (`push_problem`): the sampler's log-probs are farther from
the policy's than `health.weight_push_tolerance` (wrong weights), or farther than half of what the
policy moved since the previous push (they stayed behind: the push did not land); the second rule
reads only moves larger than the numerics' own gap, measured at the first push.
"""

from __future__ import annotations

import contextlib
import time

import torch

from rlkit_core.errors import RunError
from rlkit_core.functional import logprobs_from_logits
from rlkit_core.interfaces import Generator

PROBE_TOKENS = 64  # the probe's length at most: enough positions to see a change, cheap beside a rollout
NOISE_MARGIN = 4.0  # a policy move this many times the first push's gap is a move, not rounding


class WeightPushFailed(RunError):
    """The generator's weights after a push are not the policy's. The run ends with a checkpoint."""


def mean_gap(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().mean())


def push_problem(sampler: torch.Tensor, policy: torch.Tensor, policy_before: torch.Tensor | None, noise: float,
                 tolerance: float) -> str | None:
    """What is wrong with a push, or None. `sampler` and `policy`: the two log-probs of the probe's
    tokens now; `policy_before`: the policy's at the previous push (None at the first); `noise`:
    the gap at the first push, where the weights were the same by construction."""
    gap = mean_gap(sampler, policy)
    if gap > tolerance:
        return (f"its log-probs of the probe differ from the policy's by {gap:.3g} nats per token on average, more than "
                f"health.weight_push_tolerance = {tolerance:g}: it samples with other weights")
    if policy_before is None:
        return None
    moved = mean_gap(policy, policy_before)
    if moved > NOISE_MARGIN * noise + 1e-6 and gap > moved / 2:
        return (f"the policy moved {moved:.3g} nats per token on the probe since the previous push, and the generator is "
                f"{gap:.3g} from it and {mean_gap(sampler, policy_before):.3g} from where it was: the push did not land")
    return None


def policy_logprobs(policy, ids: list[int], device: torch.device) -> torch.Tensor:
    """The policy's log-prob of each of `ids[1:]` after the ids before it, at temperature 1, from its
    module (what the generator is pushed: `Policy.model`, or a producer's copy of it)."""
    tokens = torch.tensor([ids], device=device)
    with torch.no_grad():
        logits = policy.model(tokens, attention_mask=torch.ones_like(tokens)).logits
    return logprobs_from_logits(logits[:, :-1], tokens[:, 1:])[0].cpu()


class PushCheck:
    """The probe, the first push's gap and the policy's log-probs at the previous push, for one
    generator; `after_push` runs the comparison and raises on every process when any failed."""

    def __init__(self, tolerance: float):
        self.tolerance = tolerance  # 0: off
        self.probe: list[int] | None = None
        self.noise = 0.0
        self.policy_before: torch.Tensor | None = None
        self.metrics: dict[str, float] = {}

    def after_push(self, engine, generator, policy, prompts: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Compare after `generator.sync_weights(policy)`; `prompts`: the call's (ids, mask) chunks,
        whose first row of two or more tokens becomes the probe at the first push."""
        if not self.tolerance or type(generator).score is Generator.score:  # it samples with the policy's own module
            return
        started = time.perf_counter()
        if self.probe is None:
            self.probe = first_probe(prompts)
        sampler = generator.score(self.probe) if self.probe else None
        problem = None
        if sampler is not None:
            # in the precision the generator samples in, as `rollout.generate` calls it
            with contextlib.nullcontext() if type(generator).runs_own_precision else engine.autocast():
                now = policy_logprobs(policy, self.probe, engine.device)
            sampler = torch.tensor(sampler, dtype=torch.float32)
            if len(sampler) != len(now):
                problem = f"it scored {len(sampler)} of the probe's {len(now)} tokens"
            else:
                problem = push_problem(sampler, now, self.policy_before, self.noise, self.tolerance)
                if self.policy_before is None:
                    self.noise = mean_gap(sampler, now)
                self.policy_before = now
                self.metrics["check/push_gap"] = mean_gap(sampler, now)
        problems = [p for p in engine.processes.gather_objects(problem) if p]
        if problems:
            raise WeightPushFailed(f"the weight push to the {type(generator).__name__} generator (weights after "
                                   f"{policy.weights_version} updates) failed the check: {problems[0]}; look at the generator's "
                                   "weight sync (an adapter not merged, an engine that ignored the update)")
        if sampler is not None:
            self.metrics["time/push_check"] = self.metrics.get("time/push_check", 0.0) + time.perf_counter() - started

    def pop_metrics(self) -> dict[str, float]:
        reported, self.metrics = self.metrics, {}
        return reported


def first_probe(prompts: list[tuple[torch.Tensor, torch.Tensor]]) -> list[int]:
    """The first prompt of two or more tokens, cut to `PROBE_TOKENS` (its last ones: those nearest
    to what is sampled); empty when every prompt is shorter."""
    for ids, mask in prompts:
        for row, keep in zip(ids, mask):
            tokens = row[keep.bool()].tolist()
            if len(tokens) >= 2:
                return tokens[-PROBE_TOKENS:]
    return []
