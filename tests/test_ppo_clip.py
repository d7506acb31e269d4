"""The `ppo-clip` loss and its `ppo` and `gspo` surrogates, built from a recipe as `rlkit run` builds
them, against hand-computed numbers and a plain loop; with the update's own `approx_kl` over what
the loss weighed (`runtime.update.policy_diagnostics`). The arithmetic is in the comments, in the
worked-example style of docs/ppo_reference.md."""

import math

import torch
from test_functional import GARBAGE, approx, random_mask, with_garbage

from rlkit_core.context import BuildContext
from rlkit_core.functional import masked_mean
from rlkit_core.interfaces import LossInputs
from rlkit_core.recipe.document import parse_recipe
from rlkit_core.runtime.update import policy_diagnostics
from rlkit_core.testing import rollout_batch


def ppo_clip(document, registry, **loss):
    """The loss a recipe with `[loss]` = {type = "ppo-clip", **loss} builds."""
    document["loss"] = {"type": "ppo-clip", **loss}
    recipe = parse_recipe(document, registry)
    return BuildContext(recipe, torch.device("cpu"), recipe.run.output_dir, 0).build(recipe["loss"])


def minibatch(mask, old, advantages, sampled=None, values=None, returns=None):
    """A minibatch of len(mask) ≤ 6 rollouts with these [b, R] fields (the loss reads no others)."""
    return rollout_batch(with_values=values is not None).select(torch.arange(mask.shape[0])).with_(
        response_mask=mask, loss_mask=mask, old_logprobs=old, sampled_logprobs=old if sampled is None else sampled,
        advantages=advantages, values=values, returns=returns)


def run(loss, batch, logprobs, token_count, values=None):
    """(the loss's terms, the update's own diagnostics of them) for the current log-probs."""
    current = LossInputs(logprobs=logprobs, values=values, entropy=torch.zeros_like(logprobs))
    terms = loss(batch, current, token_count)
    return terms, policy_diagnostics(batch, current, terms)


# ---------------------------------------------------------------- the ppo surrogate


def by_hand_case():
    ratio = torch.tensor([[1.5, 0.5, 1.1, 0.5, 1.0]])
    old = torch.tensor([[-1.0, -2.0, -0.5, -3.0, GARBAGE]])
    logprobs = old + ratio.log()
    logprobs[0, 4] = float("inf")  # padding garbage
    advantages = torch.tensor([[1.0, -1.0, 2.0, 1.0, GARBAGE]])
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    return minibatch(mask, old, advantages), logprobs, ratio


def test_ppo_by_hand(recipe_document, builtin_registry):
    batch, logprobs, _ = by_hand_case()
    loss = ppo_clip(recipe_document, builtin_registry, clip=0.2)
    # ε = 0.2, per token max(-A·r, -A·clip(r, 0.8, 1.2)):
    #   A= 1, r=1.5: max(-1.5, -1.2) = -1.2  clipped branch active
    #   A=-1, r=0.5: max( 0.5,  0.8) =  0.8  clipped branch active
    #   A= 2, r=1.1: max(-2.2, -2.2) = -2.2  tie: not counted as clipped
    #   A= 1, r=0.5: max(-0.5, -0.8) = -0.5  r outside the range, but the unclipped branch is active
    # sum = -1.2 + 0.8 - 2.2 - 0.5 = -3.1; token_count 4 -> -0.775; clipfrac 2/4
    terms, loop = run(loss, batch, logprobs, 4.0)
    assert terms.losses["policy"].item() == approx(-0.775)
    assert terms.diagnostics["clipfrac"].item() == approx(0.5)
    # approx_kl = mean of (r - 1) - ln r:
    #   1.5: 0.5 - 0.4054651 = 0.0945349; 0.5: -0.5 + 0.6931472 = 0.1931472 (twice);
    #   1.1: 0.1 - 0.0953102 = 0.0046898; sum 0.4855191 / 4 = 0.1213798
    assert loop["approx_kl"].item() == approx(0.1213798)
    # ratio mean (1.5 + 0.5 + 1.1 + 0.5)/4 = 0.9, max 1.5
    assert terms.diagnostics["ratio_mean"].item() == approx(0.9)
    assert terms.maxima["ratio_max"].item() == approx(1.5)
    # every counted ratio 0.5: the max is 0.5, the padding (ratio 1 after masking) does not count
    halved, _ = run(loss, batch, batch.old_logprobs + math.log(0.5), 4.0)
    assert halved.maxima["ratio_max"].item() == approx(0.5)
    # a global token count of 8 (this minibatch is half the accumulated batch) halves the loss
    assert run(loss, batch, logprobs, 8.0)[0].losses["policy"].item() == approx(-0.3875)


def test_ppo_at_ratio_one(recipe_document, builtin_registry):
    g = torch.Generator().manual_seed(7)
    mask = random_mask(g, 4, 6)
    logprobs = -torch.rand(4, 6, generator=g)
    advantages = with_garbage(torch.randn(4, 6, generator=g), mask)
    loss = ppo_clip(recipe_document, builtin_registry, clip=0.2)
    terms, loop = run(loss, minibatch(mask, logprobs.clone(), advantages), logprobs, float(mask.sum()))
    assert terms.losses["policy"].item() == approx(-masked_mean(advantages, mask).item())
    assert terms.diagnostics["clipfrac"].item() == 0.0
    assert loop["approx_kl"].item() == approx(0.0)
    assert terms.diagnostics["ratio_mean"].item() == approx(1.0)


def ppo_loop(logprobs, old, advantages, mask, clip, token_count):
    total, clipped_n, kl, counted = 0.0, 0, 0.0, 0
    for lp, o, a, m in zip(*(x.flatten().tolist() for x in (logprobs, old, advantages, mask))):
        if not m:
            continue
        r = math.exp(lp - o)
        unclipped, clipped = -a * r, -a * min(max(r, 1 - clip), 1 + clip)
        total += max(unclipped, clipped)
        clipped_n += clipped > unclipped
        kl += (r - 1) - (lp - o)
        counted += 1
    return total / token_count, clipped_n / counted, kl / counted


def test_ppo_matches_loop_and_gradients_ignore_padding(recipe_document, builtin_registry):
    g = torch.Generator().manual_seed(8)
    mask = random_mask(g, 6, 10)
    old = -torch.rand(6, 10, generator=g, dtype=torch.float64)
    new = (old + 0.4 * torch.randn(6, 10, generator=g, dtype=torch.float64)).requires_grad_()
    advantages = with_garbage(torch.randn(6, 10, generator=g, dtype=torch.float64), mask, float("inf"))
    old = with_garbage(old, mask, float("-inf"))  # exp(new - old) = inf on padding
    token_count = 2 * mask.sum()
    loss = ppo_clip(recipe_document, builtin_registry, clip=0.2)
    terms, loop = run(loss, minibatch(mask, old, advantages), new, float(token_count))
    expected, clipfrac, kl = ppo_loop(new.detach(), old, advantages, mask, 0.2, token_count.item())
    assert terms.losses["policy"].item() == approx(expected)
    assert terms.diagnostics["clipfrac"].item() == approx(clipfrac)
    assert 0 < clipfrac < 1  # both branches exercised
    assert loop["approx_kl"].item() == approx(kl)
    for value in (terms.diagnostics["clipfrac"], terms.diagnostics["ratio_mean"], terms.maxima["ratio_max"], loop["approx_kl"]):
        assert not value.requires_grad
    terms.total().backward()
    assert new.grad is not None and torch.isfinite(new.grad).all()
    assert (new.grad[mask == 0] == 0).all()


def test_ppo_weighs_each_token_by_its_importance_weight(recipe_document, builtin_registry):
    # the hand-computed case of test_ppo_by_hand: per-token terms -1.2, 0.8, -2.2, -0.5, each
    # weighted by π_old/π_sampler with tis_cap 2 masking (MIS): ratios 1, 2, 0.5, 4 -> weights 1, 2, 0.5, 0
    batch, logprobs, _ = by_hand_case()
    old = batch.old_logprobs
    sampled = old - torch.tensor([[0.0, math.log(2.0), math.log(0.5), math.log(4.0), 0.0]])
    batch = batch.with_(sampled_logprobs=sampled)
    logprobs = logprobs.clone().requires_grad_()
    loss = ppo_clip(recipe_document, builtin_registry, clip=0.2, tis_cap=2.0, is_mode="mask")
    terms, _ = run(loss, batch, logprobs, 4.0)
    # 1·(-1.2) + 2·0.8 + 0.5·(-2.2) + 0·(-0.5) = -0.7; / 4 = -0.175
    assert terms.losses["policy"].item() == approx(-0.175)
    assert terms.diagnostics["tis_weight_mean"].item() == approx(3.5 / 4)
    assert terms.diagnostics["tis_capped_frac"].item() == approx(1 / 4)  # the masked weight
    terms.total().backward()
    # only the unclipped third token has a gradient: d/dlogprob of w·(-A·r) / 4 = 0.5·(-2·1.1) / 4
    assert logprobs.grad is not None
    assert logprobs.grad[0].tolist() == approx([0.0, 0.0, -0.275, 0.0, 0.0])


# ---------------------------------------------------------------- policy-loss variants (DAPO, dual-clip, GSPO)


def test_ppo_asymmetric_clip_by_hand(recipe_document, builtin_registry):
    # the case of test_ppo_by_hand with ε_low = 0.4, ε_high = 0.3: clip(r, 0.6, 1.3)
    batch, logprobs, _ = by_hand_case()
    #   A= 1, r=1.5: max(-1.5, -1.3) = -1.3  clipped at 1 + ε_high
    #   A=-1, r=0.5: max( 0.5,  0.6) =  0.6  clipped at 1 - ε_low
    #   A= 2, r=1.1: -2.2 (tie);  A= 1, r=0.5: max(-0.5, -0.6) = -0.5
    # sum = -1.3 + 0.6 - 2.2 - 0.5 = -3.4; / 4 = -0.85; clipfrac 2/4
    terms, _ = run(ppo_clip(recipe_document, builtin_registry, clip=0.4, clip_high=0.3), batch, logprobs, 4.0)
    assert terms.losses["policy"].item() == approx(-0.85)
    assert terms.diagnostics["clipfrac"].item() == approx(0.5)
    # clip_high = clip is the symmetric clip: -0.775 as in test_ppo_by_hand
    terms, _ = run(ppo_clip(recipe_document, builtin_registry, clip=0.2, clip_high=0.2), batch, logprobs, 4.0)
    assert terms.losses["policy"].item() == approx(-0.775)


def test_ppo_dual_clip_by_hand(recipe_document, builtin_registry):
    ratio = torch.tensor([[4.0, 2.0, 4.0, 0.5, 1.0]])
    old = torch.tensor([[-1.0, -2.0, -0.5, -3.0, GARBAGE]])
    logprobs = (old + ratio.log()).requires_grad_()
    batch = minibatch(torch.tensor([[1, 1, 1, 1, 0]]), old, torch.tensor([[-1.0, -1.0, 1.0, -2.0, GARBAGE]]))
    # ε = 0.2, c = 3; PPO's term max(-A·r, -A·clip(r, 0.8, 1.2)), then for A < 0 at most -c·A:
    #   A=-1, r=4:   max(4, 1.2) = 4 > 3 -> 3   the dual clip active
    #   A=-1, r=2:   max(2, 1.2) = 2 ≤ 3 -> 2
    #   A= 1, r=4:   max(-4, -1.2) = -1.2       A > 0: no dual clip
    #   A=-2, r=0.5: max(1, 1.6) = 1.6 ≤ 6 -> 1.6
    # sum = 3 + 2 - 1.2 + 1.6 = 5.4; / 4 = 1.35 (without the dual clip 6.4 / 4 = 1.6)
    terms, _ = run(ppo_clip(recipe_document, builtin_registry, clip=0.2, dual_clip=3.0), batch, logprobs, 4.0)
    assert terms.losses["policy"].item() == approx(1.35)
    assert terms.diagnostics["dual_clipfrac"].item() == approx(0.25)
    without, _ = run(ppo_clip(recipe_document, builtin_registry, clip=0.2), batch, logprobs, 4.0)
    assert without.losses["policy"].item() == approx(1.6) and "dual_clipfrac" not in without.diagnostics
    terms.total().backward()
    # only the second token's unclipped term -A·r depends on θ: d/dlogprob = -A·r / 4 = 2 / 4
    assert logprobs.grad is not None
    assert logprobs.grad[0].tolist() == approx([0.0, 0.5, 0.0, 0.0, 0.0])


def test_gspo_by_hand(recipe_document, builtin_registry):
    old = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -0.5, GARBAGE]])
    token_log_ratio = torch.tensor([[0.3, -0.1, 0.1], [0.02, 0.0, 0.0]])
    logprobs = (old + token_log_ratio).requires_grad_()
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    batch = minibatch(mask, old, torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, GARBAGE]]))
    # GSPO's mean over responses: seq-mean-token-mean weighs the tokens 1/3 and 1/2 and divides by
    # the step's responses, ppo.minibatch_size = 2
    recipe_document["ppo"].update(minibatch_size=2)
    loss = ppo_clip(recipe_document, builtin_registry, surrogate="gspo", clip=0.05, aggregation="seq-mean-token-mean")
    # mean log-ratios: (0.3 - 0.1 + 0.1) / 3 = 0.1 and (0.02 + 0) / 2 = 0.01, one ratio per response.
    # ε = 0.05: s_0 = e^0.1 = 1.1051709 > 1.05, so row 0's term is max(-1.1051709, -1.05) = -1.05 (clipped);
    # s_1 = e^0.01 = 1.0100502 inside: -A·s = 1.0100502.
    # (3 · 1/3 · -1.05 + 2 · 1/2 · 1.0100502) / 2 responses = (-1.05 + 1.0100502) / 2 = -0.0199749
    terms, loop = run(loss, batch, logprobs, 5.0)
    assert terms.losses["policy"].item() == approx(-0.0199749)
    assert terms.diagnostics["clipfrac"].item() == approx(3 / 5)
    # ratio mean over the 5 counted tokens: (3 · 1.1051709 + 2 · 1.0100502) / 5
    assert terms.diagnostics["ratio_mean"].item() == approx((3 * 1.1051709 + 2 * 1.0100502) / 5)
    # the update's approx KL is over the ratios GSPO weighed, e^s - 1 - s per token:
    # (3 · 0.0051709 + 2 · 0.0000502) / 5 = 0.0031226 (its tokens' own ratios would give 0.0120137)
    assert loop["approx_kl"].item() == approx(0.0031226)
    terms.total().backward()
    # row 0 is clipped; row 1's loss is s_1 / 2 and ds_1/dlogprob_t = s_1 / |y_1| = s_1 / 2: each token s_1 / 4
    assert logprobs.grad is not None
    assert logprobs.grad.flatten().tolist() == approx([0.0, 0.0, 0.0, 1.0100502 / 4, 1.0100502 / 4, 0.0])


# ---------------------------------------------------------------- the value term


def test_value_term_by_hand(recipe_document, builtin_registry):
    values = torch.tensor([[1.5, 1.5, -0.1, GARBAGE]])
    old = torch.tensor([[1.0, 1.0, 0.0, -GARBAGE]])
    returns = torch.tensor([[1.0, 2.0, 0.3, GARBAGE]])
    mask = torch.tensor([[1, 1, 1, 0]])
    logprobs = torch.tensor([[-1.0, -1.0, -1.0, GARBAGE]])
    batch = minibatch(mask, logprobs, torch.zeros(1, 4), values=old, returns=returns)
    # ε_v = 0.2:
    #   V=1.5, V_old=1, R=1: V_clip = 1.2; (0.5)² = 0.25 vs (0.2)² = 0.04 -> 0.25, unclipped larger
    #   V=1.5, V_old=1, R=2: V_clip = 1.2; (0.5)² = 0.25 vs (0.8)² = 0.64 -> 0.64, clipped larger
    #   V=-0.1, V_old=0, R=0.3: inside the range, V_clip = V; (0.4)² = 0.16 both
    # ½ · (0.25 + 0.64 + 0.16) / 3 = ½ · 1.05 / 3 = 0.175; clipfrac 1/3; weighted by vf_coef 0.5: 0.0875
    terms, _ = run(ppo_clip(recipe_document, builtin_registry, value_clip=0.2, vf_coef=0.5), batch, logprobs, 3.0, values=values)
    assert terms.losses["value"].item() == approx(0.0875)
    assert terms.diagnostics["value_loss"].item() == approx(0.175)  # unweighted, the token mean
    assert terms.diagnostics["value_clipfrac"].item() == approx(1 / 3)


def test_value_term_matches_loop_and_gradients_ignore_padding(recipe_document, builtin_registry):
    g = torch.Generator().manual_seed(9)
    mask = random_mask(g, 6, 10)
    old = torch.randn(6, 10, generator=g, dtype=torch.float64)
    values = with_garbage(old + 0.3 * torch.randn(6, 10, generator=g, dtype=torch.float64), mask, float("inf"))
    returns = with_garbage(old + torch.randn(6, 10, generator=g, dtype=torch.float64), mask, float("nan"))
    old = with_garbage(old, mask, float("-inf"))
    values.requires_grad_()
    logprobs = -torch.ones(6, 10, dtype=torch.float64)
    batch = minibatch(mask, logprobs, torch.zeros(6, 10, dtype=torch.float64), values=old, returns=returns)
    terms, _ = run(ppo_clip(recipe_document, builtin_registry, value_clip=0.2, vf_coef=1.0), batch, logprobs, float(mask.sum()),
                   values=values)
    terms.total().backward()
    assert values.grad is not None and torch.isfinite(values.grad).all()
    assert (values.grad[mask == 0] == 0).all()
    assert not terms.diagnostics["value_clipfrac"].requires_grad
    values = values.detach()
    total, clipped_n, counted = 0.0, 0, 0
    for v, o, r, m in zip(*(x.flatten().tolist() for x in (values, old, returns, mask))):
        if m:
            v_clip = o + min(max(v - o, -0.2), 0.2)
            total += 0.5 * max((v - r) ** 2, (v_clip - r) ** 2)
            clipped_n += (v_clip - r) ** 2 > (v - r) ** 2
            counted += 1
    assert terms.losses["value"].item() == approx(total / counted)
    assert terms.diagnostics["value_clipfrac"].item() == approx(clipped_n / counted)
