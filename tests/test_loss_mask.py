"""`RolloutBatch.loss_mask` with holes inside the responses, as an episode's environment tokens
will make them: what lies at an uncounted position reaches no loss, gradient, advantage or KL sum."""

import torch

from plugins.gae import GAE, GAEConfig
from rlkit_core.functional import gae, kl_per_token, masked_sum, token_rewards
from rlkit_core.interfaces import LossInputs
from rlkit_core.runtime import rollout, update
from rlkit_core.testing import EPISODE_LOSS_MASK, rollout_batch
from tests.test_critic_free import build_loss
from tests.test_trainer import advantages_with, make_trainer, rollout_with, update_with

HOLES = torch.tensor(EPISODE_LOSS_MASK)


def changed_outside_the_loss_mask(batch):
    """`batch` with other ids, log-probs, advantages, values and returns where the response lies
    but nothing counts."""
    hole = batch.response_mask.bool() & ~batch.loss_mask.bool()
    fields = {name: torch.where(hole, torch.full_like(getattr(batch, name), 1e4), getattr(batch, name))
              for name in ("sampled_logprobs", "old_logprobs", "ref_logprobs", "advantages", "values", "returns")}
    return batch.with_(response_ids=torch.where(hole, 99, batch.response_ids), **fields)


def loss_and_gradients(loss, batch, token_count):
    generator = torch.Generator().manual_seed(1)
    assert batch.old_logprobs is not None and batch.values is not None
    logprobs = torch.where(batch.loss_mask.bool(), batch.old_logprobs, 0.0) + 0.1 * torch.randn(batch.old_logprobs.shape, generator=generator)
    values = torch.where(batch.loss_mask.bool(), batch.values, 0.0) + 0.1 * torch.randn(batch.values.shape, generator=generator)
    current = LossInputs(logprobs=logprobs.requires_grad_(), values=values.requires_grad_(),
                         entropy=torch.rand(logprobs.shape, generator=generator).requires_grad_(), kl_coef=0.1)
    terms = loss(batch, current, token_count)
    terms.total().backward()
    return terms, [current.logprobs.grad, current.values.grad, current.entropy.grad]


def test_ppo_clip_reads_nothing_outside_the_loss_mask(recipe_document, builtin_registry):
    loss = build_loss(recipe_document, builtin_registry, entropy_coef=0.01, tis_cap=2.0)
    batch = rollout_batch(loss_mask=HOLES)
    token_count = float(batch.loss_mask.sum())
    terms, gradients = loss_and_gradients(loss, batch, token_count)
    changed_terms, changed_gradients = loss_and_gradients(loss, changed_outside_the_loss_mask(batch), token_count)
    for name, value in {**terms.losses, **terms.diagnostics}.items():
        assert torch.isfinite(value), name
        assert torch.equal(value, {**changed_terms.losses, **changed_terms.diagnostics}[name]), name
    for gradient, changed in zip(gradients, changed_gradients):
        assert gradient is not None and changed is not None and torch.equal(gradient, changed)
        assert (gradient[~batch.loss_mask.bool()] == 0).all()


def test_ppo_clip_by_hand_counts_only_the_loss_mask(recipe_document, builtin_registry):
    loss = build_loss(recipe_document, builtin_registry)
    mask = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0]])
    counted = torch.tensor([[1, 0, 1, 1], [1, 0, 0, 0]])  # token 1 of response 0 came from the environment
    old = torch.tensor([[-1.0, -2.0, -0.5, -0.7], [-1.5, 0.0, 0.0, 0.0]])
    batch = rollout_batch(with_values=False).select(torch.tensor([0, 1])).with_(
        response_mask=mask, loss_mask=counted, old_logprobs=old, sampled_logprobs=old,
        advantages=torch.tensor([[1.0, 50.0, 1.0, 1.0], [2.0, 0.0, 0.0, 0.0]]))
    terms = loss(batch, LossInputs(logprobs=old.clone(), values=None, entropy=torch.ones(2, 4)), token_count=4.0)
    # ratio 1, so each counted token's term is -A: (-1 - 1 - 1 - 2) / 4 counted tokens
    assert float(terms.losses["policy"]) == -5 / 4


def test_the_update_divides_by_the_count_of_loss_mask_tokens(recipe_document, builtin_registry, monkeypatch):
    trainer = make_trainer(recipe_document, builtin_registry, ppo__minibatch_size=16, ppo__epochs=1)
    batch = with_environment_tokens(advantages_with(trainer, rollout_with(trainer, trainer.stream.batch(0))[0]))
    counts = []
    micro_step = update._micro_step

    def counting(engine, components, recipe, micro, rows, token_count):
        counts.append(float(token_count))
        return micro_step(engine, components, recipe, micro, rows, token_count)

    monkeypatch.setattr(update, "_micro_step", counting)
    update_with(trainer, batch)
    assert counts and set(counts) == {float(batch.loss_mask.sum())}
    assert batch.loss_mask.sum() < batch.response_mask.sum()


def with_environment_tokens(batch):
    """`batch` with response token 1 of every response of 3 or more tokens taken out of the loss mask."""
    loss_mask = batch.loss_mask.clone()
    loss_mask[:, 1] *= (batch.response_mask.sum(dim=1) < 3).long()
    return batch.with_(loss_mask=loss_mask)


def test_gae_by_hand_steps_over_uncounted_positions():
    # position 1 is an environment token: its reward and value are not read, and the recursion
    # goes from position 2 straight to position 0. γ = λ = 0.5, so γλ = 0.25:
    # t=3: δ = 3 + 0 - 1 = 2; A = 2
    # t=2: δ = 2 + 0.5·1 - 0.25 = 2.25; A = 2.25 + 0.25·2 = 2.75
    # t=0: δ = 1 + 0.5·0.25 - 0.5 = 0.625; A = 0.625 + 0.25·2.75 = 1.3125
    rewards = torch.tensor([[1.0, 9.0, 2.0, 3.0]])
    values = torch.tensor([[0.5, 7.0, 0.25, 1.0]])
    advantages, returns = gae(rewards, values, torch.tensor([[1, 0, 1, 1]]), 0.5, 0.5)
    assert advantages.tolist() == [[1.3125, 0.0, 2.75, 2.0]]
    assert returns.tolist() == [[1.8125, 0.0, 3.0, 3.0]]


def test_gae_over_the_batch_is_gae_with_the_uncounted_positions_deleted():
    batch = rollout_batch(loss_mask=HOLES)
    assert batch.rewards is not None and batch.values is not None
    estimator = GAE(GAEConfig(gamma=0.9, lam=0.8, whiten=False))
    advantages, returns = estimator.estimate(batch)
    counted = batch.loss_mask.bool()
    assert (advantages[~counted] == 0).all() and (returns[~counted] == 0).all()
    for row in range(len(batch)):
        kept = counted[row]
        alone, alone_returns = gae(batch.rewards[row, kept][None], batch.values[row, kept][None], torch.ones(1, int(kept.sum())), 0.9, 0.8)
        assert torch.allclose(advantages[row, kept], alone[0], rtol=0, atol=1e-6)
        assert torch.allclose(returns[row, kept], alone_returns[0], rtol=0, atol=1e-6)


def test_the_score_lands_on_the_last_counted_token():
    mask = torch.tensor([[1, 0, 1, 0], [1, 1, 0, 0]])  # response 0 ends in an environment token
    rewards = token_rewards(torch.tensor([5.0, 7.0]), torch.zeros(2, 4), mask)
    assert rewards.tolist() == [[0.0, 0.0, 5.0, 0.0], [0.0, 7.0, 0.0, 0.0]]


def test_kl_ref_sums_only_the_loss_mask(recipe_document, builtin_registry, monkeypatch):
    trainer = make_trainer(recipe_document, builtin_registry, optim__learning_rate=1e-2, ppo__kl_estimator="k1")
    trainer.step()  # the policy moves away from the reference, so the KL is no longer 0
    stage = rollout.rollout  # the iteration's rollouts, with environment tokens in them
    monkeypatch.setattr(rollout, "rollout", lambda *args: (lambda batch, metrics: (with_environment_tokens(batch), metrics))(*stage(*args)))
    iteration = trainer.iterate()
    batch = iteration.batch
    assert batch.kl is not None and batch.old_logprobs is not None and batch.ref_logprobs is not None
    hole = batch.response_mask.bool() & ~batch.loss_mask.bool()
    assert hole.any() and (batch.kl[hole] == 0).all()
    kl = kl_per_token(batch.old_logprobs, batch.ref_logprobs, "k1")
    counted = float(masked_sum(kl, batch.loss_mask, dim=1).mean())
    assert iteration.metrics["kl/ref"] == counted
    assert counted != float(masked_sum(kl, batch.response_mask, dim=1).mean())
