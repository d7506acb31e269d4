# pyright: standard
"""Stage 2, what the update aims at: what the rollout policy, the reference and the critic say on
the rollouts (no-grad forward passes), the per-token rewards with the KL penalty, and the
advantages and returns."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

import torch

from rlkit_core.batch import RolloutBatch
from rlkit_core.functional import kl_per_token, logprobs_from_logits, token_rewards
from rlkit_core.interfaces import AdvantageEstimator
from rlkit_core.recipe.assemble import Components
from rlkit_core.recipe.document import Recipe
from rlkit_core.runtime.engine import Engine
from rlkit_core.runtime.forward import ForwardObserver, chunks_of, lengths_of, response_view, rows_of
from rlkit_core.runtime.microbatches import padded_to
from rlkit_core.runtime.rollout import shaped


@torch.no_grad()
def with_advantages(engine: Engine, components: Components, recipe: Recipe, batch: RolloutBatch,
                    observe: ForwardObserver | None = None) -> RolloutBatch:
    """`batch` with old and reference log-probs, values, per-token KL and rewards, advantages and
    returns: everything the update reads.

    The forward passes run on this process's rollouts; the advantages are estimated over the
    global batch (whitening statistics, groups), and this process keeps its rows of them."""
    processes = engine.processes
    batch = compare_to_reference(engine, components, recipe, batch, observe)
    kl_coef = components.kl.beta if recipe.ppo.kl_penalty == "reward" else 0.0
    whole = processes.gather_batch(batch, components.policy.tokenizer.pad_token_id)
    rewards, advantages, returns = credit(whole, components.advantage, kl_coef, lambda *scored: shaped(recipe, *scored))
    mine = batch.loss_mask
    return batch.with_(rewards=processes.local_rows(rewards, mine), advantages=processes.local_rows(advantages, mine),
                       returns=processes.local_rows(returns, mine))


def credit(batch: RolloutBatch, estimator: AdvantageEstimator, kl_coef: float,
           shape: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """([B, R] per-token rewards, advantages, returns) of the global `batch`, compared with the
    reference: each rollout's shaped score (`shape(scores, ended, counted tokens)`) at its last
    counted token, an episode's turn rewards where they were given (the rest of its score at its
    end), −kl_coef·KL at every token, and the estimator's advantages and returns over them. An
    episode that split is credited as one trajectory (`RolloutBatch.by_episode`)."""
    view = batch.by_episode()
    episodes = view.batch
    assert episodes.scores is not None and episodes.ended is not None and episodes.kl is not None  # scored, then compared
    mask = episodes.loss_mask
    scores = shape(episodes.scores, episodes.ended, mask.sum(dim=1))
    if episodes.turn_rewards is None:
        rewards = token_rewards(scores, episodes.kl, mask, kl_coef)
    else:  # an episode's: each turn's reward where it was given, the rest of its score at its end
        turns = torch.where(mask.bool(), episodes.turn_rewards, torch.zeros_like(episodes.turn_rewards))
        rewards = token_rewards(scores - turns.sum(dim=1), episodes.kl, mask, kl_coef) + turns
    advantages, returns = estimator.estimate(episodes.with_(rewards=rewards))
    return view.rows(rewards), view.rows(advantages), view.rows(returns)


@torch.no_grad()
def compare_to_reference(engine: Engine, components: Components, recipe: Recipe, batch: RolloutBatch,
                         observe: ForwardObserver | None = None) -> RolloutBatch:
    """Old and reference log-probs, values and the per-token KL (zero on padding), on this
    process's rollouts."""
    with engine.full_weights():  # once for every chunk
        return _compare_in_chunks(engine, components, recipe, batch, observe)


def _compare_in_chunks(engine: Engine, components: Components, recipe: Recipe, batch: RolloutBatch,
                       observe: ForwardObserver | None) -> RolloutBatch:
    ppo, policy = recipe.ppo, components.policy
    temperature, suppressed = components.generator.temperature, policy.suppressed_token_ids
    outputs, width = defaultdict(list), batch.response_ids.shape[1]
    chunks = chunks_of(torch.arange(len(batch), device=engine.device), lengths_of(batch), ppo.max_tokens_per_forward,
                       ppo.forward_batch_size or ppo.minibatch_size, "max_tokens_per_forward", ppo.pack_sequences)
    for index in chunks:
        chunk = batch.select(index).trimmed()
        rows = rows_of(chunk, ppo.pack_sequences)
        with engine.autocast():
            logprobs, values, _, logits = response_view(components, chunk, rows, grad=False)
            ref_logits = rows.response_logits(policy.reference_logits(*rows.inputs, start=rows.start))
        ref_logprobs = logprobs_from_logits(ref_logits, chunk.response_ids, temperature, suppressed)
        full = ppo.kl_estimator == "full"
        outputs["kl"].append(kl_per_token(logprobs, ref_logprobs, ppo.kl_estimator, logits if full else None,
                                          ref_logits if full else None, temperature, suppressed))
        outputs["old_logprobs"].append(logprobs)
        outputs["ref_logprobs"].append(ref_logprobs)
        if values is not None:
            outputs["values"].append(values)
        if observe is not None:
            observe("forward", chunk, rows)
    original_order = torch.cat(chunks).argsort()  # the chunks hold the rows sorted by length
    fields = {name: torch.cat([padded_to(output, width) for output in values])[original_order] for name, values in outputs.items()}
    mask = batch.loss_mask
    fields["kl"] = torch.where(mask.bool(), fields["kl"], torch.zeros_like(fields["kl"]))
    return batch.with_(**fields)
