"""The critic-free estimators (grpo, rloo, reinforce++, remax), `value_head.type = "none"` and the
loss aggregation modes: hand-computed values, plain-loop references, the recipe checks that
refuse what cannot work, and the loop without a critic."""

import io
import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from pytest import approx

from rlkit_core.batch import RolloutBatch
from rlkit_core.context import BuildContext
from rlkit_core.errors import RecipeError
from rlkit_core.functional import aggregation_weights, masked_sum
from rlkit_core.interfaces import LossInputs
from rlkit_core.recipe.document import load_recipe, parse_recipe
from rlkit_core.recipe.plugins import load_registry
from rlkit_core.runtime.rollout import greedy_baseline, sample_responses
from rlkit_core.runtime.run import run_recipe
from rlkit_core.runtime.trainer import Trainer
from rlkit_core.testing import rollout_batch
from tests.test_trainer import rollout_with

NAN = float("nan")
RECIPES = Path(__file__).parent.parent / "recipes"
VARIANTS = ["grpo_summarize", "dr_grpo_summarize", "rloo_summarize", "reinforce_pp_summarize", "remax_summarize",
            "dapo_summarize", "gspo_summarize"]


def estimator(registry, name, **config):
    component = registry.get("advantage_estimator", name, "test")
    return component.factory(component.config_class(**config), None)


def scored(rewards, mask, group_ids, baseline_scores=None) -> RolloutBatch:
    """A scored batch with just what the estimators read: per-token rewards (NaN on padding, as
    garbage may be there), the mask, the group ids and ReMax's baseline scores."""
    mask = torch.tensor(mask)
    batch = rollout_batch(with_values=False).select(torch.arange(len(mask)) % 6)
    rewards = torch.where(mask.bool(), torch.tensor(rewards), NAN)
    return batch.with_(rewards=rewards, response_mask=mask, loss_mask=mask, group_ids=torch.tensor(group_ids),
                       baseline_scores=None if baseline_scores is None else torch.tensor(baseline_scores))


# Five responses: group 7 holds rows 0, 1 and 3, group 2 rows 2 and 4. Totals R = 0.9, 0.7, 0.3, 0.3, 1.0.
MASK = [[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 0]]
REWARDS = [[0.0, -0.1, 1.0], [0.2, 0.5, NAN], [0.3, NAN, NAN], [-0.1, 0.0, 0.4], [0.5, 0.5, NAN]]
GROUPS = [7, 7, 2, 7, 2]
# Rewards-to-go (γ = 1): what every estimator returns as `returns`.
TO_GO = [[0.9, 0.9, 1.0], [0.7, 0.5, 0.0], [0.3, 0.0, 0.0], [0.3, 0.4, 0.4], [1.0, 0.5, 0.0]]


def per_token(values):
    """One value per response, written on its counted tokens."""
    return [[v if m else 0.0 for m in row] for v, row in zip(values, MASK)]


def test_grpo_by_hand(builtin_registry):
    batch = scored(REWARDS, MASK, GROUPS)
    # group 7: R = [0.9, 0.7, 0.3], mean 0.63333, unbiased std sqrt(0.186667 / 2) = 0.305505
    # group 2: R = [0.3, 1.0], mean 0.65, unbiased std 0.35·√2 = 0.494975
    eps = 1e-6
    expected = [0.266667 / (0.305505 + eps), 0.066667 / (0.305505 + eps), -0.35 / (0.494975 + eps),
                -0.333333 / (0.305505 + eps), 0.35 / (0.494975 + eps)]
    advantages, returns = estimator(builtin_registry, "grpo").estimate(batch)
    assert advantages.tolist() == [approx(row, abs=2e-5) for row in per_token(expected)]
    assert returns.tolist() == [approx(row) for row in TO_GO]
    # Dr. GRPO: centred only
    advantages, _ = estimator(builtin_registry, "grpo", scale_by_std=False).estimate(batch)
    assert advantages.tolist() == [approx(row, abs=1e-6) for row in per_token([0.266667, 0.066667, -0.35, -0.333333, 0.35])]


def test_rloo_by_hand(builtin_registry):
    # group 7: 0.9 − (0.7 + 0.3)/2 = 0.4, 0.7 − (0.9 + 0.3)/2 = 0.1, 0.3 − (0.9 + 0.7)/2 = −0.5
    # group 2: 0.3 − 1.0 = −0.7, 1.0 − 0.3 = 0.7
    advantages, returns = estimator(builtin_registry, "rloo").estimate(scored(REWARDS, MASK, GROUPS))
    assert advantages.tolist() == [approx(row, abs=1e-6) for row in per_token([0.4, 0.1, -0.7, -0.5, 0.7])]
    assert returns.tolist() == [approx(row) for row in TO_GO]


def test_reinforce_plus_plus_by_hand(builtin_registry):
    batch = scored(REWARDS, MASK, GROUPS)
    # γ = 1: the 11 counted rewards-to-go of TO_GO have mean 0.627273 and (biased) std 0.266598
    advantages, returns = estimator(builtin_registry, "reinforce++").estimate(batch)
    assert advantages.tolist() == [approx(row, abs=1e-5) for row in [
        [1.022992, 1.022992, 1.398088], [0.272798, -0.477396, 0.0], [-1.227590, 0.0, 0.0],
        [-1.227590, -0.852493, -0.852493], [1.398088, -0.477396, 0.0]]]
    assert returns.tolist() == [approx(row) for row in TO_GO]
    # γ = 0.5: row 0 is 0 + 0.5·(−0.1 + 0.5·1.0) = 0.2, −0.1 + 0.5 = 0.4, 1.0
    _, returns = estimator(builtin_registry, "reinforce++", gamma=0.5).estimate(batch)
    assert returns.tolist() == [approx(row) for row in [
        [0.2, 0.4, 1.0], [0.45, 0.5, 0.0], [0.3, 0.0, 0.0], [0.0, 0.2, 0.4], [0.75, 0.5, 0.0]]]


def test_remax_by_hand(builtin_registry):
    # the greedy response of group 7 scored 0.5, that of group 2 scored 0.2: A_t = G_t − b
    batch = scored(REWARDS, MASK, GROUPS, baseline_scores=[0.5, 0.5, 0.2, 0.5, 0.2])
    advantages, returns = estimator(builtin_registry, "remax").estimate(batch)
    assert advantages.tolist() == [approx(row, abs=1e-6) for row in [
        [0.4, 0.4, 0.5], [0.2, 0.0, 0.0], [0.1, 0.0, 0.0], [-0.2, -0.1, -0.1], [0.8, 0.3, 0.0]]]
    assert returns.tolist() == [approx(row) for row in TO_GO]


def random_batch(seed=3, size=24, width=7):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, width + 1, (size,), generator=g)
    mask = (torch.arange(width) < lengths[:, None]).long()
    groups = (torch.arange(size) // 4 * 10 + 3)[torch.randperm(size, generator=g)]  # six groups of 4, shuffled
    rewards = torch.randn(size, width, generator=g)
    baseline = torch.randn(size, generator=g)
    return scored(rewards.tolist(), mask.tolist(), groups.tolist(), baseline.tolist())


def to_go_loop(rewards, length, gamma):
    out, running = [0.0] * len(rewards), 0.0
    for t in reversed(range(length)):
        running = rewards[t] + gamma * running
        out[t] = running
    return out


@pytest.mark.parametrize("name, config", [("grpo", {}), ("grpo", {"scale_by_std": False}), ("rloo", {}),
                                          ("reinforce++", {"gamma": 0.9}), ("remax", {})])
def test_estimators_match_a_plain_loop(builtin_registry, name, config):
    batch = random_batch()
    lengths = batch.response_mask.sum(1).tolist()
    rewards, groups = batch.rewards.tolist(), batch.group_ids.tolist()
    totals = [sum(row[:n]) for row, n in zip(rewards, lengths)]
    gamma = config.get("gamma", 1.0)
    to_go = [to_go_loop(row, n, gamma) for row, n in zip(rewards, lengths)]
    expected = []
    for i, n in enumerate(lengths):
        members = [totals[j] for j in range(len(totals)) if groups[j] == groups[i]]
        others = [totals[j] for j in range(len(totals)) if groups[j] == groups[i] and j != i]
        if name == "grpo":
            value = totals[i] - statistics.mean(members)
            if config.get("scale_by_std", True):
                value /= statistics.stdev(members) + 1e-6
            row = [value] * n
        elif name == "rloo":
            row = [totals[i] - statistics.mean(others)] * n
        elif name == "remax":
            row = [g - float(batch.baseline_scores[i]) for g in to_go[i][:n]]
        else:
            counted = [g for r, m in zip(to_go, lengths) for g in r[:m]]
            mean, std = statistics.mean(counted), statistics.pstdev(counted)
            row = [(g - mean) / math.sqrt(std**2 + 1e-8) for g in to_go[i][:n]]
        expected.append(row + [0.0] * (len(rewards[i]) - n))
    advantages, returns = estimator(builtin_registry, name, **config).estimate(batch)
    assert advantages.tolist() == [approx(row, rel=1e-5, abs=1e-6) for row in expected]  # float32
    assert returns.tolist() == [approx(row, rel=1e-5, abs=1e-6) for row in to_go]


# ---------------------------------------------------------------- loss aggregation


def test_aggregation_weights_by_hand():
    per_token_loss = torch.tensor([[1.0, 2.0, 3.0, NAN], [4.0, NAN, NAN, NAN]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])

    def aggregate(mode, divisor, norm=1.0):
        weights = aggregation_weights(mask, mode, norm)
        return float(masked_sum(per_token_loss if weights is None else weights * per_token_loss, mask) / divisor)

    assert aggregate("token-mean", 4) == approx((1 + 2 + 3 + 4) / 4)  # every token alike
    assert aggregate("seq-mean-token-mean", 2) == approx((6 / 3 + 4 / 1) / 2)  # each response's mean, then their mean
    assert aggregate("seq-mean-token-sum-norm", 2, norm=4.0) == approx((6 / 4 + 4 / 4) / 2)  # sums over a constant
    with pytest.raises(ValueError, match="unknown aggregation 'seq-sum'"):
        aggregation_weights(mask, "seq-sum")


def build_loss(recipe_document, registry, **loss):
    recipe_document["loss"] = {"type": "ppo-clip", **loss}
    recipe = parse_recipe(recipe_document, registry)
    return BuildContext(recipe, torch.device("cpu"), recipe.run.output_dir, 0).build(recipe["loss"])


@pytest.mark.parametrize("mode, expected", [
    # advantages 1 on response 0 (3 tokens), 2 on response 1 (1 token), ratio 1, minibatch_size 8 rollouts
    ("token-mean", -(3 * 1 + 2) / 4),
    ("seq-mean-token-mean", -(1 + 2) / 8),
    ("seq-mean-token-sum-norm", -(3 * 1 / 8 + 2 / 8) / 8),  # generator.max_new_tokens = 8
])
def test_ppo_clip_aggregates_by_hand(recipe_document, builtin_registry, mode, expected):
    loss = build_loss(recipe_document, builtin_registry, aggregation=mode, entropy_coef=0.5)
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])
    old = torch.tensor([[-1.0, -2.0, -0.5, NAN], [-1.5, NAN, NAN, NAN]])
    batch = rollout_batch(with_values=False).select(torch.tensor([0, 1])).with_(
        response_mask=mask, loss_mask=mask, old_logprobs=old, sampled_logprobs=old, advantages=torch.tensor([[1.0] * 4, [2.0] * 4]))
    current = LossInputs(logprobs=old.clone(), values=None, entropy=torch.ones(2, 4))
    terms = loss(batch, current, token_count=4.0)
    assert float(terms.losses["policy"]) == approx(expected)
    # the entropy bonus aggregates alike: the mean of an entropy of 1 is the policy term with A = 1
    ones = {"token-mean": 1.0, "seq-mean-token-mean": 2 / 8, "seq-mean-token-sum-norm": (3 / 8 + 1 / 8) / 8}[mode]
    assert float(terms.losses["entropy"]) == approx(-0.5 * ones)
    assert "value" not in terms.losses and "value_loss" not in terms.diagnostics


def test_token_sum_norm_can_be_set(recipe_document, builtin_registry):
    loss = build_loss(recipe_document, builtin_registry, aggregation="seq-mean-token-sum-norm", token_sum_norm=2.0)
    weights, divisor = loss.aggregation(rollout_batch(), 10.0)
    assert divisor == 8 and torch.all(weights == 0.5)


# ---------------------------------------------------------------- recipes: what is refused, what is defaulted


def critic_free(recipe_document, estimator_name="grpo", samples=4):
    recipe_document["advantage"] = {"type": estimator_name}
    recipe_document["ppo"]["samples_per_prompt"] = samples
    return recipe_document


@pytest.mark.parametrize("change, message", [
    (lambda d: d.update(value_head={"type": "shared"}),
     "$.value_head.type: advantage estimator 'grpo' uses no critic, so the 'shared' critic would cost memory and time "
     "for nothing; set value_head.type = 'none' or leave [value_head] out"),
    (lambda d: d["ppo"].update(samples_per_prompt=1),
     "$.ppo.samples_per_prompt: advantage estimator 'grpo' compares the responses to each prompt, so it needs at least 2, got 1; 4 to 16 are usual"),
    (lambda d: d["ppo"].update(batch_size=18, minibatch_size=6),
     "$.ppo.batch_size: 18 rollouts do not split into groups of samples_per_prompt=4; use a multiple of 4"),
    (lambda d: d.update(advantage={"type": "gae"}, value_head={"type": "none"}),
     "$.value_head.type: 'none' builds no critic, but advantage estimator 'gae' needs values; use 'shared' or 'separate', "
     "or a critic-free estimator such as 'grpo'"),
])
def test_recipes_that_cannot_work_are_refused_where_they_go_wrong(recipe_document, builtin_registry, change, message):
    document = critic_free(recipe_document)
    change(document)
    with pytest.raises(RecipeError) as caught:
        parse_recipe(document, builtin_registry)
    assert [str(p) for p in caught.value.problems] == [message]


def test_rloo_needs_groups_and_reinforce_plus_plus_and_remax_do_not(recipe_document, builtin_registry):
    with pytest.raises(RecipeError, match=r"\$\.ppo\.samples_per_prompt: advantage estimator 'rloo'"):
        parse_recipe(critic_free(recipe_document, "rloo", samples=1), builtin_registry)
    for name in ("reinforce++", "remax"):
        assert "value_head" not in parse_recipe(critic_free(recipe_document, name, samples=1), builtin_registry).components  # "none"


def test_value_head_defaults_to_none_for_a_critic_free_estimator(recipe_document, builtin_registry):
    assert parse_recipe(recipe_document, builtin_registry)["value_head"].component.name == "shared"
    assert "value_head" not in parse_recipe(critic_free(recipe_document), builtin_registry).components  # "none": no critic


def test_none_is_the_cores_own_type_for_no_critic(recipe_document, builtin_registry):
    from test_plugins import EmptyConfig, plugin_module

    from rlkit_core.interfaces import ValueHead
    from rlkit_core.recipe.inventory import inventory_rows, registry_rows

    assert "none" not in builtin_registry.names("value_head")  # no plugin registers it
    recipe = parse_recipe(critic_free(recipe_document), builtin_registry)
    assert {"table": "value_head", "kind": "value_head", "type": "none"}.items() <= inventory_rows(recipe)[1].items()
    assert [row["plugin"] for row in registry_rows(builtin_registry) if row["name"] == "none" and row["kind"] == "value_head"] == [
        "core: builds no value_head"]
    with pytest.raises(RecipeError) as caught:
        parse_recipe(critic_free(recipe_document) | {"value_head": {"type": "none", "model": "x"}}, builtin_registry)
    assert caught.value.problems == ["$.value_head.model: unknown key; type = 'none' builds no value_head, so it takes no settings"]
    with pytest.raises(RecipeError, match=r"unknown value_head 'nnoe'; registered: separate, shared; or 'none' for no "
                                          r"value_head; did you mean 'none'\?"):
        parse_recipe(critic_free(recipe_document) | {"value_head": {"type": "nnoe"}}, builtin_registry)

    class Absent(ValueHead):
        pass

    module = plugin_module("absent", register_value_heads=lambda register: register("none", Absent, EmptyConfig))
    registry = load_registry(environ={"RLKIT_PLUGINS": "none"}, extra_plugins=[("absent", module, "rlkit-absent", "0.1")])
    assert "'none' is the type that builds no value_head" in registry.broken["absent"]


def test_kl_in_the_loss_defaults_to_k3(recipe_document, builtin_registry):
    assert parse_recipe(recipe_document, builtin_registry).ppo.kl_estimator == "k1"
    recipe_document["ppo"]["kl_penalty"] = "loss"
    assert parse_recipe(recipe_document, builtin_registry).ppo.kl_estimator == "k3"
    recipe_document["ppo"]["kl_estimator"] = "k2"  # what a recipe says wins
    assert parse_recipe(recipe_document, builtin_registry).ppo.kl_estimator == "k2"


def rlkit(*args):
    env = {**os.environ, "RLKIT_PLUGINS": "none"}
    return subprocess.run([sys.executable, "-m", "rlkit_core.runtime.cli", *args], capture_output=True, text=True, env=env, timeout=300)


@pytest.mark.slow
def test_rlkit_check_refuses_a_critic_with_grpo_and_plugins_lists_the_new_parts(recipe_document, write_recipe):
    document = critic_free(recipe_document)
    document["value_head"] = {"type": "separate", "model": "x"}
    result = rlkit("check", write_recipe(document))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "$.value_head.type: advantage estimator 'grpo' uses no critic" in result.stderr

    listed = json.loads(rlkit("plugins", "--json").stdout)
    names = {(row["kind"], row["name"]) for row in listed["components"]}
    assert {("advantage_estimator", n) for n in ("grpo", "rloo", "reinforce++", "remax")} <= names
    assert ("value_head", "none") in names
    ppo_clip = next(row for row in listed["components"] if row["name"] == "ppo-clip")
    assert {"aggregation", "token_sum_norm"} <= {f["name"] for f in ppo_clip["fields"]}
    ppo_table = next(table for table in listed["core"] if table["table"] == "ppo")
    assert next(f for f in ppo_table["fields"] if f["name"] == "kl_estimator")["default"] == "k1"


# ---------------------------------------------------------------- the loop without a critic


def test_remax_baseline_is_the_score_of_the_greedy_response(recipe_document, builtin_registry):
    document = critic_free(recipe_document, "remax", samples=2)
    document["ppo"]["missing_eos_penalty"] = 0.25  # the baseline is shaped as the samples' scores are
    trainer = Trainer(parse_recipe(document, builtin_registry))
    records = trainer.stream.batch(0)
    batch, _ = rollout_with(trainer, records)
    engine, components, recipe, max_tokens = trainer.engine, trainer.components, trainer.recipe, trainer.prompts.max_tokens
    with_baseline, timing = greedy_baseline(engine, components, recipe, records, batch, max_tokens)
    greedy = sample_responses(engine, components, recipe, records, recipe.ppo.batch_size, max_tokens, greedy=True)
    scores = trainer.components.reward.score([r["prompt"] for r in records], greedy, letter=[r["letter"] for r in records])
    ended = [trainer.components.policy.tokenizer.eos_token in text for text in greedy]  # decoded without special tokens: never there
    expected = [s - 0.25 * (not e) for s, e in zip(scores, ended) for _ in range(2)]
    assert with_baseline.baseline_scores.tolist() == approx(expected)
    assert timing["time/baseline"] > 0


def test_a_critic_free_run_has_no_critic_anywhere(recipe_document, builtin_registry, tmp_path):
    """No value head is built or trained, and nothing about one is logged or checkpointed."""
    document = critic_free(recipe_document, "rloo")
    document["run"]["steps"] = 1
    trainer = Trainer(parse_recipe(document, builtin_registry))
    assert trainer.components.value_head is None
    assert len(trainer.engine.parameters) == len(list(trainer.components.policy.parameters()))
    run_recipe(parse_recipe(document, builtin_registry), quiet=True, out=io.StringIO())
    row = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert "train/loss_policy" in row
    assert not [name for name in row if "value" in name or "explained" in name]
    assert not list((tmp_path / "run" / "checkpoints").glob("*/value_head.safetensors"))


@pytest.fixture(scope="module")
def warm_start_cache(tmp_path_factory):
    """One tiny warm start for every variant recipe: the same settings reuse the cached build."""
    return tmp_path_factory.mktemp("warm-start-cache")


@pytest.mark.parametrize("name", VARIANTS)
def test_variant_recipes_run_two_iterations(name, tmp_path, warm_start_cache):
    """Each shipped variant recipe, shrunk: a tiny warm start, a small batch, two iterations."""
    overrides = [
        "run.steps=2", f"run.output_dir={tmp_path / 'run'}", "run.threads=1", "tracker.type=none",
        "policy.n_layer=1", "policy.n_embd=16", "policy.n_head=2", "policy.sft_steps=2", "policy.sft_batch_size=4",
        f"policy.cache_dir={warm_start_cache}", "generator.max_new_tokens=6", "data.size=40", "eval.size=4",
        "ppo.batch_size=8", "ppo.minibatch_size=4",
    ]
    recipe = load_recipe(RECIPES / f"{name}.toml", load_registry(environ={"RLKIT_PLUGINS": "none"}), overrides)
    assert "value_head" not in recipe.components  # "none"
    history = run_recipe(recipe, quiet=True, out=io.StringIO())
    assert [row["iteration"] for row in history] == [0, 1, 2]
    assert all(math.isfinite(history[-1][key]) for key in ("train/loss_policy", "score/mean", "eval/score"))
