"""rlkit_core.functional against hand-computed numbers and against plain Python loops.

Every hand-computed case writes its arithmetic in a comment, in the worked-example style of
docs/ppo_reference.md; the loop references are deliberately naive (one float at a time) so that they
share no vectorisation trick with the code under test.
"""

import math

import pytest
import torch

from rlkit_core.functional import (
    KL_ESTIMATORS,
    constant_groups,
    entropy_from_logits,
    explained_variance,
    gae,
    group_normalized,
    importance_weights,
    kl_per_token,
    leave_one_out,
    left_padded,
    logprobs_from_logits,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
    overlong_penalty,
    sequence_log_ratio,
    shaped_scores,
    token_rewards,
)

GARBAGE = 1e6


def approx(x, rel=1e-5, abs=1e-6):
    return pytest.approx(x, rel=rel, abs=abs)


def random_mask(generator, b, r):
    """[b, r] float mask, contiguous from 0, lengths 1..r (one row full, one of length 1)."""
    lengths = torch.randint(1, r + 1, (b,), generator=generator)
    lengths[0], lengths[-1] = r, 1
    return (torch.arange(r)[None, :] < lengths[:, None]).float()


def with_garbage(x, mask, value=GARBAGE):
    return torch.where(mask.bool(), x, torch.full_like(x, value))


# ---------------------------------------------------------------- masked reductions


def test_masked_sum_and_mean_by_hand():
    x = torch.tensor([[1.0, 2.0, float("inf")], [4.0, float("nan"), 6.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    # counted entries 1, 2, 4: sum 7, mean 7/3; inf and nan on padding are ignored
    assert masked_sum(x, mask).item() == 7.0
    assert masked_mean(x, mask).item() == approx(7 / 3)
    # per row: [1+2, 4] and [3/2, 4/1]
    assert masked_sum(x, mask, dim=1).tolist() == [3.0, 4.0]
    assert masked_mean(x, mask, dim=1).tolist() == approx([1.5, 4.0])


def test_masked_var_is_biased_by_hand():
    x = torch.tensor([[1.0, 2.0, GARBAGE], [4.0, GARBAGE, GARBAGE]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    # values 1, 2, 4: mean 7/3, deviations -4/3, -1/3, 5/3, squares 16/9 + 1/9 + 25/9 = 42/9;
    # divide by n = 3 (biased) -> 14/9 (unbiased would be 42/9 / 2 = 7/3)
    assert masked_var(x, mask).item() == approx(14 / 9)
    assert masked_var(x, mask).item() == approx(torch.tensor([1.0, 2.0, 4.0]).var(unbiased=False).item())


def test_masked_whiten_by_hand():
    x = torch.tensor([[2.0, 6.0, GARBAGE]])
    mask = torch.tensor([[1, 1, 0]])
    # counted 2, 6: mean 4, biased var ((-2)² + 2²)/2 = 4, std 2 -> (x - 4)/2 = [-1, 1], padding 0
    assert masked_whiten(x, mask)[0].tolist() == approx([-1.0, 1.0, 0.0])
    # scale only: (x - 4)/2 + 4 = [3, 5]; the mean 4 stays
    assert masked_whiten(x, mask, shift_mean=False)[0].tolist() == approx([3.0, 5.0, 0.0])


def whiten_loop(x, mask, shift_mean):
    counted = [v for v, m in zip(x.flatten().tolist(), mask.flatten().tolist()) if m]
    mean = sum(counted) / len(counted)
    var = sum((v - mean) ** 2 for v in counted) / len(counted)
    out = [
        ((v - mean) / math.sqrt(var + 1e-8) + (0.0 if shift_mean else mean)) if m else 0.0
        for v, m in zip(x.flatten().tolist(), mask.flatten().tolist())
    ]
    return torch.tensor(out).reshape(x.shape)


@pytest.mark.parametrize("shift_mean", [True, False])
def test_masked_whiten_matches_loop_and_normalises(shift_mean):
    g = torch.Generator().manual_seed(0)
    mask = random_mask(g, 6, 7)
    x = with_garbage(3.0 + 2.5 * torch.randn(6, 7, generator=g, dtype=torch.float64), mask)
    out = masked_whiten(x, mask, shift_mean=shift_mean)
    torch.testing.assert_close(out, whiten_loop(x, mask, shift_mean).double())
    assert (out[mask == 0] == 0).all()
    expected_mean = 0.0 if shift_mean else masked_mean(x, mask).item()
    assert masked_mean(out, mask).item() == approx(expected_mean)
    assert math.sqrt(masked_var(out, mask).item()) == approx(1.0)


# ---------------------------------------------------------------- log-probs and entropy


def test_logprobs_from_logits_by_hand():
    # logits [0, ln 3]: softmax [1/4, 3/4]
    logits = torch.tensor([[[0.0, math.log(3)], [0.0, math.log(3)]]])
    assert logprobs_from_logits(logits, torch.tensor([[1, 0]]))[0].tolist() == approx([math.log(3 / 4), math.log(1 / 4)])
    # temperature 2 on logits [0, 2 ln 3] gives [0, ln 3] again: log(3/4)
    hot = torch.tensor([[[0.0, 2 * math.log(3)]]])
    assert logprobs_from_logits(hot, torch.tensor([[1]]), temperature=2.0).item() == approx(math.log(3 / 4))


def test_logprobs_from_logits_matches_loop_and_is_float32():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 3, 5, generator=g)
    tokens = torch.randint(0, 5, (2, 3), generator=g)
    out = logprobs_from_logits(logits, tokens, temperature=0.7)
    for b in range(2):
        for t in range(3):
            row = [v / 0.7 for v in logits[b, t].tolist()]
            log_z = math.log(sum(math.exp(v) for v in row))
            assert out[b, t].item() == approx(row[tokens[b, t]] - log_z)
    assert logprobs_from_logits(logits.bfloat16(), tokens).dtype == torch.float32


def test_entropy_from_logits_by_hand_and_loop():
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [0.0, math.log(3), -1e4, -1e4]]])
    # uniform over 4: ln 4; [1/4, 3/4, 0, 0]: -(1/4 ln 1/4 + 3/4 ln 3/4) = 0.5623351
    expected = [math.log(4), -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))]
    assert entropy_from_logits(logits)[0].tolist() == approx(expected)
    assert expected[1] == approx(0.5623351)
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(2, 3, 6, generator=g)
    out = entropy_from_logits(logits, temperature=1.3)
    for b in range(2):
        for t in range(3):
            exps = [math.exp(v / 1.3) for v in logits[b, t].tolist()]
            probs = [e / sum(exps) for e in exps]
            assert out[b, t].item() == approx(-sum(p * math.log(p) for p in probs))


# ---------------------------------------------------------------- KL estimators


def test_kl_estimators_by_hand():
    logprobs = torch.tensor([[-1.0, -2.0]])
    ref = torch.tensor([[-1.5, -1.0]])
    # Δ = [0.5, -1]
    assert kl_per_token(logprobs, ref, "k1")[0].tolist() == approx([0.5, -1.0])
    # Δ²/2 = [0.125, 0.5]
    assert kl_per_token(logprobs, ref, "k2")[0].tolist() == approx([0.125, 0.5])
    # exp(-Δ) - 1 + Δ: e^-0.5 - 0.5 = 0.6065307 - 0.5 = 0.1065307; e^1 - 1 - 1 = 0.7182818
    assert kl_per_token(logprobs, ref, "k3")[0].tolist() == approx([0.1065307, 0.7182818])


def test_full_kl_by_hand():
    # p = [1/4, 3/4], p_ref = [1/2, 1/2]:
    # 1/4 ln(1/2) + 3/4 ln(3/2) = -0.1732868 + 0.3040988 = 0.1308120
    logits = torch.tensor([[[0.0, math.log(3)]]])
    ref_logits = torch.tensor([[[5.0, 5.0]]])
    unused = torch.zeros(1, 1)
    full = kl_per_token(unused, unused, "full", logits=logits, ref_logits=ref_logits)
    assert full.item() == approx(0.1308120)
    # temperature 2 applied to both: [0, 2 ln 3] / 2 = [0, ln 3] again, ref stays uniform
    hot = kl_per_token(unused, unused, "full", logits=2 * logits, ref_logits=ref_logits, temperature=2.0)
    assert hot.item() == approx(0.1308120)


@pytest.mark.parametrize("estimator", KL_ESTIMATORS)
def test_kl_estimators_match_loop(estimator):
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 4, 5, generator=g)
    ref_logits = logits + 0.5 * torch.randn(2, 4, 5, generator=g)
    tokens = torch.randint(0, 5, (2, 4), generator=g)
    temperature = 0.8
    logprobs = logprobs_from_logits(logits, tokens, temperature)
    ref_logprobs = logprobs_from_logits(ref_logits, tokens, temperature)
    out = kl_per_token(logprobs, ref_logprobs, estimator, logits, ref_logits, temperature)
    for b in range(2):
        for t in range(4):
            d = logprobs[b, t].item() - ref_logprobs[b, t].item()
            if estimator == "full":
                p = torch.softmax(logits[b, t].double() / temperature, -1).tolist()
                q = torch.softmax(ref_logits[b, t].double() / temperature, -1).tolist()
                expected = sum(pv * (math.log(pv) - math.log(qv)) for pv, qv in zip(p, q))
            else:
                expected = {"k1": d, "k2": d * d / 2, "k3": math.exp(-d) - 1 + d}[estimator]
            assert out[b, t].item() == approx(expected, rel=1e-4, abs=1e-6)


def test_k3_non_negative_and_zero_when_equal():
    g = torch.Generator().manual_seed(4)
    logprobs = -3 * torch.rand(50, 20, generator=g)
    ref = -3 * torch.rand(50, 20, generator=g)
    assert (kl_per_token(logprobs, ref, "k3") >= 0).all()
    for estimator in ("k1", "k2", "k3"):
        assert (kl_per_token(logprobs, logprobs, estimator) == 0).all()
    logits = torch.randn(3, 4, 7, generator=g)
    assert kl_per_token(logprobs, ref, "full", logits, logits).abs().max().item() < 1e-6


def test_kl_rejects_unknown_estimator_and_missing_logits():
    x = torch.zeros(1, 1)
    with pytest.raises(ValueError, match="k1, k2, k3, full"):
        kl_per_token(x, x, "k4")
    with pytest.raises(ValueError, match="logits"):
        kl_per_token(x, x, "full")


# ---------------------------------------------------------------- GAE


def test_gae_by_hand():
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, GARBAGE]])
    values = torch.tensor([[0.5, 0.6, 0.7], [1.0, 0.5, GARBAGE]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    # row 0, γ = 1, λ = 0.9, V after the last token = 0:
    #   t=2: δ = 1 + 0 - 0.7 = 0.3;   A = 0.3
    #   t=1: δ = 0 + 0.7 - 0.6 = 0.1; A = 0.1 + 0.9 · 0.3 = 0.37
    #   t=0: δ = 0 + 0.6 - 0.5 = 0.1; A = 0.1 + 0.9 · 0.37 = 0.433
    #   returns = A + V = [0.933, 0.97, 1.0]
    advantages, returns = gae(rewards[:1], values[:1], mask[:1], gamma=1.0, lam=0.9)
    assert advantages[0].tolist() == approx([0.433, 0.37, 0.3])
    assert returns[0].tolist() == approx([0.933, 0.97, 1.0])
    # row 1, γ = 0.9, λ = 0.5, t=2 is padding (garbage 1e6 must not leak):
    #   t=1: δ = 2 + 0 - 0.5 = 1.5;          A = 1.5
    #   t=0: δ = 0 + 0.9 · 0.5 - 1 = -0.55;  A = -0.55 + 0.45 · 1.5 = 0.125
    #   returns = [1.125, 2.0, 0]
    advantages, returns = gae(rewards[1:], values[1:], mask[1:], gamma=0.9, lam=0.5)
    assert advantages[0].tolist() == approx([0.125, 1.5, 0.0])
    assert returns[0].tolist() == approx([1.125, 2.0, 0.0])


def gae_loop(rewards, values, mask, gamma, lam):
    all_adv, all_ret = [], []
    for r_row, v_row, m_row in zip(rewards.tolist(), values.tolist(), mask.tolist()):
        n = int(sum(m_row))
        adv = [0.0] * len(r_row)
        running = 0.0
        for t in reversed(range(n)):
            next_value = v_row[t + 1] if t + 1 < n else 0.0
            running = r_row[t] + gamma * next_value - v_row[t] + gamma * lam * running
            adv[t] = running
        all_adv.append(adv)
        all_ret.append([a + v if t < n else 0.0 for t, (a, v) in enumerate(zip(adv, v_row))])
    return torch.tensor(all_adv, dtype=torch.float64), torch.tensor(all_ret, dtype=torch.float64)


@pytest.mark.parametrize("gamma, lam", [(1.0, 0.95), (0.99, 0.9), (1.0, 1.0), (0.9, 0.0)])
@pytest.mark.parametrize("padded", [False, True])
def test_gae_matches_loop(gamma, lam, padded):
    g = torch.Generator().manual_seed(5)
    b, r = 5, 8
    mask = random_mask(g, b, r) if padded else torch.ones(b, r)
    rewards = with_garbage(torch.randn(b, r, generator=g, dtype=torch.float64), mask)
    values = with_garbage(torch.randn(b, r, generator=g, dtype=torch.float64), mask, -GARBAGE)
    advantages, returns = gae(rewards, values, mask, gamma, lam)
    expected_adv, expected_ret = gae_loop(rewards, values, mask, gamma, lam)
    torch.testing.assert_close(advantages, expected_adv)
    torch.testing.assert_close(returns, expected_ret)


def test_gae_padding_garbage_does_not_leak():
    g = torch.Generator().manual_seed(6)
    mask = random_mask(g, 4, 6)
    rewards, values = torch.randn(4, 6, generator=g), torch.randn(4, 6, generator=g)
    clean = gae(with_garbage(rewards, mask, 0.0), with_garbage(values, mask, 0.0), mask, 1.0, 0.95)
    for junk in (GARBAGE, -GARBAGE, float("inf"), float("nan")):
        dirty = gae(with_garbage(rewards, mask, junk), with_garbage(values, mask, junk), mask, 1.0, 0.95)
        for got, want in zip(dirty, clean):
            assert torch.equal(got, want)
            assert (got[mask == 0] == 0).all()


def test_gae_detaches():
    values = torch.randn(2, 3, requires_grad=True)
    advantages, returns = gae(torch.randn(2, 3), values, torch.ones(2, 3), 1.0, 0.95)
    assert not advantages.requires_grad and not returns.requires_grad


# ---------------------------------------------------------------- explained variance


def test_explained_variance_by_hand():
    returns = torch.tensor([[1.0, 2.0, 3.0, GARBAGE]])
    mask = torch.tensor([[1, 1, 1, 0]])
    # var(R) over [1, 2, 3] = 2/3; residual [0.5, 0, -0.5], var 1/6 -> 1 - (1/6)/(2/3) = 0.75
    values = torch.tensor([[0.5, 2.0, 3.5, -GARBAGE]])
    assert explained_variance(values, returns, mask).item() == approx(0.75)
    # perfect critic -> 1; constant critic -> residual variance = var(R) -> 0
    assert explained_variance(returns, returns, mask).item() == approx(1.0)
    assert explained_variance(torch.full((1, 4), 7.0), returns, mask).item() == approx(0.0)
    # constant returns: undefined -> nan
    assert math.isnan(explained_variance(values, torch.ones(1, 4), mask).item())


# ---------------------------------------------------------------- group baselines


def test_group_normalized_by_hand():
    scores = torch.tensor([1.0, 2.0, 3.0, 5.0, 5.0, 10.0, 0.0, 4.0])
    group_ids = torch.tensor([7, 7, 7, 3, 3, 9, 1, 1])
    # group 7: mean 2, unbiased std sqrt((1 + 0 + 1)/2) = 1 -> [-1, 0, 1]
    # group 3: mean 5, std 0 -> [0, 0] (0/eps)
    # group 9: a single sample: 10 - 10 = 0 -> 0
    # group 1: mean 2, unbiased std sqrt((4 + 4)/1) = 2√2 -> ∓2/(2√2) = ∓0.7071068
    expected = [-1.0, 0.0, 1.0, 0.0, 0.0, 0.0, -0.7071068, 0.7071068]
    assert group_normalized(scores, group_ids).tolist() == approx(expected)
    assert group_normalized(scores, group_ids, divide_by_std=False).tolist() == approx(
        [-1.0, 0.0, 1.0, 0.0, 0.0, 0.0, -2.0, 2.0]
    )


def test_leave_one_out_by_hand():
    scores = torch.tensor([1.0, 5.0, 2.0, 7.0, 3.0])
    group_ids = torch.tensor([0, 4, 0, 4, 0])
    # group 0 = [1, 2, 3]: baselines (2+3)/2 = 2.5, (1+3)/2 = 2, (1+2)/2 = 1.5 -> [-1.5, 0, 1.5]
    # group 4 = [5, 7]: baselines 7, 5 -> [-2, 2]
    assert leave_one_out(scores, group_ids).tolist() == approx([-1.5, -2.0, 0.0, 2.0, 1.5])


def test_leave_one_out_rejects_singletons():
    with pytest.raises(ValueError, match=r"at least 2 samples per group.*\[9\]"):
        leave_one_out(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([4, 4, 9]))


def test_group_helpers_match_loop():
    g = torch.Generator().manual_seed(10)
    group_ids = torch.randint(100, 106, (40,), generator=g)
    group_ids[:12] = torch.arange(100, 106).repeat(2)  # every group has at least 2 samples
    group_ids = group_ids[torch.randperm(40, generator=g)]
    scores = torch.randn(40, generator=g, dtype=torch.float64)
    grpo = group_normalized(scores, group_ids)
    centred = group_normalized(scores, group_ids, divide_by_std=False)
    rloo = leave_one_out(scores, group_ids)
    for i in range(40):
        members = scores[group_ids == group_ids[i]]
        others = [s for j, s in enumerate(scores.tolist()) if j != i and group_ids[j] == group_ids[i]]
        mean = members.mean().item()
        assert grpo[i].item() == approx((scores[i].item() - mean) / (members.std().item() + 1e-6))
        assert centred[i].item() == approx(scores[i].item() - mean)
        assert rloo[i].item() == approx(scores[i].item() - sum(others) / len(others))


def test_token_truncated_is_weights_by_hand():
    old = torch.tensor([[-1.0, -2.0, -0.5, GARBAGE]])
    sampled = torch.tensor([[-1.0, -2.0 - math.log(1.5), -0.5 + math.log(4.0), 0.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    # π_old/π_sampler per token: 1, 1.5, 0.25; cap 1.2 truncates 1.5; padding gets 1
    weights = importance_weights(old, sampled, mask, cap=1.2)  # token level, truncated: the defaults
    assert weights[0].tolist() == approx([1.0, 1.2, 0.25, 1.0])
    assert not weights.requires_grad


# ---------------------------------------------------------------- GSPO's sequence ratio
# (the losses themselves are checked by hand through the ppo-clip loss, in tests/test_ppo_clip.py)


def test_sequence_log_ratio_by_hand():
    old = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -0.5, GARBAGE]])
    token_log_ratio = torch.tensor([[0.3, -0.1, 0.1], [0.02, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    # mean log-ratios: (0.3 - 0.1 + 0.1) / 3 = 0.1 and (0.02 + 0) / 2 = 0.01, on every position
    assert sequence_log_ratio(old + token_log_ratio, old, mask).flatten().tolist() == approx([0.1] * 3 + [0.01] * 3)


def test_sequence_log_ratio_matches_loop_and_ignores_padding():
    g = torch.Generator().manual_seed(11)
    mask = random_mask(g, 5, 7)
    old = with_garbage(-torch.rand(5, 7, generator=g, dtype=torch.float64), mask, float("-inf"))
    new = with_garbage(-torch.rand(5, 7, generator=g, dtype=torch.float64), mask, float("inf")).requires_grad_()
    got = sequence_log_ratio(new, old, mask)
    for i in range(5):
        diffs = [n - o for n, o, m in zip(new[i].tolist(), old[i].tolist(), mask[i].tolist()) if m]
        assert got[i].tolist() == approx([sum(diffs) / len(diffs)] * 7)
    got.sum().backward()
    assert torch.isfinite(new.grad).all() and (new.grad[mask == 0] == 0).all()


def test_sequence_and_masked_importance_weights_by_hand():
    old = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -3.0, GARBAGE]])
    # π_old/π_sampler per token: row 0: 1.5, 0.5, 2; row 1: 4, padding
    sampled = old - torch.tensor([[math.log(1.5), math.log(0.5), math.log(2.0)], [math.log(4.0), 0.0, 0.0]])
    sampled[1, 2] = 0.0
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    # sequence: row 0: 1.5 · 0.5 · 2 = 1.5; row 1: 4. cap 2: truncate -> 1.5, 2; mask -> 1.5, 0. Padding 1.
    assert importance_weights(old, sampled, mask, 2.0, "sequence", "truncate").flatten().tolist() == approx([1.5] * 3 + [2.0, 1.0, 1.0])
    assert importance_weights(old, sampled, mask, 2.0, "sequence", "mask").flatten().tolist() == approx([1.5] * 3 + [0.0, 1.0, 1.0])
    # token, cap 1.8: truncate -> 1.5, 0.5, 1.8 and 1.8; mask -> 1.5, 0.5, 0 and 0
    assert importance_weights(old, sampled, mask, 1.8, "token", "mask").flatten().tolist() == approx([1.5, 0.5, 0.0, 0.0, 1.0, 1.0])
    assert importance_weights(old, sampled, mask, 1.8).flatten().tolist() == approx([1.5, 0.5, 1.8, 1.8, 1.0, 1.0])


def test_overlong_penalty_by_hand():
    # L_max = 40, buffer 4: 0 up to 36 tokens, then (length - 36) / 4 · 0.5
    lengths = torch.tensor([30, 36, 37, 38, 40])
    assert overlong_penalty(lengths, 40, 4, 0.5).tolist() == approx([0.0, 0.0, 0.125, 0.25, 0.5])
    # factor 1, buffer 10 of 20: length 15 -> 5 / 10 = 0.5
    assert overlong_penalty(torch.tensor([15]), 20, 10).tolist() == approx([0.5])


def test_constant_groups_by_hand_and_against_loop():
    scores = torch.tensor([1.0, 1.0, 0.5, 0.7, 2.0, 2.0, 2.0, 3.0])
    group_ids = torch.tensor([5, 5, 2, 2, 9, 9, 9, 4])
    # group 5: 1, 1 alike; group 2: 0.5 ≠ 0.7; group 9: all 2; group 4: one score, alike
    assert constant_groups(scores, group_ids).tolist() == [True, True, False, False, True, True, True, True]
    g = torch.Generator().manual_seed(12)
    scores = torch.randint(0, 3, (40,), generator=g).float()  # few values: some groups alike
    group_ids = torch.randint(0, 12, (40,), generator=g)
    got = constant_groups(scores, group_ids).tolist()
    for i in range(40):
        members = {s for s, gid in zip(scores.tolist(), group_ids.tolist()) if gid == group_ids[i]}
        assert got[i] == (len(members) == 1)
    assert any(got) and not all(got)


def test_shaped_scores_by_hand():
    scores, ended, lengths = torch.tensor([1.0, 2.0, 0.5]), torch.tensor([True, False, True]), torch.tensor([3, 10, 9])
    # no setting: the scores as they are
    assert shaped_scores(scores, ended, lengths).tolist() == [1.0, 2.0, 0.5]
    # missing EOS: the second never ended, 2 - 0.5 = 1.5; limit 10, buffer 4: lengths 10 and 9 lose
    # (10 - 6) / 4 · 1 = 1 and (9 - 6) / 4 = 0.75; then the clip at ±0.8 bounds the totals
    shaped = shaped_scores(scores, ended, lengths, missing_eos_penalty=0.5, max_length=10, overlong_buffer=4)
    assert shaped.tolist() == approx([1.0, 0.5, -0.25])
    assert shaped_scores(scores, ended, lengths, 0.5, 10, 4, clip=0.8).tolist() == approx([0.8, 0.5, -0.25])
    assert shaped_scores(torch.tensor([-3.0]), torch.tensor([True]), torch.tensor([1]), clip=2.0).tolist() == [-2.0]


def test_token_rewards_by_hand():
    scores = torch.tensor([2.0, -1.0])
    kl = torch.tensor([[0.1, 0.2, 0.3], [0.4, 0.0, 0.0]])  # zero on padding, as the trainer keeps it
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    # β 0.5: -0.05, -0.1, -0.15 + 2 at the last counted token; the second row's only token: -0.2 - 1
    assert token_rewards(scores, kl, mask, kl_coef=0.5).flatten().tolist() == approx([-0.05, -0.1, 1.85, -0.2 - 1.0, 0.0, 0.0])
    # no KL in the reward: the score alone, at each row's last counted token
    assert token_rewards(scores, kl, mask).tolist() == [[0.0, 0.0, 2.0], [-1.0, 0.0, 0.0]]


def test_gae_with_lam_per_turn_fades_credit_by_turns_not_tokens():
    """Two turns of two counted tokens with one rendered token between; γ = 1, λ = 0.5, reward 1 at
    the end, V = 0.1, 0.2, (none), 0.3, 0.4. λ applies only where the turn ends (after t1):
      t4: δ = 1 − 0.4 = 0.6,        A = 0.6
      t3: δ = 0.4 − 0.3 = 0.1,      A = 0.1 + 1·0.6 = 0.7   (within the turn: λ = 1)
      t1: δ = 0.3 − 0.2 = 0.1,      A = 0.1 + 0.5·0.7 = 0.45 (the turn ends: λ)
      t0: δ = 0.2 − 0.1 = 0.1,      A = 0.1 + 1·0.45 = 0.55
    Per token, the same rewards with V = 0 give 0.125, 0.25, 0.5, 1; per turn 0.5, 0.5, 1, 1."""
    mask = torch.tensor([[1, 1, 0, 1, 1]])
    rewards = torch.tensor([[0.0, 0.0, 0.0, 0.0, 1.0]])
    values = torch.tensor([[0.1, 0.2, 9.0, 0.3, 0.4]])
    advantages, returns = gae(rewards, values, mask, 1.0, 0.5, lam_per_turn=True)
    torch.testing.assert_close(advantages, torch.tensor([[0.55, 0.45, 0.0, 0.7, 0.6]]))
    torch.testing.assert_close(returns, torch.tensor([[0.65, 0.65, 0.0, 1.0, 1.0]]))
    per_turn, _ = gae(rewards, torch.zeros_like(values), mask, 1.0, 0.5, lam_per_turn=True)
    per_token, _ = gae(rewards, torch.zeros_like(values), mask, 1.0, 0.5)
    torch.testing.assert_close(per_turn, torch.tensor([[0.5, 0.5, 0.0, 1.0, 1.0]]))
    torch.testing.assert_close(per_token, torch.tensor([[0.125, 0.25, 0.0, 0.5, 1.0]]))


def test_left_padded_puts_each_row_at_the_right_edge():
    ids, mask = left_padded([[5, 6, 7], [8], [9, 10]], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8], [0, 9, 10]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1], [0, 1, 1]]
    assert ids.dtype == mask.dtype == torch.long
