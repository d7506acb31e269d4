"""The PPO loop on a tiny real model: consistency at the first step, learning, determinism."""

import math
import warnings

import pytest
import torch

from rlkit_core.batch import RolloutBatch
from rlkit_core.recipe.document import parse_recipe
from rlkit_core.runtime import rollout, targets, update
from rlkit_core.runtime.forward import response_view, rows_of
from rlkit_core.runtime.trainer import Trainer


def make_trainer(document, registry, **changes):
    for key, value in changes.items():
        table, name = key.split("__")
        document.setdefault(table, {})[name] = value
    return Trainer(parse_recipe(document, registry))


# The stages by themselves, with a trainer's parts (its observer of forward passes too), as `Trainer.iterate` calls them.
def rollout_with(trainer: Trainer, records: list[dict], samples_per_prompt: int | None = None,
                 greedy: bool = False) -> tuple[RolloutBatch, dict[str, float]]:
    """Stage 1: `samples_per_prompt` (default: the recipe's) responses to each record, scored."""
    recipe = trainer.recipe
    return rollout.rollout(trainer.engine, trainer.components, recipe, records, samples_per_prompt or recipe.ppo.samples_per_prompt,
                           trainer.prompts.max_tokens, greedy)


def compare_with(trainer: Trainer, batch: RolloutBatch) -> RolloutBatch:
    """Stage 2's forward passes: old and reference log-probs, values and the per-token KL."""
    return targets.compare_to_reference(trainer.engine, trainer.components, trainer.recipe, batch, trainer.observe)


def advantages_with(trainer: Trainer, batch: RolloutBatch) -> RolloutBatch:
    """Stage 2: everything the update reads."""
    return targets.with_advantages(trainer.engine, trainer.components, trainer.recipe, batch, trainer.observe)


def update_with(trainer: Trainer, batch: RolloutBatch) -> dict[str, float]:
    """Stage 3 on `batch` from the trainer's state (its iteration orders the minibatches); the metrics."""
    return update.update(trainer.engine, trainer.components, trainer.recipe, batch, trainer.state, trainer.observe).metrics


@pytest.mark.parametrize("style", ["byte-level", "padless-gpt2", "chat-llama"])
def test_a_single_turn_rollout_is_one_generate_call_on_the_encoded_prompts(recipe_document, builtin_registry, tmp_path, style):
    """One rollout path: a recipe without an environment plays episodes of one turn, and its batch
    holds what one `generate` call on the prompts as `encode_prompts` cuts them samples from the
    same random state, decoded and scored as such: pad-less GPT-2 style (rlkit adds its PAD) and
    Llama style (several end ids) as well. A response cut off keeps its tokens, not ended."""
    from rlkit_core.prompts import encode_prompts
    from rlkit_core.testing.offline_models import write_tiny_model

    if style != "byte-level":
        recipe_document["policy"]["model"] = str(write_tiny_model(tmp_path / style, "gpt2" if style == "padless-gpt2" else "chat"))
    trainer = make_trainer(recipe_document, builtin_registry, data__max_prompt_tokens=8, generator__max_new_tokens=10)
    components, k = trainer.components, trainer.recipe.ppo.samples_per_prompt
    tokenizer, records = components.policy.tokenizer, trainer.stream.batch(0)
    ends = list(components.policy.eos_token_ids)
    head = components.policy.model.get_output_embeddings()
    head.register_forward_hook(lambda module, inputs, logits: logits.index_add_(-1, torch.tensor(ends), torch.full((*logits.shape[:-1], len(ends)), 3.0)))
    repeated = [r for r in records for _ in range(k)]
    started = torch.random.get_rng_state()
    batch, metrics = rollout_with(trainer, records)
    after = torch.random.get_rng_state()
    torch.random.set_rng_state(started)
    ids, mask = encode_prompts(tokenizer, repeated, trainer.engine.device, 8)
    assert (mask.sum(dim=1) == 8).any()  # some prompt was cut
    generation = components.generator.generate(ids, mask)
    assert torch.equal(torch.random.get_rng_state(), after)  # the rollout drew nothing else from the training stream
    assert torch.equal(batch.prompt_ids, ids) and torch.equal(batch.prompt_mask, mask)
    assert torch.equal(batch.response_ids, generation.response_ids)
    assert torch.equal(batch.response_mask, generation.response_mask) and torch.equal(batch.loss_mask, generation.response_mask)
    counted = generation.response_mask.bool()
    assert torch.equal(batch.sampled_logprobs[counted], generation.logprobs[counted])
    eos = torch.tensor(components.policy.eos_token_ids)
    ended = torch.isin(generation.response_ids, eos).any(dim=1)
    assert torch.equal(batch.ended, ended) and 0 < int(ended.sum()) < len(ended)  # some ended, some were cut off
    responses = tokenizer.batch_decode(generation.response_ids, skip_special_tokens=True)
    assert batch.responses == responses
    prompts = [r["prompt"] for r in repeated]
    expected = components.reward.score(prompts, responses, **rollout.record_columns(repeated))
    assert batch.scores.tolist() == pytest.approx(expected, abs=0, rel=1e-7)
    assert batch.group_ids.tolist() == [i // k for i in range(len(repeated))]
    assert batch.turn_rewards is None and not [name for name in metrics if name.startswith("env/")]


def test_first_step_ratio_is_one_and_logprobs_match_the_sampler(recipe_document, builtin_registry):
    trainer = make_trainer(recipe_document, builtin_registry)
    batch, _ = rollout_with(trainer, trainer.stream.batch(0))
    batch = advantages_with(trainer, batch)
    mask = batch.response_mask.bool()
    # The training code path, before any update, reproduces π_old: ratio exactly 1.
    logprobs, _, _, _ = response_view(trainer.components, batch, rows_of(batch, trainer.recipe.ppo.pack_sequences), grad=False)
    ratio = torch.exp(logprobs - batch.old_logprobs)[mask]
    assert torch.allclose(ratio, torch.ones_like(ratio), atol=1e-5)
    # ... and agrees with the sampler's own log-probs (padding, positions and temperature all right).
    assert torch.allclose(batch.old_logprobs[mask], batch.sampled_logprobs[mask], atol=1e-4)
    # The reference is the starting policy, so every per-token KL is 0 before training.
    assert batch.kl.abs().max() < 1e-5


def test_score_lands_on_the_last_counted_token(recipe_document, builtin_registry):
    trainer = make_trainer(recipe_document, builtin_registry, kl__type="fixed", kl__beta=0.0)
    batch = advantages_with(trainer, rollout_with(trainer, trainer.stream.batch(0))[0])
    last = batch.response_mask.sum(dim=1) - 1
    expected = torch.zeros_like(batch.rewards)
    expected[torch.arange(len(batch)), last] = batch.scores
    assert torch.equal(batch.rewards, expected)


def test_temperature_is_applied_when_recomputing(recipe_document, builtin_registry):
    trainer = make_trainer(recipe_document, builtin_registry, generator__temperature=0.7)
    batch = advantages_with(trainer, rollout_with(trainer, trainer.stream.batch(0))[0])
    mask = batch.response_mask.bool()
    assert torch.allclose(batch.old_logprobs[mask], batch.sampled_logprobs[mask], atol=1e-4)


def test_the_loop_learns_a_trivial_reward(recipe_document, builtin_registry):
    trainer = make_trainer(recipe_document, builtin_registry, ppo__batch_size=32, ppo__minibatch_size=16, optim__learning_rate=1e-2,
                           kl__type="fixed", kl__beta=0.0, run__steps=12)
    scores = [trainer.step()["score/mean"] for _ in range(12)]
    first, last = sum(scores[:3]) / 3, sum(scores[-3:]) / 3
    assert last > first + 0.3, scores


def test_same_seed_same_metrics(recipe_document, builtin_registry):
    def metrics():
        trainer = make_trainer(dict((k, dict(v)) for k, v in recipe_document.items()), builtin_registry)
        return [{k: v for k, v in trainer.step().items() if not k.startswith("time/")} for _ in range(2)]

    assert metrics() == metrics()


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3", "full"])
def test_every_kl_estimator_runs_and_is_logged(recipe_document, builtin_registry, estimator):
    trainer = make_trainer(recipe_document, builtin_registry, ppo__kl_estimator=estimator, optim__learning_rate=1e-2)
    trainer.step()
    metrics = trainer.step()
    assert metrics["kl/ref"] != 0.0
    if estimator != "k1":
        assert metrics["kl/ref"] > 0  # k2, k3 and the full sum are non-negative


def test_kl_in_the_loss_keeps_the_rewards_free_of_it(recipe_document, builtin_registry):
    trainer = make_trainer(recipe_document, builtin_registry, ppo__kl_penalty="loss", ppo__kl_estimator="k3")
    trainer.step()
    iteration = trainer.iterate()
    metrics, batch = iteration.metrics, iteration.batch
    assert "train/loss_kl" in metrics
    assert torch.count_nonzero(batch.rewards).item() <= len(batch)  # only the score positions


def test_every_required_metric_is_reported(recipe_document, builtin_registry):
    metrics = make_trainer(recipe_document, builtin_registry).step()
    required = ["score/mean", "kl/ref", "kl/beta", "train/loss_policy", "train/loss_value", "train/approx_kl",
                "train/clipfrac", "train/value_clipfrac", "train/explained_variance", "train/entropy",
                "response/length", "response/eos_rate", "train/grad_norm", "time/generate", "time/score",
                "time/forward", "time/train"]
    assert [name for name in required if name not in metrics] == []


@pytest.mark.parametrize("lora_r", [0, 4])
def test_gradient_checkpointing_recomputes_during_the_update_and_changes_nothing(recipe_document, builtin_registry, lora_r):
    def update(checkpointing):
        document = {table: dict(body) for table, body in recipe_document.items()}
        trainer = make_trainer(document, builtin_registry, policy__gradient_checkpointing=checkpointing, policy__lora_r=lora_r)
        torch.manual_seed(5)
        batch = advantages_with(trainer, rollout_with(trainer, trainer.stream.batch(0))[0])
        calls = []
        model = trainer.components.policy.model.get_base_model() if lora_r else trainer.components.policy.model
        # a module inside a block (transformers keeps the block's own hooks out of the recomputation),
        # counted as it starts (torch's recomputation may stop before it returns)
        model.transformer.h[0].mlp.register_forward_pre_hook(lambda *_: calls.append(1))
        gradients = []
        trainer.engine.optimizer.optimizer.register_step_pre_hook(
            lambda *_: gradients.append(torch.cat([p.grad.flatten() for p in trainer.engine.parameters])))
        update_with(trainer, batch)
        return len(calls), gradients

    plain_calls, plain_gradients = update(False)
    checkpointed_calls, checkpointed_gradients = update(True)
    steps = len(plain_gradients)
    assert plain_calls == steps and checkpointed_calls == 2 * steps  # each block runs again in backward
    for plain, checkpointed in zip(plain_gradients, checkpointed_gradients):
        assert plain.abs().max() > 0
        assert torch.allclose(plain, checkpointed, rtol=1e-5, atol=1e-8)  # dropout is off in training mode


def test_forward_batch_size_only_changes_how_the_rollout_is_chunked(recipe_document, builtin_registry):
    def evaluated(forward_batch_size):
        document = {table: dict(body) for table, body in recipe_document.items()}
        trainer = make_trainer(document, builtin_registry, ppo__forward_batch_size=forward_batch_size)
        torch.manual_seed(5)
        return advantages_with(trainer, rollout_with(trainer, trainer.stream.batch(0))[0])

    whole, chunked = evaluated(0), evaluated(3)
    for name in ("old_logprobs", "ref_logprobs", "values", "advantages"):
        assert torch.allclose(getattr(whole, name), getattr(chunked, name), atol=1e-5), name


# The conftest recipe makes 8 optimiser steps: 2 iterations × 2 epochs × (16 / 8) minibatches.
# Learning-rate factor after k steps (k = 0 … 8), by hand:
#   linear: (8 − k) / 8;  cosine: (1 + cos(π k / 8)) / 2;
#   linear with 2 warm-up steps: k / 2 for k < 2, then (8 − k) / 6 (transformers' warm-up starts at 0).
@pytest.mark.parametrize("schedule, warmup, factors", [
    ("constant", 0, [1.0] * 9),
    ("linear", 0, [(8 - k) / 8 for k in range(9)]),
    ("cosine", 0, [(1 + math.cos(math.pi * k / 8)) / 2 for k in range(9)]),
    ("linear", 2, [0.0, 0.5] + [(8 - k) / 6 for k in range(2, 9)]),
])
def test_learning_rate_schedule_over_the_run(recipe_document, builtin_registry, schedule, warmup, factors):
    trainer = make_trainer(recipe_document, builtin_registry, optim__schedule=schedule, optim__warmup_steps=warmup)
    rates = [trainer.engine.scheduler.get_last_lr()[0]]
    for _ in range(8):
        trainer.engine.optimizer.step()
        trainer.engine.scheduler.step()
        rates.append(trainer.engine.scheduler.get_last_lr()[0])
    assert rates == pytest.approx([1e-3 * f for f in factors], abs=1e-12)


def test_a_minibatch_whose_ratio_exploded_is_skipped(recipe_document, builtin_registry):
    """A threshold of 0.5 is below the ratio of 1 that every minibatch starts at, so every one is
    skipped and the weights must not move at all; at the default of 10 none is."""
    trainer = make_trainer(recipe_document, builtin_registry, loss__ratio_threshold=0.5)
    before = {k: v.clone() for k, v in trainer.components.policy.state_dict().items()}
    batch = advantages_with(trainer, rollout_with(trainer, trainer.stream.batch(0))[0])
    with warnings.catch_warnings(record=True) as caught:  # the schedule moves on without a warning to the user
        warnings.simplefilter("always")
        metrics = update_with(trainer, batch)
    assert not [w for w in caught if "lr_scheduler" in str(w.message)]
    assert metrics["train/skipped"] == 1.0 and metrics["train/grad_norm"] == 0.0
    assert all(torch.equal(before[k], v) for k, v in trainer.components.policy.state_dict().items())
    metrics = update_with(make_trainer(recipe_document, builtin_registry, loss__ratio_threshold=10.0), batch)
    assert metrics["train/skipped"] == 0.0


def test_critic_metrics_by_hand():
    from rlkit_core.runtime.after_update import critic_metrics

    values, returns = torch.tensor([[1.0, 2.0, 9.0]]), torch.tensor([[3.0, 1.0, 5.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])  # the third token is padding and counts nowhere
    # returns - values on counted tokens: [2, -1] → mean 0.5, biased std 1.5; var(returns) over [3, 1] = 1,
    # var(returns - values) = 2.25, so explained variance 1 - 2.25 / 1 = -1.25; values [1, 2] mean 1.5, returns mean 2
    assert critic_metrics(values, returns, mask) == pytest.approx({
        "train/explained_variance": -1.25, "advantage/raw_mean": 0.5, "advantage/raw_std": 1.5, "value/mean": 1.5, "return/mean": 2.0})


@pytest.mark.parametrize("max_grad_norm, clipped", [(1e-6, 1.0), (0.0, 0.0)])
def test_gradient_norm_is_logged_before_clipping_with_the_share_clipped(recipe_document, builtin_registry, max_grad_norm, clipped):
    trainer = make_trainer(recipe_document, builtin_registry, optim__max_grad_norm=max_grad_norm)
    metrics = trainer.step()
    # the norm before clipping is the one reported: far above a threshold of 1e-6 when that clips every step
    assert metrics["train/grad_norm"] > 1e-3 and metrics["train/grad_norm_max"] >= metrics["train/grad_norm"]
    assert metrics["train/grad_clipped"] == clipped
    assert {"advantage/raw_mean", "advantage/raw_std", "value/mean", "return/mean"} <= set(metrics)


def test_step_stats_read_means_the_largest_norm_and_the_last_epochs_approx_kl():
    from rlkit_core.runtime.update import StepStats

    stats = StepStats()
    for approx_kl, norm in [(0.0, 1.0), (0.01, 3.0), (0.02, 2.0), (0.04, 1.0)]:  # 2 epochs of 2 steps
        if stats.steps % 2 == 0:
            stats.epoch_starts.append(stats.steps)
        stats.add("train/approx_kl", torch.tensor(approx_kl))
        stats.add("train/grad_norm", torch.tensor(norm))
        stats.steps += 1
    metrics = stats.read(torch.device("cpu"))
    assert metrics["train/approx_kl"] == pytest.approx(0.0175) and metrics["train/grad_norm"] == pytest.approx(1.75)
    assert metrics["train/grad_norm_max"] == 3.0 and metrics["train/approx_kl_last_epoch"] == pytest.approx(0.03)


def test_target_kl_ends_an_update_that_runs_away_before_its_step(recipe_document, builtin_registry):
    """A learning rate of 0.05 moves the policy far within one update. With `ppo.target_kl`, the
    update stops at the first minibatch that finds π_θ past 1.5 × target_kl from π_old, before its
    step: fewer steps, a policy nearer π_old on the batch, and the schedule still counts one step a
    minibatch. Without it every step is taken."""
    from rlkit_core.functional import approx_kl, token_log_ratio

    moved = {}
    for target in (0.0, 0.002):
        trainer = make_trainer(recipe_document, builtin_registry, optim__learning_rate=0.05, ppo__target_kl=target,
                               kl__type="fixed", kl__beta=0.0)
        batch = advantages_with(trainer, rollout_with(trainer, trainer.stream.batch(0))[0])
        metrics = update_with(trainer, batch)
        logprobs, _, _, _ = response_view(trainer.components, batch, rows_of(batch, trainer.recipe.ppo.pack_sequences), grad=False)
        moved[target] = float(approx_kl(token_log_ratio(logprobs, batch.old_logprobs, batch.loss_mask), batch.loss_mask))
        planned = trainer.recipe.ppo.epochs * trainer.recipe.ppo.batch_size // trainer.recipe.ppo.minibatch_size
        assert trainer.engine.scheduler.scheduler.last_epoch == planned
        if target:
            assert 0 < metrics["train/steps_taken"] < 1
        else:
            assert metrics["train/steps_taken"] == 1.0
    assert moved[0.002] < moved[0.0]
