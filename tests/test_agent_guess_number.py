"""examples/agents/guess_number.py, an OpenAI-client agent, plays the game of the `guess-number`
environment through the endpoint: with the same seed, one rollout of recipes/ppo_guess_number.toml
on a small warm start holds the same ids as the in-process environment's, token for token (its
openings, the model's turns, every answer: "higher", "lower", "say a number"), the same masks and
log-probs, and the same return for each game that ended. What differs is when the reward is paid:
the environment pays each wrong guess at its turn, the agent the sum at the game's end, and a game
the model cut off pays the agent nothing (what it returns then gives its figures, not its reward)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rlkit_core.recipe.document import tomllib
from tests.test_agents import rows_of
from tests.test_trainer import make_trainer, rollout_with

pytest.importorskip("openai")

ROOT = Path(__file__).resolve().parents[1]
AGENT = ROOT / "examples" / "agents" / "guess_number.py"


@pytest.fixture(scope="module")
def guesser(tmp_path_factory):
    """A small warm start of the guesser (one layer, width 32, 100 steps on 512 games at random):
    it knows the format well enough to play several turns, and errs often enough that every answer
    of the game comes up (seconds, where the recipe's corpus of 20,000 games takes half a minute)."""
    from rlkit_plugins.guess_number import sft_examples
    from rlkit_plugins.warm_start import build_warm_start

    return build_warm_start(tmp_path_factory.mktemp("guesser") / "model", sft_examples, {"corpus": "guess-number"}, n_layer=1, n_embd=32,
                            n_head=2, sft_steps=100, batch_size=32, corpus_size=512)


def guess_number_document(tmp_path, model, agent: bool) -> dict:
    """recipes/ppo_guess_number.toml on `model`, 32 games a batch; with `agent`, its environment is the agent."""
    document = tomllib.loads((ROOT / "recipes" / "ppo_guess_number.toml").read_text())
    document["run"].update(threads=1, output_dir=str(tmp_path / ("agent" if agent else "in-process")), checkpoint_every=0)
    document["ppo"].update(batch_size=32, minibatch_size=8)
    document["policy"] = {"type": "hf", "model": str(model)}
    document["eval"]["size"] = 8
    document["tracker"] = {"type": "none"}
    if agent:
        environment = document["environment"]
        document["environment"] = {"type": "agent", "harness": f"{AGENT}:play", "max_turns": environment["max_turns"],
                                   "max_episode_tokens": environment["max_episode_tokens"]}
    return document


def test_the_agent_plays_the_environments_games_token_for_token(tmp_path, builtin_registry, guesser):
    played = {}
    for agent in (False, True):
        trainer = make_trainer(guess_number_document(tmp_path, guesser, agent), builtin_registry)
        played[agent] = (*rollout_with(trainer, trainer.stream.batch(0)), trainer.components.policy.tokenizer)
    (ours, ours_metrics, tokenizer), (theirs, theirs_metrics, _) = played[False], played[True]

    # the same games, token for token: prompts, the model's turns and every answer between them
    assert rows_of(theirs) == rows_of(ours)
    for field in ("response_ids", "response_mask", "loss_mask", "ended", "episode_ids", "group_ids"):
        assert torch.equal(getattr(theirs, field), getattr(ours, field)), field
    assert torch.equal(theirs.sampled_logprobs.isnan(), ours.sampled_logprobs.isnan())
    assert torch.equal(theirs.sampled_logprobs.nan_to_num(), ours.sampled_logprobs.nan_to_num())
    streams = " ".join(tokenizer.decode(row[mask.bool()]) for row, mask in zip(ours.response_ids, ours.response_mask))
    for answer in ("higher: ", "lower: ", "say a number: "):
        assert answer in streams, f"no game here was answered {answer!r}: the warm start should err more"
    for name in ("env/status_ok", "env/status_cut_off", "env/turns", "env/tokens", "env/turns_to_win"):
        assert theirs_metrics[name] == ours_metrics[name], name
    assert theirs_metrics["env/agent_refused"] == theirs_metrics["env/agent_rewrites"] == 0.0

    # the same return for each game that ended; the environment paid it turn by turn, the agent at the end
    ended = ours.ended
    assert ended.any() and (~ended).any(), "the warm start should both end games and cut some off"
    assert torch.equal(theirs.scores[ended], ours.scores[ended])
    turns_paid = (ours.turn_rewards != 0).sum(dim=1)
    assert (turns_paid[ended] >= 2).any(), "some game should have paid for wrong guesses before it ended"
    last = torch.where(ours.loss_mask.bool(), torch.arange(ours.loss_mask.shape[1]), -1).max(dim=1).values
    at_end = torch.zeros_like(ours.turn_rewards)
    at_end[ended, last[ended]] = ours.turn_rewards[ended].sum(dim=1)
    assert torch.allclose(theirs.turn_rewards, at_end, atol=1e-6, rtol=0)
    # a game cut off: the environment had paid its wrong guesses, the agent pays nothing
    assert (theirs.scores[~ended] == 0).all() and torch.allclose(ours.scores[~ended], ours.turn_rewards[~ended].sum(dim=1))

    # the figures: `won` over every game, in-process (its reset says 0) and for the agent, which returns it (0) when
    # the runner cut its game off and the endpoint answered `episode_ended`
    assert theirs_metrics["env/won"] == ours_metrics["env/won"] and theirs_metrics["env/status_cut_off"] > 0
