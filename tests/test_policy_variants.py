"""The policy-loss variants in the loop: ppo-clip's clip-higher and dual-clip settings, DAPO's
dynamic sampling (one process and two, under torchrun) and overlong shaping, the masking of
truncated responses, and the recipe checks that refuse what cannot work. The formulas themselves
are checked by hand in tests/test_ppo_clip.py."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from pytest import approx

from rlkit_core.errors import RecipeError
from rlkit_core.functional import constant_groups
from rlkit_core.interfaces import LossInputs
from rlkit_core.recipe.document import parse_recipe
from rlkit_core.runtime.rollout import shaped
from rlkit_core.runtime.trainer import Trainer
from rlkit_core.testing import rollout_batch
from rlkit_core.testing.offline_models import write_tiny_model
from tests.test_trainer import advantages_with

# Prompts of the shared prompt file are made of the letters a, b, c, d, f, g. This reward gives
# every response to a prompt that starts with "a" or "b" the same score, so those groups have
# no signal; on the process named by FLAT_RANK (torchrun's RANK) every group is flat.
REWARD_SOURCE = '''
import os


def flat_for_some(prompts, responses, letter):
    flat_everywhere = os.environ.get("RANK", "0") == os.environ.get("FLAT_RANK")
    return [0.5 if flat_everywhere or p[0] in "ab" else sum(c.islower() for c in r) / 8
            for p, r in zip(prompts, responses)]
'''


@pytest.fixture
def grpo_document(recipe_document, tmp_path):
    path = tmp_path / "flat_reward.py"
    path.write_text(REWARD_SOURCE)
    recipe_document["reward"] = {"type": "python", "function": f"{path}:flat_for_some"}
    recipe_document["advantage"] = {"type": "grpo"}
    recipe_document["ppo"].update({"samples_per_prompt": 4, "dynamic_sampling": True, "max_extra_rounds": 2})
    return recipe_document


def groups_of(batch, k):
    return [list(range(start, start + k)) for start in range(0, len(batch), k)]


def test_dynamic_sampling_drops_flat_groups_and_fills_the_batch(grpo_document, builtin_registry, monkeypatch):
    monkeypatch.delenv("FLAT_RANK", raising=False)
    trainer = Trainer(parse_recipe(grpo_document, builtin_registry))
    records = trainer.stream.batch(0)
    flat_prompts = sum(r["prompt"][0] in "ab" for r in records)
    assert flat_prompts  # the first batch has prompts whose groups are flat
    batch, metrics = trainer.dynamic_sampler.rollout(records, 0)
    assert len(batch) == 16 and batch.group_ids.tolist() == [i // 4 for i in range(16)]
    for rows in groups_of(batch, 4):  # each group: one prompt, and scores that differ
        assert len({batch.prompts[i] for i in rows}) == 1
    if not metrics["batch/constant_groups_kept"]:
        assert not constant_groups(batch.scores, batch.group_ids).any()
    assert metrics["batch/dropped_groups"] >= flat_prompts
    assert metrics["batch/extra_rounds"] >= 1
    # each kept row is the response the reward scored, with the sampler's log-probs of its own tokens
    evaluated = advantages_with(trainer, batch)
    assert float((evaluated.old_logprobs - evaluated.sampled_logprobs).abs().max()) < 1e-4
    assert batch.scores.tolist() == approx([0.5 if p[0] in "ab" else sum(c.islower() for c in r) / 8
                                           for p, r in zip(batch.prompts, batch.responses)])


def test_dynamic_sampling_out_of_rounds_fills_with_flat_groups(grpo_document, builtin_registry, monkeypatch):
    monkeypatch.setenv("FLAT_RANK", "0")  # every group flat on this (the only) process
    trainer = Trainer(parse_recipe(grpo_document, builtin_registry))
    batch, metrics = trainer.dynamic_sampler.rollout(trainer.stream.batch(0), 0)
    # 4 prompts a round, 1 + 2 rounds: 12 flat groups, 4 of them fill the batch, 8 dropped
    assert metrics["batch/extra_rounds"] == 2
    assert metrics["batch/constant_groups_kept"] == 4 and metrics["batch/dropped_groups"] == 8
    assert len(batch) == 16 and constant_groups(batch.scores, batch.group_ids).all()
    row = trainer.step()  # a batch without signal still trains (advantages 0) and logs the counts
    assert row["batch/extra_rounds"] == 2 and row["train/loss_policy"] == approx(0.0, abs=1e-6)


def test_without_dynamic_sampling_nothing_is_logged_about_it(recipe_document, builtin_registry):
    row = Trainer(parse_recipe(recipe_document, builtin_registry)).step()
    assert not [name for name in row if name.startswith("batch/")]


@pytest.mark.slow
def test_two_processes_agree_on_extra_rounds(grpo_document, write_recipe, tmp_path):
    """Process 1 never gets a group with signal, process 0 always fills its share in the first
    round: process 0 must generate along in every extra round (scoring is a collective), or the
    launch hangs. Pad-less GPT-2-style tokenizer: rounds' prompts are padded with its added PAD."""
    grpo_document["policy"]["model"] = str(write_tiny_model(tmp_path / "gpt2-style", "gpt2"))
    grpo_document["ppo"].update({"batch_size": 16, "minibatch_size": 8})
    output_dir = tmp_path / "run"
    grpo_document["run"]["output_dir"] = str(output_dir)
    recipe = write_recipe(grpo_document)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               str(Path(sys.executable).with_name("rlkit")), "run", recipe, "--quiet"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env={**os.environ, "FLAT_RANK": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    trained = [row for row in rows if row["iteration"] > 0]
    assert len(trained) == 2
    for row in trained:
        # process 1's 2 prompts a round, 3 rounds: 6 flat groups, 2 of them fill its share;
        # process 0's flat groups (prompts starting with a or b) add to the dropped ones
        assert row["batch/extra_rounds"] == 2
        assert row["batch/constant_groups_kept"] == 2
        assert row["batch/dropped_groups"] >= 4
        assert row["check/logprob_gap"] < 1e-4


@pytest.mark.parametrize("change, message", [
    (lambda d: d["ppo"].update(dynamic_sampling=True),
     "$.ppo.dynamic_sampling: drops the groups of responses to one prompt that all score alike, but advantage estimator "
     "'gae' does not compare a prompt's responses; use a group estimator ('grpo', 'rloo') or set it to false"),
    (lambda d: d["ppo"].update(overlong_buffer=9),
     "$.ppo.overlong_buffer: 9 tokens is longer than generator.max_new_tokens = 8; use at most 8"),
    (lambda d: d["loss"].update(dual_clip=0.5),
     "$.loss.dual_clip: must be 0 (off) or > 1, got 0.5; 3 is usual"),
    (lambda d: d["loss"].update(is_level="sentence"),
     "$.loss.is_level: must be one of 'token', 'sequence', got 'sentence'"),
])
def test_settings_that_cannot_work_are_refused_where_they_go_wrong(recipe_document, builtin_registry, change, message):
    recipe_document["loss"] = {"type": "ppo-clip"}
    change(recipe_document)
    with pytest.raises(RecipeError) as caught:
        parse_recipe(recipe_document, builtin_registry)
    assert [str(p) for p in caught.value.problems] == [message]


def test_clip_low_and_high_default_to_clip(recipe_document, builtin_registry):
    recipe_document["loss"] = {"type": "ppo-clip", "clip": 0.3}
    config = parse_recipe(recipe_document, builtin_registry)["loss"].config
    assert (config.clip_low, config.clip_high, config.dual_clip, config.surrogate.component.name) == (0.3, 0.3, 0.0, "ppo")
    recipe_document["loss"]["clip_high"] = 0.28
    config = parse_recipe(recipe_document, builtin_registry)["loss"].config
    assert (config.clip_low, config.clip_high) == (0.3, 0.28)


def test_overlong_penalty_shapes_the_scores(recipe_document, builtin_registry):
    recipe_document["ppo"].update({"overlong_buffer": 4, "overlong_penalty": 1.0, "missing_eos_penalty": 0.25})
    trainer = Trainer(parse_recipe(recipe_document, builtin_registry))
    # max_new_tokens 8, buffer 4: lengths 3, 6, 8 lose 0, (6 - 4)/4 = 0.5, 1; the last never ended: 0.25 more
    scores = shaped(trainer.recipe, torch.tensor([1.0, 1.0, 1.0]), torch.tensor([True, True, False]), torch.tensor([3, 6, 8]))
    assert scores.tolist() == approx([1.0, 0.5, -0.25])


def test_mask_truncated_leaves_responses_without_eos_out_of_the_loss(recipe_document, builtin_registry):
    recipe_document["loss"] = {"type": "ppo-clip", "mask_truncated": True}
    recipe = parse_recipe(recipe_document, builtin_registry)
    choice = recipe["loss"]
    loss = choice.component.factory(choice.config, type("Context", (), {"recipe": recipe})())
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    old = torch.tensor([[-1.0, -2.0, -0.5, 0.0], [-1.5, -1.0, -1.0, -1.0]])
    batch = rollout_batch(with_values=False).select(torch.tensor([0, 1])).with_(
        response_mask=mask, loss_mask=mask, old_logprobs=old, sampled_logprobs=old, ended=torch.tensor([True, False]),
        advantages=torch.tensor([[1.0] * 4, [2.0] * 4]))
    terms = loss(batch, LossInputs(logprobs=old.clone(), values=None, entropy=torch.ones(2, 4)), token_count=7.0)
    # ratio 1: -A per token; only the first response (3 tokens, A = 1) counts, over all 7 tokens: -3/7
    assert float(terms.losses["policy"]) == approx(-3 / 7)
    weights, divisor = loss.aggregation(batch, 7.0)
    assert weights.tolist() == [[1.0] * 4, [0.0] * 4] and divisor == 7.0


def test_sequence_level_masked_importance_weights_in_the_loss(recipe_document, builtin_registry):
    recipe_document["loss"] = {"type": "ppo-clip", "tis_cap": 2.0, "is_level": "sequence", "is_mode": "mask"}
    recipe = parse_recipe(recipe_document, builtin_registry)
    choice = recipe["loss"]
    loss = choice.component.factory(choice.config, type("Context", (), {"recipe": recipe})())
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    old = torch.tensor([[-1.0, -2.0, -0.5, 0.0], [-1.5, -1.0, -1.0, -1.0]])
    # π_old/π_sampler: row 0 1.5 · 0.5 · 2 = 1.5 (kept); row 1 4 · 1 · 1 · 1 = 4 > 2 (masked to 0)
    sampled = old - torch.tensor([[math.log(1.5), math.log(0.5), math.log(2.0), 0.0], [math.log(4.0), 0.0, 0.0, 0.0]])
    batch = rollout_batch(with_values=False).select(torch.tensor([0, 1])).with_(
        response_mask=mask, loss_mask=mask, old_logprobs=old, sampled_logprobs=sampled, advantages=torch.tensor([[1.0] * 4, [2.0] * 4]))
    terms = loss(batch, LossInputs(logprobs=old.clone(), values=None, entropy=torch.ones(2, 4)), token_count=7.0)
    # ratio 1, so each token's term is -A·w: row 0 3 · (-1 · 1.5) = -4.5, row 1 0; over 7 tokens
    assert float(terms.losses["policy"]) == approx(-4.5 / 7)
    assert float(terms.diagnostics["tis_weight_mean"]) == approx(4.5 / 7)
    assert float(terms.diagnostics["tis_capped_frac"]) == approx(4 / 7)  # the masked share of the tokens
