"""The rollout batch: the one type that carries tensors from stage to stage of a PPO iteration.

Shapes: B rollouts, P prompt positions (left-padded), R response positions (right-padded).
Each stage reads the fields it needs and returns a copy with the fields it made
(`batch.with_(advantages=...)`); nothing is written back into an earlier stage's fields.

Two masks, kept apart: `response_mask` says where a response lies (what the policy attends to,
how wide a trimmed batch is, where packing places it); `loss_mask` says which of those tokens count
(losses and their token counts, rewards, advantages, KL and every per-token mean). A single-turn
rollout counts every response token, so the two are equal; an episode that splices environment
tokens into its response region keeps them in `response_mask` and out of `loss_mask`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import torch


def sequence_inputs(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, response_ids: torch.Tensor | None = None,
                    response_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask, position_ids) of left-padded prompts, followed by their responses
    when given: what `Policy.forward` takes.

    Position ids count real tokens only, so a left-padded prompt starts at position 0. Padding
    after a response's EOS is masked out.
    """
    input_ids, attention_mask = prompt_ids, prompt_mask.long()
    if response_ids is not None:
        assert response_mask is not None, "response_ids come with their response_mask"
        input_ids = torch.cat([prompt_ids, response_ids], dim=1)
        attention_mask = torch.cat([prompt_mask, response_mask], dim=1).long()
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    return input_ids, attention_mask, position_ids


@attrs.frozen
class RolloutBatch:
    prompts: list[str]  # B prompt texts
    columns: dict[str, list[Any]]  # every other column of the prompt data, B values each
    group_ids: torch.Tensor  # [B] long: rollouts sampled from the same prompt share an id
    prompt_ids: torch.Tensor  # [B, P] long, left-padded
    prompt_mask: torch.Tensor  # [B, P] 1 on real prompt tokens
    response_ids: torch.Tensor  # [B, R] long, padded after the first EOS
    response_mask: torch.Tensor  # [B, R] layout: 1 where the response lies, up to and including the first EOS
    loss_mask: torch.Tensor  # [B, R] 1 on the tokens that count for training (sampled by the policy); ⊆ response_mask
    sampled_logprobs: torch.Tensor  # [B, R] log π_sampler of each sampled token
    responses: list[str] | None = None  # B decoded responses, cut at the first EOS
    ended: torch.Tensor | None = None  # [B] bool: the response contains an EOS
    scores: torch.Tensor | None = None  # [B] float: the reward source's score (an episode's: its environment's rewards too)
    turn_rewards: torch.Tensor | None = None  # [B, R] an episode's per-turn rewards at each turn's last sampled token, 0 elsewhere
    episode_ids: torch.Tensor | None = None  # [B] long: the samples of one episode share an id, rows in the order played (`by_episode`)
    # [B, R] long: the weights version (updates seen) that sampled each token, -1 on tokens not sampled; an episode batch's.
    # With `scheduler.partial_rollouts` an episode's later turns may be sampled by newer weights than its first.
    sampled_versions: torch.Tensor | None = None
    baseline_scores: torch.Tensor | None = None  # [B] float: the shaped score of a greedy response to the same prompt (ReMax)
    old_logprobs: torch.Tensor | None = None  # [B, R] log π_old with the training code path
    ref_logprobs: torch.Tensor | None = None  # [B, R] log π_ref
    values: torch.Tensor | None = None  # [B, R] V(s_t) before the update
    kl: torch.Tensor | None = None  # [B, R] per-token KL estimate to the reference
    rewards: torch.Tensor | None = None  # [B, R] per-token rewards (score + KL penalty)
    advantages: torch.Tensor | None = None  # [B, R]
    returns: torch.Tensor | None = None  # [B, R] value targets

    def with_(self, **fields) -> RolloutBatch:
        return attrs.evolve(self, **fields)

    def __len__(self) -> int:
        return self.prompt_ids.shape[0]

    @property
    def prompt_length(self) -> int:
        return self.prompt_ids.shape[1]

    def sequence(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(input_ids, attention_mask, position_ids) of prompt + response, as the policy sees them."""
        return sequence_inputs(self.prompt_ids, self.prompt_mask, self.response_ids, self.response_mask)

    def map_fields(self, tensor: Callable[[str, torch.Tensor], torch.Tensor], values: Callable[[list], list]) -> RolloutBatch:
        """A copy with every tensor field replaced by `tensor(name, field)` and every per-rollout
        list (each column of `columns` too) by `values(list)`."""
        changes = {}
        for f in attrs.fields(RolloutBatch):
            value = getattr(self, f.name)
            if value is None:
                continue
            if isinstance(value, torch.Tensor):
                changes[f.name] = tensor(f.name, value)
            elif isinstance(value, dict):
                changes[f.name] = {k: values(col) for k, col in value.items()}
            else:
                changes[f.name] = values(value)
        return attrs.evolve(self, **changes)

    def select(self, index: torch.Tensor) -> RolloutBatch:
        """The rollouts at `index` (a 1-D long tensor), every field sliced alike."""
        picked = index.tolist()
        return self.map_fields(lambda _, value: value[index], lambda column: [column[i] for i in picked])

    def trimmed(self) -> RolloutBatch:
        """The same rollouts without the columns that are padding in every row: the leading prompt
        columns before the longest prompt and the response columns after the longest response.

        Exact: a masked column is no key of any attention and position ids count real tokens only,
        so every kept position computes what it did in the padded batch (up to float rounding)."""
        prompt_start = int(self.prompt_mask.any(dim=0).long().argmax())  # the first column some prompt reaches
        counted = self.response_mask.any(dim=0)
        response_end = max(1, len(counted) - int(counted.flip(0).long().argmax())) if counted.any() else 1
        if prompt_start == 0 and response_end == self.response_ids.shape[1]:
            return self

        def cut(name: str, value: torch.Tensor) -> torch.Tensor:
            if name in PROMPT_FIELDS:
                return value[:, prompt_start:]
            return value[:, :response_end] if name in RESPONSE_FIELDS else value

        return self.map_fields(cut, lambda column: column)

    def by_episode(self) -> EpisodeView:
        """The batch with a row per episode (`EpisodeView`)."""
        return EpisodeView.of(self)


PROMPT_FIELDS = ("prompt_ids", "prompt_mask")
RESPONSE_FIELDS = ("response_ids", "response_mask", "loss_mask", "sampled_logprobs", "turn_rewards", "sampled_versions", "old_logprobs",
                   "ref_logprobs", "values", "kl", "rewards", "advantages", "returns")  # [B, R]: every field cut by `trimmed` at the last response column



@attrs.frozen
class EpisodeView:
    """A batch whose rows are whole episodes, for credit and for what an iteration reports.

    An episode whose chat template rewrote its history is several samples, a row each (each with
    the prompt the model saw). Credit is one trajectory's all the same: here the episode's rows
    stand end to end in one response region (row after row, each `R` wide), so the score is paid
    once, at the episode's last sampled token, GAE bootstraps a sample's end from the next
    sample's first value (it steps over the padding between them), and a group counts the episode
    once. The per-rollout fields are the episode's first sample's; the prompt fields do not belong
    to the joined response, so the view is never forwarded. `rows` takes a [E, k·R] result back to
    the batch's [B, R] rows. A batch whose episodes are one row each is its own view.
    """

    batch: RolloutBatch
    slots: torch.Tensor | None = None  # [B] long: each row's place in the view, episode · k + its sample's index; None: the view is the batch
    samples: int = 1  # k: the most rows of one episode

    @classmethod
    def of(cls, batch: RolloutBatch) -> EpisodeView:
        ids = batch.episode_ids
        if ids is None or len(ids.unique()) == len(ids):
            return cls(batch)
        place: dict[int, int] = {}  # episode id -> its row in the view
        heads, taken, places = [], [], []  # each episode's first row and its rows so far; each row's (episode, sample)
        for row, episode in enumerate(ids.tolist()):
            if episode not in place:
                place[episode] = len(heads)
                heads.append(row)
                taken.append(0)
            places.append((place[episode], taken[place[episode]]))
            taken[place[episode]] += 1
        k, count = max(taken), len(heads)
        slots = torch.tensor([episode * k + sample for episode, sample in places], device=ids.device)
        width = batch.response_ids.shape[1]

        def joined(name: str, value: torch.Tensor) -> torch.Tensor:
            if name not in RESPONSE_FIELDS:
                return value
            rows = value.new_zeros((count * k, width))
            rows[slots] = getattr(batch, name)
            return rows.view(count, k * width)

        first_rows = batch.select(torch.tensor(heads, device=ids.device))
        return cls(first_rows.map_fields(joined, lambda column: column), slots, k)

    def rows(self, joined: torch.Tensor) -> torch.Tensor:
        """[E, k·R] over the view's episodes -> [B, R] over the batch's rows."""
        if self.slots is None:
            return joined
        return joined.reshape(-1, joined.shape[1] // self.samples)[self.slots]
