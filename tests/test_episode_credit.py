"""Credit for an episode whose chat template rewrote its history, so that it became several samples
(rows): one trajectory all the same (`RolloutBatch.by_episode`, `targets.credit`). Hand-computed
numbers, then a whole iteration on Qwen3's real template with a model that writes think blocks."""

from __future__ import annotations

import math

import attrs
import pytest
import torch
from rlkit_plugins.critic_free import GRPO, GRPOConfig
from rlkit_plugins.gae import GAE, GAEConfig

from rlkit_core.batch import RolloutBatch
from rlkit_core.interfaces import Generation, Generator
from rlkit_core.runtime.targets import credit


def unshaped(scores, ended, lengths):
    return scores


def episode_rows(loss_mask, response_mask, episode_ids, group_ids, scores, values=None, turn_rewards=None) -> RolloutBatch:
    """Rows of episodes as `episodes_batch` makes them, with what stage 2 adds (KL 0)."""
    loss_mask, response_mask = torch.tensor(loss_mask), torch.tensor(response_mask)
    rows, width = loss_mask.shape
    return RolloutBatch(
        prompts=[f"p{i}" for i in range(rows)], columns={}, group_ids=torch.tensor(group_ids),
        prompt_ids=torch.ones((rows, 2), dtype=torch.long), prompt_mask=torch.ones((rows, 2), dtype=torch.long),
        response_ids=torch.ones((rows, width), dtype=torch.long), response_mask=response_mask, loss_mask=loss_mask,
        sampled_logprobs=torch.zeros((rows, width)), ended=torch.ones(rows, dtype=torch.bool), scores=torch.tensor(scores),
        turn_rewards=torch.tensor(turn_rewards) if turn_rewards is not None else torch.zeros((rows, width)),
        episode_ids=torch.tensor(episode_ids), kl=torch.zeros((rows, width)),
        values=torch.tensor(values) if values is not None else None)


def test_gae_runs_across_a_split_as_across_one_stream():
    """Episode 0 split into rows 0 and 1 (row 0 ends with a rendered, uncounted token); episode 1 is
    row 2. γ = 1, λ = 0.5, no whitening. Episode 0's env rewards: 0.2 after its first turn (row 0,
    position 1) and 1.0 at the end, so its score is 1.2.

    Joined, episode 0 is tokens t0..t3 with V = 0.1, 0.2, 0.3, 0.4 and rewards 0, 0.2, 0, 1.0:
      δ3 = 1.0 − 0.4 = 0.6,             A3 = 0.6
      δ2 = 0 + 0.4 − 0.3 = 0.1,         A2 = 0.1 + 0.5·0.6 = 0.4
      δ1 = 0.2 + 0.3 − 0.2 = 0.3,       A1 = 0.3 + 0.5·0.4 = 0.5
      δ0 = 0 + 0.2 − 0.1 = 0.1,         A0 = 0.1 + 0.5·0.5 = 0.35
    returns = A + V = 0.45, 0.7, 0.7, 1.0. Episode 1 (V = 0.5, 0.5, score 0): A = −0.25, −0.5.
    Crediting the rows apart would pay 1.0 at row 0's end (A1 = 1.0 + 0.2 − 0.2 = 1.0) and again at row 1's.
    """
    batch = episode_rows(loss_mask=[[1, 1, 0], [1, 1, 0], [1, 1, 0]], response_mask=[[1, 1, 1], [1, 1, 0], [1, 1, 0]],
                         episode_ids=[0, 0, 1], group_ids=[0, 0, 1], scores=[1.2, 1.2, 0.0],
                         values=[[0.1, 0.2, 9.0], [0.3, 0.4, 0.0], [0.5, 0.5, 0.0]],
                         turn_rewards=[[0.0, 0.2, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    rewards, advantages, returns = credit(batch, GAE(GAEConfig(gamma=1.0, lam=0.5, whiten=False)), 0.0, unshaped)
    torch.testing.assert_close(rewards, torch.tensor([[0.0, 0.2, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 0.0]]))
    torch.testing.assert_close(advantages, torch.tensor([[0.35, 0.5, 0.0], [0.4, 0.6, 0.0], [-0.25, -0.5, 0.0]]))
    torch.testing.assert_close(returns, torch.tensor([[0.45, 0.7, 0.0], [0.7, 1.0, 0.0], [0.25, 0.0, 0.0]]))


def test_a_group_counts_an_episode_that_split_once():
    """One prompt's group of three episodes, the first split into two rows: scores 1, 0, 0 over
    episodes give mean 1/3 and unbiased std √(1/3), so A = (2/3)/√(1/3) = 1.1547 on both of the
    first episode's rows and −(1/3)/√(1/3) = −0.5774 on the others. Counting rows would give
    ±0.8660 (scores 1, 1, 0, 0)."""
    batch = episode_rows(loss_mask=[[1, 1], [1, 0], [1, 1], [1, 1]], response_mask=[[1, 1], [1, 0], [1, 1], [1, 1]],
                         episode_ids=[0, 0, 1, 2], group_ids=[5, 5, 5, 5], scores=[1.0, 1.0, 0.0, 0.0])
    _, advantages, _ = credit(batch, GRPO(GRPOConfig()), 0.0, unshaped)
    high, low = (2 / 3) / math.sqrt(1 / 3), -(1 / 3) / math.sqrt(1 / 3)
    torch.testing.assert_close(advantages, torch.tensor([[high, high], [high, 0.0], [low, low], [low, low]]), atol=1e-5, rtol=0)


def test_the_view_of_rows_that_never_split_is_the_batch_itself():
    batch = episode_rows(loss_mask=[[1, 1], [1, 0]], response_mask=[[1, 1], [1, 0]], episode_ids=[3, 4], group_ids=[0, 0],
                         scores=[1.0, 0.0])
    view = batch.by_episode()
    assert view.batch is batch and view.rows(batch.loss_mask) is batch.loss_mask


def test_the_view_joins_each_episodes_rows_in_order_and_gives_them_back():
    """Rows need not be adjacent: an episode is found by its id, its samples kept in row order."""
    ids = torch.arange(12).view(4, 3)
    batch = episode_rows(loss_mask=[[1, 1, 1]] * 4, response_mask=[[1, 1, 1]] * 4, episode_ids=[7, 2, 7, 7], group_ids=[0] * 4,
                         scores=[0.0] * 4).with_(response_ids=ids)
    view = batch.by_episode()
    assert view.batch.response_ids.tolist() == [[0, 1, 2, 6, 7, 8, 9, 10, 11], [3, 4, 5, 0, 0, 0, 0, 0, 0]]
    assert view.batch.response_mask.tolist()[1] == [1, 1, 1, 0, 0, 0, 0, 0, 0]
    assert view.batch.prompts == ["p0", "p1"] and view.batch.episode_ids.tolist() == [7, 2]
    assert torch.equal(view.rows(view.batch.response_ids), ids)


class FirstRowThinks(Generator):
    """A scripted model: the first running episode writes `think`, every other one `plain`."""

    temperature = 1.0

    def __init__(self, pad: int, think: list[int], plain: list[int]):
        self.pad, self.think, self.plain = pad, think, plain

    def generate(self, prompt_ids, prompt_mask, greedy=False):
        turns = [self.think] + [self.plain] * (len(prompt_ids) - 1)
        width = max(len(t) for t in turns)
        ids = torch.tensor([t + [self.pad] * (width - len(t)) for t in turns])
        mask = torch.tensor([[1] * len(t) + [0] * (width - len(t)) for t in turns])
        return Generation(response_ids=ids, response_mask=mask, logprobs=torch.full(ids.shape, -0.5))


def thinking_qwen3_trainer(recipe_document, registry, tmp_path, *, thinking_in_history: str = "rendered", **overrides):
    """A guess-number trainer on a tiny model with Qwen3's real template, whose first running episode
    writes a think block before its guess (7) in every turn, and every other one the guess alone."""
    from transformers import AutoTokenizer

    from rlkit_core.testing.offline_models import write_tiny_model
    from tests.test_chat_format import qwen3_template
    from tests.test_episodes import episode_document
    from tests.test_trainer import make_trainer

    path = write_tiny_model(tmp_path / "qwen3", "chatml")
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = qwen3_template()
    tokenizer.save_pretrained(path)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    think = tokenizer("<think>\nhmm\n</think>\n\n7", add_special_tokens=False)["input_ids"] + [end]
    plain = tokenizer("7", add_special_tokens=False)["input_ids"] + [end]
    document = episode_document(recipe_document, path, max_turns=3, max_episode_tokens=200, thinking_in_history=thinking_in_history)
    document["generator"]["max_new_tokens"] = len(think)
    trainer = make_trainer(document, registry, **overrides)
    trainer.components = attrs.evolve(trainer.components, generator=FirstRowThinks(tokenizer.pad_token_id, think, plain))
    return trainer


def test_a_qwen3_episode_that_really_splits_is_one_trajectory_through_a_whole_iteration(recipe_document, builtin_registry, tmp_path):
    """Qwen3's real template strips a think block from the history once a user message follows, so a
    model that writes one splits at every turn of guess-number (its answers are user messages). The
    score is paid once per episode, the reward's transcript holds what the environment said, and
    the iteration reports each episode once.

    Game A (secret 16): the model thinks, so its guesses are unreadable: −0.1 three times,
    two splits, three rows. Game B (secret 7): it says 7 and wins, +1, one row. A mean over rows
    would be (3·(−0.3) + 1)/4 = 0.025; over episodes it is 0.35."""
    from rlkit_core.runtime.after_update import after_update
    from tests.test_trainer import advantages_with, rollout_with, update_with

    trainer = thinking_qwen3_trainer(recipe_document, builtin_registry, tmp_path, kl__type="fixed", kl__beta=0.0)
    games = [{"prompt": "Guess my number, 1-16.", "secret": 16}, {"prompt": "Guess my number, 1-16.", "secret": 7}]
    batch, metrics = rollout_with(trainer, games, samples_per_prompt=1)
    assert metrics["env/splits"] == 1.0 and batch.episode_ids.tolist() == [0, 0, 0, 1]
    assert batch.scores.tolist() == pytest.approx([-0.3, -0.3, -0.3, 1.0])
    # the transcript of the game that split holds the environment's messages and the last turn
    assert batch.responses[0].count("say a number: 1-16") == 2 and batch.responses[0].endswith("</think>\n\n7")
    batch = advantages_with(trainer, batch)
    paid = (batch.rewards * batch.loss_mask).sum(dim=1)
    # each wrong guess's −0.1 where it was given and nothing more: the score once (rows apart paid −0.3 each)
    assert paid.tolist() == pytest.approx([-0.1, -0.1, -0.1, 1.0])
    update_with(trainer, batch)
    reported, after = after_update(trainer.engine, trainer.components, batch, {"time/iteration": 1.0})
    assert len(reported) == 2 and after["score/mean"] == pytest.approx(0.35)


def test_per_token_lam_pushes_down_a_solved_episodes_tool_calls_and_per_turn_lam_does_not():
    """Why PPO's first update broke an agent's tool calls, by hand. Two episodes of one shape: a tool
    turn of 4 sampled tokens, 2 rendered (the tool's answer), an answer turn of 2; the first solved
    (score 1), the second not (0); a critic that starts at 0; γ = 1, λ = 0.25; advantages whitened
    over the batch's 12 counted tokens.

    Per token, the solved episode's tokens get 0.25^k: 0.0039, 0.0010 ... for the tool call, 0.25
    and 1 for the answer; the mean is 1.333/12 = 0.111, so after whitening every tool-call token
    is below 0, in the solved episode as in the failed one, and only the final answer is pushed up.
    Per turn, the solved tool turn gets 0.25 on each token and the answer 1: the mean is 3/12 = 0.25,
    so the tool turn gets exactly 0 (λ this small discounts one turn by 4×); with λ = 0.5 it gets
    0.5 against a mean of 0.333, above 0."""
    turn = [1, 1, 1, 1, 0, 0, 1, 1]
    batch = episode_rows(loss_mask=[turn, turn], response_mask=[[1] * 8] * 2, episode_ids=[0, 1], group_ids=[0, 1],
                         scores=[1.0, 0.0], values=[[0.0] * 8] * 2)
    tool = torch.tensor([True, True, True, True, False, False, False, False])
    _, per_token, _ = credit(batch, GAE(GAEConfig(gamma=1.0, lam=0.25)), 0.0, unshaped)
    counted = torch.tensor(turn).bool()
    assert (per_token[0, tool] < 0).all() and (per_token[0, 6:] > 0).all() and (per_token[1, counted] < 0).all()
    _, per_turn, _ = credit(batch, GAE(GAEConfig(gamma=1.0, lam=0.25, lam_per_turn=True)), 0.0, unshaped)
    assert per_turn[0, tool].abs().max() < 1e-6 and (per_turn[0, 6:] > 0).all()
    _, per_turn, _ = credit(batch, GAE(GAEConfig(gamma=1.0, lam=0.5, lam_per_turn=True)), 0.0, unshaped)
    assert (per_turn[0, tool] > 0).all() and (per_turn[1, counted] < 0).all()
