"""The PPO math as pure torch functions: no state, no model, no config.

Shapes follow `rlkit_core.batch`: B rollouts, R response positions, V vocabulary entries.
`mask` is [B, R] (any dtype; nonzero = counted): the batch's `loss_mask`, 1 on the response tokens
that count. A single-turn response counts every token up to and including the first EOS; an
episode's may have holes where environment tokens lie. Values at mask == 0 positions may be garbage (even inf or
nan): functions that take a mask select with `torch.where` instead of multiplying by it, so
garbage reaches neither a result nor a gradient. The math follows docs/ppo_reference.md.
"""

from __future__ import annotations

import torch

KL_ESTIMATORS = ("k1", "k2", "k3", "full")
AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
RATIO_LEVELS = ("token", "sequence")
IS_MODES = ("truncate", "mask")


def response_mask(response_ids: torch.Tensor, eos_token_ids) -> torch.Tensor:
    """[B, R] sampled ids -> [B, R] long mask: 1 on tokens up to and including the first end token.

    `eos_token_ids` is every id that ends a response (chat models have several, e.g. an end-of-turn
    and an end-of-text token); stopping on any of them counts as ending.
    """
    ends = torch.as_tensor(list(eos_token_ids), device=response_ids.device)
    is_end = torch.isin(response_ids, ends).long()
    ends_before = is_end.cumsum(dim=1) - is_end  # end tokens strictly before each position
    return (ends_before == 0).long()


def left_padded(rows: list[list[int]], pad_id: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Token id lists as one left-padded batch: (ids, attention mask), each [len(rows), longest]."""
    width = max(len(ids) for ids in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for row, tokens in enumerate(rows):
        ids[row, width - len(tokens):] = torch.tensor(tokens, dtype=torch.long)
        mask[row, width - len(tokens):] = 1
    return ids.to(device), mask.to(device)


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of x over mask != 0 entries; x and mask broadcast. dim=None sums everything to a scalar.

    Selecting (not multiplying) keeps inf/nan padding out of the sum: 0 * inf is nan.
    """
    selected = torch.where(mask.bool(), x, torch.zeros_like(x))
    return selected.sum() if dim is None else selected.sum(dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of x over mask != 0 entries (scalar for dim=None); nan where nothing is counted."""
    return masked_sum(x, mask, dim) / masked_sum(torch.ones_like(x), mask, dim)


def masked_var(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Scalar variance of x over all mask != 0 entries.

    Biased (population, divide by n): the counted tokens are the whole set being normalised, not a
    sample of a larger one, so after `masked_whiten` their std is exactly 1; at batch sizes of
    hundreds of tokens and more, n - 1 would make no practical difference.
    """
    mean = masked_mean(x, mask)
    return masked_mean((x - mean) ** 2, mask)


def masked_whiten(
    x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8
) -> torch.Tensor:
    """x normalised to std 1 (biased, see `masked_var`) over the counted entries, same shape as x.

    shift_mean=True also centres to mean 0 (advantage whitening); shift_mean=False keeps the mean
    (reward whitening: subtracting a constant from every token's reward is a per-token bonus or
    penalty, i.e. a length bias).
    Zero on mask == 0 positions so padding never feeds a later sum.
    """
    mean = masked_mean(x, mask)
    whitened = (x - mean) * torch.rsqrt(masked_var(x, mask) + eps)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(mask.bool(), whitened, torch.zeros_like(whitened))


def _log_softmax(logits: torch.Tensor, temperature: float, suppressed: tuple[int, ...] = ()) -> torch.Tensor:
    """[..., V] float32 log-probabilities at `temperature`: bf16 log_softmax loses the small ratios PPO needs.

    `suppressed` ids (tokens the policy never emits, such as an added PAD) get the lowest finite
    logit, so their probability is exactly 0 while entropy and KL sums stay finite (-inf would
    make 0 · -inf = nan). The fill writes into the fresh scaled copy, never into the model's output.
    """
    scaled = logits.float() / temperature
    if suppressed:
        scaled[..., list(suppressed)] = torch.finfo(scaled.dtype).min
    return torch.log_softmax(scaled, dim=-1)


def logprobs_from_logits(
    logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0, suppressed: tuple[int, ...] = ()
) -> torch.Tensor:
    """[B, T, V] logits, [B, T] tokens -> [B, T] float32 log π(token) at `temperature`.

    The temperature must be the sampler's, or π_old differs from the sampling policy; likewise
    `suppressed` must be the ids the sampler never draws.
    """
    return _log_softmax(logits, temperature, suppressed).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def entropy_from_logits(logits: torch.Tensor, temperature: float = 1.0, suppressed: tuple[int, ...] = ()) -> torch.Tensor:
    """[B, T, V] logits -> [B, T] float32 entropy -Σ_v p log p of the distribution at `temperature`."""
    logp = _log_softmax(logits, temperature, suppressed)
    return -(logp.exp() * logp).sum(-1)


def kl_per_token(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    estimator: str,
    logits: torch.Tensor | None = None,
    ref_logits: torch.Tensor | None = None,
    temperature: float = 1.0,
    suppressed: tuple[int, ...] = (),
) -> torch.Tensor:
    """[B, R] per-token estimate of KL(π || π_ref) at the sampled tokens; not masked (caller masks).

    With Δ = logprobs - ref_logprobs: k1 = Δ (unbiased, can be negative), k2 = Δ²/2,
    k3 = exp(-Δ) - 1 + Δ (non-negative, low variance). "full" is the exact KL over the vocabulary,
    from [B, R, V] `logits` and `ref_logits` at `temperature`, over the tokens not `suppressed` (the
    sampled-token log-probs are then unused). The same estimator must feed the penalty and the logged KL.
    """
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {estimator!r}; valid: {', '.join(KL_ESTIMATORS)}")
    if estimator == "full":
        if logits is None or ref_logits is None:
            raise ValueError('KL estimator "full" needs both logits and ref_logits ([B, R, V])')
        logp = _log_softmax(logits, temperature, suppressed)
        ref_logp = _log_softmax(ref_logits, temperature, suppressed)
        return (logp.exp() * (logp - ref_logp)).sum(-1)
    delta = logprobs - ref_logprobs
    if estimator == "k1":
        return delta
    if estimator == "k2":
        return 0.5 * delta**2
    return torch.expm1(-delta) + delta


@torch.no_grad()
def gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float, lam_per_turn: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation: [B, R] rewards, values, mask -> ([B, R] advantages, [B, R] returns).

    δ_t = r_t + γ V_{t+1} - V_t, with V = 0 after the last counted token (the episode ends at EOS
    or truncation); A_t = δ_t + γλ A_{t+1}; returns = A + V, before any whitening, as value targets.
    t + 1 is the next *counted* position: positions outside the mask (padding, or environment
    tokens inside an episode) carry no reward and no value and the recursion steps over them, so
    the result on the counted positions is GAE over the response with those positions deleted.
    Both outputs are zero outside the mask, and what it holds there cannot leak in.
    `lam_per_turn`: λ weighs the next turn's advantage, not the next token's: within a run of
    counted positions (one turn of an episode) the recursion takes λ = 1, and λ where uncounted
    positions (what the environment and the template said) come next. A turn's credit then does not
    fade with its distance in tokens from the end, only in turns.
    No gradient: advantages and returns are targets. Loops backwards over R (short), vectorised over B.
    """
    counted = mask.bool()
    values = torch.where(counted, values, torch.zeros_like(values))
    next_value = torch.zeros_like(values[:, 0])
    next_advantage = torch.zeros_like(values[:, 0])
    advantages = []
    width = rewards.shape[1]
    for t in reversed(range(width)):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        if lam_per_turn:  # λ only where the turn ends (the next position is not counted)
            within = counted[:, t + 1] if t + 1 < width else torch.zeros_like(counted[:, t])
            advantage = delta + gamma * torch.where(within, 1.0, lam) * next_advantage
        else:
            advantage = delta + gamma * lam * next_advantage
        next_advantage = torch.where(counted[:, t], advantage, next_advantage)  # an uncounted position passes both on
        next_value = torch.where(counted[:, t], values[:, t], next_value)
        advantages.append(torch.where(counted[:, t], advantage, 0.0))
    advantages = torch.stack(advantages[::-1], dim=1)
    return advantages, advantages + values


def discounted_returns(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """[B, R] rewards-to-go G_t = Σ_{s ≥ t} γ^(s-t) r_s over counted tokens, zero on padding.

    The Monte-Carlo return is GAE with no critic (V = 0) and λ = 1, so it is computed by `gae`.
    """
    return gae(rewards, torch.zeros_like(rewards), mask, gamma, 1.0)[0]


def sequence_rewards(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B, R] per-token rewards -> [B] each response's total: its score plus any per-token KL penalty."""
    return masked_sum(rewards, mask, dim=1)


def per_token(sequence_values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B] one value per response -> [B, R] that value on every counted token, zero on padding."""
    spread = sequence_values.unsqueeze(1).expand(mask.shape)
    return torch.where(mask.bool(), spread, torch.zeros_like(spread))


def aggregation_weights(mask: torch.Tensor, mode: str, norm: float = 1.0) -> torch.Tensor | None:
    """Per-token weights w that make a loss term Σ_counted w·ℓ / n aggregate as `mode` says:

    - "token-mean": every token alike, w = 1 (returns None) and n = the tokens of the step;
    - "seq-mean-token-mean": each response's token mean, then the mean over responses (GRPO,
      Shao et al. 2024): w = 1/|y_i| and n = the responses of the step;
    - "seq-mean-token-sum-norm": each response's token sum over a constant, then the mean over
      responses (Dr. GRPO, Liu et al. 2025: no 1/|y_i|, so no length bias): w = 1/norm, n = the responses.

    Each form is a sum of per-token terms over global counts, so it adds up over any split of the
    step into micro-batches and processes. [B, R] mask -> [B, R] weights (or None).
    """
    if mode not in AGGREGATIONS:
        raise ValueError(f"unknown aggregation {mode!r}; valid: {', '.join(AGGREGATIONS)}")
    if mode == "token-mean":
        return None
    if mode == "seq-mean-token-sum-norm":
        return torch.full(mask.shape, 1.0 / norm, device=mask.device)
    lengths = mask.bool().sum(dim=1, keepdim=True).clamp(min=1)
    return (1.0 / lengths).expand(mask.shape).float()


def token_log_ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B, R] -> [B, R] log π_θ - log π_old of each counted token, 0 on padding: exp(garbage) = inf
    there would turn a zero gradient into nan."""
    return torch.where(mask.bool(), logprobs - old_logprobs, torch.zeros_like(logprobs))


def response_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B, R] -> [B, R] each response's mean of x over its counted tokens, on every position (0 for
    a response with no counted token). The gradient reaches every counted token through the mean."""
    counted = mask.bool()
    per_response = masked_mean(x, counted, dim=1)
    per_response = torch.where(counted.any(dim=1), per_response, torch.zeros_like(per_response))
    return per_response.unsqueeze(1).expand(mask.shape)


def sequence_log_ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B, R] -> [B, R] GSPO's length-normalised log-ratio on every position: the mean over response
    i's counted tokens of log π_θ - log π_old (Zheng et al. 2025, "Group Sequence Policy
    Optimization", arXiv:2507.18071), so exp of it is s_i = (π_θ(y_i) / π_old(y_i))^(1/|y_i|).

    One ratio per response, as the reward is one per response; dividing by the length keeps s_i
    near 1 for long and short responses alike (an empty response gets ratio 1).
    """
    return response_mean(token_log_ratio(logprobs, old_logprobs, mask), mask)


def clipped_surrogate(ratio: torch.Tensor, advantages: torch.Tensor, clip_low: float, clip_high: float,
                      dual_clip: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """PPO's clipped surrogate per token: [B, R] ratios and advantages -> ([B, R] loss
    max(-A·ratio, -A·clip(ratio, 1-ε_low, 1+ε_high)), [B, R] bool: the clipped branch strictly
    active, [B, R] bool: the dual-clip bound active, or None without it).

    `dual_clip` = c > 1 also bounds a token with A < 0 at -c·A (Ye et al. 2020, arXiv:1912.09729):
    without it a ratio far above 1 makes -A·ratio unbounded; 0 turns it off. Not masked (the caller
    aggregates over counted tokens).
    """
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    per_token = torch.maximum(unclipped, clipped)
    dual_active = None
    if dual_clip:
        bound = -dual_clip * advantages
        dual_active = (advantages < 0) & (per_token > bound)
        per_token = torch.where(dual_active, bound, per_token)
    return per_token, clipped.detach() > unclipped.detach(), dual_active


def ratio_statistics(log_ratio: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, max) of the ratios a surrogate weighed, over counted tokens (detached)."""
    counted = mask.bool()
    ratio = log_ratio.detach().exp()
    return masked_mean(ratio, counted), torch.where(counted, ratio, float("-inf")).max()


def approx_kl(log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """How far π_θ has moved from π_old: k3 of KL(π_old || π_θ) over the counted tokens of [B, R]
    log π_θ - log π_old, the mean of (ratio - 1) - log ratio (≥ 0; detached)."""
    counted = mask.bool()
    log_ratio = log_ratio.detach()
    ratio = log_ratio.exp()
    return masked_mean((ratio - 1.0) - log_ratio, counted)


@torch.no_grad()
def importance_weights(
    old_logprobs: torch.Tensor,
    sampled_logprobs: torch.Tensor,
    mask: torch.Tensor,
    cap: float,
    level: str = "token",
    mode: str = "truncate",
) -> torch.Tensor:
    """Weights for rollouts drawn by a sampler that is not exactly π_old: [B, R] -> [B, R], 1 on padding.

    When the sampler (vLLM's kernels, lower precision) is not exactly the π_old the trainer
    recomputes, the rollouts come from π_sampler; weighting each token's PPO term by
    ρ = π_old / π_sampler corrects for it (Yao et al. 2025, "Your efficient RL framework secretly
    brings you off-policy RL training"). `level = "token"` takes each token's own ρ_t;
    "sequence" the response's ρ = Π_t ρ_t, the weight of the whole sampled response, on each of its
    tokens: the reward is one per response, and only the product corrects its distribution
    without bias, at a higher variance. `mode = "truncate"` (TIS) uses min(ρ, cap), which bounds
    the variance rare tokens with a tiny sampler probability bring; "mask" (MIS) uses ρ where
    ρ ≤ cap and 0 above, dropping those tokens or responses outright (the sequence-level forms,
    compared in Qi et al. 2025, "Defeating the Training-Inference Mismatch via FP16",
    arXiv:2510.26788). A target, so no gradient.
    """
    if level not in RATIO_LEVELS:
        raise ValueError(f"unknown importance level {level!r}; valid: {', '.join(RATIO_LEVELS)}")
    if mode not in IS_MODES:
        raise ValueError(f"unknown importance mode {mode!r}; valid: {', '.join(IS_MODES)}")
    counted = mask.bool()
    log_ratio = torch.where(counted, old_logprobs - sampled_logprobs, torch.zeros_like(old_logprobs))
    if level == "sequence":  # the sum of the log-ratios: the product of the ratios, without overflow until exp
        log_ratio = log_ratio.sum(dim=1, keepdim=True).expand(mask.shape)
    ratio = log_ratio.exp()
    weights = ratio.clamp(max=cap) if mode == "truncate" else torch.where(ratio <= cap, ratio, torch.zeros_like(ratio))
    return torch.where(counted, weights, torch.ones_like(weights))


def shaped_scores(scores: torch.Tensor, ended: torch.Tensor, lengths: torch.Tensor, missing_eos_penalty: float = 0.0,
                  max_length: int = 0, overlong_buffer: int = 0, overlong_factor: float = 1.0, clip: float = 0.0) -> torch.Tensor:
    """[B] scores as the rewards take them: less `missing_eos_penalty` for a response that never
    ended, less DAPO's overlong penalty (`overlong_penalty`; off with no buffer), clipped to ±`clip`
    (0: not clipped). The order is the recipe's: penalties first, so a clip bounds the total."""
    scores = scores - missing_eos_penalty * (~ended).float()
    if overlong_buffer:
        scores = scores - overlong_penalty(lengths, max_length, overlong_buffer, overlong_factor)
    if clip:
        scores = scores.clamp(-clip, clip)
    return scores


def token_rewards(scores: torch.Tensor, kl: torch.Tensor, mask: torch.Tensor, kl_coef: float = 0.0) -> torch.Tensor:
    """[B, R] per-token rewards (Ziegler et al. 2019, arXiv:1909.08593): −kl_coef · KL at every
    token, plus the sequence's score at its last counted token (the EOS when there is one).
    `kl_coef` 0: the KL penalty is not in the reward (it is in the loss, or off)."""
    rewards = -kl_coef * kl if kl_coef else torch.zeros_like(kl)
    positions = torch.arange(mask.shape[1], device=mask.device).expand(mask.shape)
    last = torch.where(mask.bool(), positions, -1).max(dim=1).values  # -1: the last column, where nothing counts
    rewards[torch.arange(len(scores), device=scores.device), last] += scores
    return rewards


def overlong_penalty(lengths: torch.Tensor, max_length: int, buffer: int, factor: float = 1.0) -> torch.Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025, arXiv:2503.14476): [B] response lengths in
    tokens -> [B] penalties ≥ 0, to subtract from the scores.

    0 up to max_length - buffer tokens, then rising linearly to `factor` at max_length:
    factor · (length - (max_length - buffer)) / buffer. Responses that approach the limit are
    punished by how far into the buffer they run, not all alike, so the signal is graded.
    """
    start = max_length - buffer
    return factor * (lengths.float() - start).clamp(min=0) / buffer


def clipped_value_error(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
                        clip: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The value loss per token before its ½ and its aggregation: [B, R] -> ([B, R] max((V - R)²,
    (V_clip - R)²), [B, R] bool: the clipped error strictly larger, i.e. the one that sets the loss),
    V_clip = V_old + clip(V - V_old, -ε_v, ε_v): the pessimistic max keeps the critic from moving
    far from V_old in one update."""
    counted = mask.bool()
    # Padded values become 0 first: a garbage value there would turn a zero gradient into nan.
    values = torch.where(counted, values, torch.zeros_like(values))
    values_clipped = old_values + (values - old_values).clamp(-clip, clip)
    unclipped = (values - returns) ** 2
    clipped = (values_clipped - returns) ** 2
    return torch.maximum(unclipped, clipped), clipped.detach() > unclipped.detach()


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Scalar 1 - var(returns - values) / var(returns) over counted tokens of [B, R] inputs.

    1 = the critic predicts the returns, 0 = no better than their mean, < 0 = worse. nan when the
    returns are constant (undefined, rather than a misleading number). Biased variances: the
    n/(n-1) factor would cancel anyway.
    """
    values, returns = values.detach(), returns.detach()
    var_returns = masked_var(returns, mask)
    explained = 1.0 - masked_var(returns - values, mask) / var_returns
    return torch.where(var_returns == 0, float("nan"), explained)


def _group_stats(scores: torch.Tensor, group_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dense group index [B], group sizes [G], group sums [G]) for any long ids, without a loop over groups."""
    _, index = torch.unique(group_ids, return_inverse=True)
    sizes = torch.bincount(index)
    sums = torch.zeros(sizes.shape[0], dtype=scores.dtype, device=scores.device).index_add_(0, index, scores)
    return index, sizes, sums


def group_normalized(
    scores: torch.Tensor, group_ids: torch.Tensor, divide_by_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """GRPO advantage: [B] scores, [B] long group ids -> [B] (score - group mean) / (group std + eps).

    Std is unbiased (divide by n - 1), as torch.std and the GRPO implementations use; a group of one
    has score - mean = 0 and gets 0 (its std is taken as 0, not nan). divide_by_std=False only
    centres, as Dr. GRPO proposes, avoiding the up-weighting of near-constant groups.
    """
    index, sizes, sums = _group_stats(scores, group_ids)
    centred = scores - (sums / sizes)[index]
    if not divide_by_std:
        return centred
    squares = torch.zeros_like(sums).index_add_(0, index, centred**2)
    std = (squares / (sizes - 1).clamp(min=1)).sqrt()
    return centred / (std[index] + eps)


def leave_one_out(scores: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """RLOO advantage: [B] scores, [B] long group ids -> [B] score - mean of the group's other scores.

    The baseline excludes the sample itself, so it is independent of it and the estimate unbiased;
    it needs at least two samples per group.
    """
    index, sizes, sums = _group_stats(scores, group_ids)
    if (sizes < 2).any():
        lonely = torch.unique(group_ids)[sizes < 2].tolist()
        raise ValueError(f"leave_one_out needs at least 2 samples per group; groups of 1: {lonely}")
    others = (sums[index] - scores) / (sizes[index] - 1)
    return scores - others


def constant_groups(scores: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """[B] scores, [B] long group ids -> [B] bool: True where every score of the rollout's group is
    the same (a group of one included).

    A group estimator measures each response against the others of its group, so such a group has
    advantage 0 everywhere and teaches nothing; DAPO's dynamic sampling (Yu et al. 2025,
    arXiv:2503.14476) drops it.
    """
    index, sizes, _ = _group_stats(scores, group_ids)
    highest = torch.full(sizes.shape, float("-inf"), dtype=scores.dtype, device=scores.device).scatter_reduce(0, index, scores, "amax")
    lowest = torch.full(sizes.shape, float("inf"), dtype=scores.dtype, device=scores.device).scatter_reduce(0, index, scores, "amin")
    return (highest == lowest)[index]
