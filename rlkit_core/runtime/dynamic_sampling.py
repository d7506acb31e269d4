# pyright: standard
"""DAPO's dynamic sampling (Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning
System at Scale", arXiv:2503.14476): a group of responses to one prompt that all score alike has
advantage 0 under a group estimator, so it adds nothing but dilution to the update. Such groups
are dropped and responses are generated for more prompts until the batch is full again.

Each process fills its own share of the batch (`batch_size / processes` rollouts), so every
process trains on as many rollouts as the others; whether another round is needed is agreed over
all processes (the sum of what each still lacks), and every process generates in every round, as
scoring is a collective. After `ppo.max_extra_rounds` rounds a share still short is filled with
dropped groups, so the batch keeps its size.
"""

from __future__ import annotations

from typing import cast

import torch

from rlkit_core.batch import RolloutBatch
from rlkit_core.errors import RunError
from rlkit_core.functional import constant_groups
from rlkit_core.randomness import extra_prompts_seed
from rlkit_core.recipe.assemble import Components
from rlkit_core.recipe.document import Recipe
from rlkit_core.runtime.engine import Engine
from rlkit_core.runtime.prompt_stream import Prompts, PromptStream
from rlkit_core.runtime.rollout import rollout, shaped


def concatenated(batches: list[RolloutBatch], pad_token_id: int) -> RolloutBatch:
    """The rollouts of `batches` in order, as one batch: prompt tensors left-padded and response
    tensors right-padded to the widest (mask 0 on the added positions)."""
    if len(batches) == 1:
        return batches[0]
    first = batches[0]
    fields = {}
    for name in ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "loss_mask", "sampled_logprobs", "turn_rewards", "sampled_versions"):
        parts = [getattr(b, name) for b in batches]
        if parts[0] is None:  # turn rewards, where no environment gives them
            continue
        width = max(p.shape[1] for p in parts)
        pad = pad_token_id if name.endswith("_ids") else -1 if name == "sampled_versions" else 0
        left = name.startswith("prompt_")
        fields[name] = torch.cat([torch.nn.functional.pad(p, (width - p.shape[1], 0) if left else (0, width - p.shape[1]), value=pad)
                                  for p in parts])
    fields["episode_ids"] = None  # each round numbered its episodes alike; every row is an episode of its own here (`DynamicSampler`)
    for name in ("group_ids", "ended", "scores"):
        fields[name] = torch.cat([getattr(b, name) for b in batches])
    fields["prompts"] = [p for b in batches for p in b.prompts]
    fields["responses"] = [r for b in batches for r in cast(list[str], b.responses)]  # scored batches: decoded
    fields["columns"] = {key: [v for b in batches for v in b.columns[key]] for key in first.columns}
    return first.with_(**fields)


class DynamicSampler:
    """Rollouts of one iteration with the constant groups replaced (see the module)."""

    def __init__(self, recipe: Recipe, engine: Engine, components: Components, prompts: Prompts):
        self.recipe, self.engine, self.components, self.max_prompt_tokens = recipe, engine, components, prompts.max_tokens
        ppo = recipe.ppo
        self.k, self.max_rounds = ppo.samples_per_prompt, ppo.max_extra_rounds
        # the prompts of extra round r of iteration i depend only on (seed, i, r), as the main stream's do
        self.extra = PromptStream(prompts.train, ppo.batch_size // self.k, extra_prompts_seed(recipe.run.seed))

    def rollout(self, records: list[dict], iteration: int) -> tuple[RolloutBatch, dict[str, float]]:
        """The rollouts of iteration `iteration + 1`, starting from `records` (its share of the stream)."""
        engine, processes = self.engine, self.engine.processes
        device, pad_token_id = engine.device, self.components.policy.tokenizer.pad_token_id
        quota = len(records)  # groups this process trains on
        kept, dropped = [], []  # batches of informative groups and of constant ones
        rounds, metrics = 0, {}

        def lacking() -> int:
            return quota - sum(len(b) for b in kept) // self.k
        while True:
            batch, timing = rollout(engine, self.components, self.recipe, records, self.k, self.max_prompt_tokens)
            if batch.episode_ids is not None and len(batch.episode_ids.unique()) < len(batch):  # a group is k rows here (several
                # processes refuse splits in `rollout` already)
                raise RunError("the chat template rewrote an episode's history, which starts a new training sample, and dynamic "
                               "sampling (ppo.dynamic_sampling) takes a group as one row per episode; leave it out, or use a chat "
                               "format that extends the stream (`rlkit check` audits it)")
            for name, value in timing.items():
                metrics[name] = metrics.get(name, 0.0) + value if name.startswith("time/") else value
            lengths = batch.loss_mask.sum(dim=1)
            assert batch.scores is not None and batch.ended is not None  # a rollout is scored
            constant = constant_groups(shaped(self.recipe, batch.scores, batch.ended, lengths), batch.group_ids)
            starts = torch.arange(0, len(batch), self.k, device=batch.group_ids.device)
            informative = starts[~constant[starts]]
            kept.append(self._groups(batch, informative[:lacking()]))  # more informative groups than room: the rest unused
            dropped.append(self._groups(batch, starts[constant[starts]]))
            if not int(processes.sum(torch.tensor(lacking(), device=device))) or rounds == self.max_rounds:
                break
            rounds += 1
            step = iteration * self.max_rounds + rounds - 1
            records = processes.share(self.extra.batch(step))
        short = lacking()
        spare = concatenated(dropped, pad_token_id)
        if short:  # out of rounds: the share is completed with constant groups (advantage 0)
            kept.append(spare.select(torch.arange(short * self.k, device=device)))
        batch = concatenated(kept, pad_token_id)
        # one id per group again, unique over processes (the rounds each numbered theirs from 0)
        # (and every row an episode of its own, on every process alike: `rollout` above refuses samples that split)
        batch = batch.with_(group_ids=torch.arange(len(batch), device=device) // self.k + processes.index * quota, episode_ids=None)
        counts = processes.sum(torch.tensor([len(spare) // self.k - short, short], device=device))
        metrics.update({"batch/dropped_groups": float(counts[0]), "batch/constant_groups_kept": float(counts[1]),
                        "batch/extra_rounds": float(rounds)})
        return batch, metrics

    def _groups(self, batch: RolloutBatch, starts: torch.Tensor) -> RolloutBatch:
        """The rollouts of the groups that begin at rows `starts` (a group is k consecutive rows)."""
        rows = (starts.unsqueeze(1) + torch.arange(self.k, device=starts.device)).flatten()
        return batch.select(rows)
