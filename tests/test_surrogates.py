"""The loss contract as types: surrogates registered by name (built-in and a plugin's), `LossTerms`
combined over a step by field, the names the loop refuses, and the forward-pass needs a loss declares."""

import importlib.util
import math
import types
from pathlib import Path

import pytest
import torch
from pytest import approx
from test_plugins import EmptyConfig, plugin_module

from rlkit_core import Loss, LossTerms
from rlkit_core.context import BuildContext
from rlkit_core.errors import RecipeError, RunError
from rlkit_core.interfaces import LossInputs
from rlkit_core.recipe.document import parse_recipe
from rlkit_core.recipe.plugins import load_registry
from rlkit_core.runtime.distributed import StepTerms, add_terms
from rlkit_core.runtime.trainer import Trainer
from rlkit_core.surrogates import SURROGATES, surrogate
from rlkit_core.testing import rollout_batch

NAN = float("nan")
DEMO = Path(__file__).parent / "data" / "rlkit_surrogate_demo.py"

# The 2×3 example of the CISPO tests: response 0 has 3 tokens, response 1 has 2 (and padding).
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])
OLD = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -0.5, NAN]])
RATIO = torch.tensor([[1.5, 0.8, 1.1], [2.0, 1.0, 1.0]])  # π_θ / π_old
ADVANTAGES = torch.tensor([[1.0, -1.0, 2.0], [-0.5, 1.0, NAN]])


def build_loss(document, registry, **config):
    document["loss"] = {"type": "ppo-clip", **config}
    recipe = parse_recipe(document, registry)
    return BuildContext(recipe, torch.device("cpu"), recipe.run.output_dir, 0).build(recipe["loss"])


def example_batch():
    return rollout_batch(with_values=False).select(torch.tensor([0, 1])).with_(
        response_mask=MASK, loss_mask=MASK, old_logprobs=OLD, sampled_logprobs=OLD, advantages=ADVANTAGES)


def test_cispo_by_hand():
    logprobs = (OLD + RATIO.log()).requires_grad_()
    log_ratio = torch.where(MASK.bool(), logprobs - OLD, torch.zeros_like(logprobs))
    out = SURROGATES["cispo"](log_ratio, ADVANTAGES, MASK, types.SimpleNamespace(clip_high=0.28))
    # weights sg(min(r, 1.28)): [1.28, 0.8, 1.1], [1.28, 1.0]; per token -w·A·log r:
    #   -1.28 · 1 · ln 1.5 = -0.518995   -0.8 · -1 · ln 0.8 = -0.178515   -1.1 · 2 · ln 1.1 = -0.209682
    #   -1.28 · -0.5 · ln 2 = 0.443614   -1.0 · 1 · ln 1 = 0
    expected = [-1.28 * math.log(1.5), 0.8 * math.log(0.8), -2.2 * math.log(1.1), 0.64 * math.log(2.0), 0.0]
    assert out.per_token[MASK.bool()].tolist() == approx(expected, abs=1e-6)
    assert out.diagnostics["clipfrac"].item() == approx(2 / 5)  # 1.5 and 2.0 are above the cap
    assert out.log_ratio is None  # the ratio diagnostics read the token log-ratios it was given
    (out.per_token[MASK.bool()].sum() / 5).backward()
    # d/dlog π = -w·A / 5 on every counted token, the capped ones included: PPO's clip would give
    # the first token (r = 1.5 > 1.2, A > 0) no gradient at all
    assert logprobs.grad is not None
    assert logprobs.grad.flatten().tolist() == approx([-1.28 / 5, 0.8 / 5, -2.2 / 5, 0.64 / 5, -1.0 / 5, 0.0])


def test_ppo_clip_runs_the_surrogate_a_recipe_names(recipe_document, builtin_registry):
    loss = build_loss(recipe_document, builtin_registry, surrogate="cispo", clip_high=0.28)
    current = LossInputs(logprobs=OLD + RATIO.log(), values=None, entropy=torch.ones(2, 3))
    terms = loss(example_batch(), current, token_count=5.0)
    # the token mean of test_cispo_by_hand's per-token losses: -0.463578 / 5
    expected = (-1.28 * math.log(1.5) + 0.8 * math.log(0.8) - 2.2 * math.log(1.1) + 0.64 * math.log(2.0)) / 5
    assert float(terms.losses["policy"]) == approx(expected, abs=1e-6)
    assert float(terms.diagnostics["clipfrac"]) == approx(2 / 5)
    assert float(terms.diagnostics["ratio_mean"]) == approx((1.5 + 0.8 + 1.1 + 2.0 + 1.0) / 5)
    assert float(terms.maxima["ratio_max"]) == approx(2.0)
    assert float(terms.skip) == 0.0


def test_ratio_level_sequence_is_the_gspo_surrogate(recipe_document, builtin_registry):
    recipe_document["loss"] = {"type": "ppo-clip", "ratio_level": "sequence"}
    assert parse_recipe(recipe_document, builtin_registry)["loss"].config.surrogate == "gspo"
    recipe_document["loss"]["surrogate"] = "cispo"
    with pytest.raises(RecipeError, match=r"\$\.loss\.surrogate: .*ratio_level = 'sequence' is GSPO's ratio"):
        parse_recipe(recipe_document, builtin_registry)


def test_a_surrogate_nobody_registered_is_refused_with_the_registered_names(recipe_document, builtin_registry):
    recipe_document["loss"] = {"type": "ppo-clip", "surrogate": "ppo2"}
    with pytest.raises(RecipeError, match=r"\$\.loss\.surrogate: no surrogate 'ppo2' is registered; registered: .*cispo, gspo, ppo"):
        parse_recipe(recipe_document, builtin_registry)


def test_a_name_another_surrogate_holds_is_refused():
    def impostor(log_ratio, advantages, mask, settings):
        raise AssertionError("never called")

    with pytest.raises(ValueError, match=r"surrogate 'ppo' is registered twice: by rlkit_core\.surrogates\.ppo and by .*impostor"):
        surrogate("ppo")(impostor)
    assert SURROGATES["ppo"].__module__ == "rlkit_core.surrogates"


def test_a_plugin_registers_its_own_surrogate(recipe_document):
    """What an entry point does: import the plugin's module, whose decorator registers the surrogate."""
    spec = importlib.util.spec_from_file_location("rlkit_surrogate_demo", DEMO)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    registry = load_registry(environ={"RLKIT_PLUGINS": "none"}, extra_plugins=[("demo", module, "rlkit-surrogate-demo", "0.1")])
    loss = build_loss(recipe_document, registry, surrogate="demo-reinforce")
    logprobs = (OLD + RATIO.log()).requires_grad_()
    terms = loss(example_batch(), LossInputs(logprobs=logprobs, values=None, entropy=torch.ones(2, 3)), token_count=5.0)
    # -A·log r per token: -ln 1.5, ln 0.8, -2 ln 1.1, 0.5 ln 2, 0, over the 5 counted tokens
    expected = (-math.log(1.5) + math.log(0.8) - 2 * math.log(1.1) + 0.5 * math.log(2.0)) / 5
    assert terms.losses["policy"].item() == approx(expected, abs=1e-6)
    terms.total().backward()
    assert logprobs.grad is not None
    assert logprobs.grad.flatten().tolist() == approx([-0.2, 0.2, -0.4, 0.1, -0.2, 0.0])  # -A / 5, unclipped


def test_a_step_combines_the_terms_by_field():
    """Two micro-batches of 1 and 3 of the step's 4 tokens: losses add, diagnostics add weighted by
    their token share, maxima and skip take the maximum."""
    first = LossTerms(losses={"policy": torch.tensor(0.5), "value": torch.tensor(0.25)}, diagnostics={"clipfrac": torch.tensor(1.0)},
                      maxima={"ratio_max": torch.tensor(3.0)}, skip=torch.tensor(0.0))
    second = LossTerms(losses={"policy": torch.tensor(-1.5), "value": torch.tensor(0.5)}, diagnostics={"clipfrac": torch.tensor(0.0)},
                       maxima={"ratio_max": torch.tensor(1.5)}, skip=torch.tensor(1.0))
    step = StepTerms({}, {})
    for terms, share in [(first, torch.tensor(0.25)), (second, torch.tensor(0.75))]:
        step = add_terms(step, StepTerms.share_of("mine", terms, share))
    metrics = {name: float(value) for name, value in step.metrics().items()}
    assert metrics == approx({"loss_policy": -1.0, "loss_value": 0.75, "loss": -0.25, "clipfrac": 0.25, "ratio_max": 3.0, "skipped": 1.0})
    assert float(step.loss) == approx(-0.25) and float(step.skip) == 1.0


@pytest.mark.parametrize("terms, named", [
    (LossTerms(losses={"policy": torch.tensor(1.0)}, diagnostics={"grad_norm": torch.tensor(1.0)}),
     "diagnostics['grad_norm'] would be logged as train/grad_norm, which the loop logs itself"),
    (LossTerms(losses={"policy": torch.tensor(1.0)}, maxima={"loss": torch.tensor(1.0)}),
     "maxima['loss'] would be logged as train/loss, which the loop logs itself"),
    (LossTerms(losses={"policy": torch.tensor(1.0)}, diagnostics={"loss_policy": torch.tensor(1.0)}),
     "diagnostics['loss_policy'] and losses['policy'] would both be logged as train/loss_policy"),
    (LossTerms(losses={"policy": torch.tensor(1.0)}, diagnostics={"skipped": torch.tensor(1.0)}),
     "skip['skip'] and diagnostics['skipped'] would both be logged as train/skipped"),
], ids=["loop-metric", "loop-loss", "loss-and-diagnostic", "skipped"])
def test_a_term_the_loop_cannot_log_under_its_name_is_refused(terms, named):
    with pytest.raises(RunError) as refused:
        StepTerms.share_of("mine", terms, torch.tensor(1.0))
    assert "loss 'mine' returns terms the loop cannot log" in str(refused.value) and named in str(refused.value)


def test_a_loss_that_returns_a_dict_is_told_to_return_loss_terms():
    with pytest.raises(RunError, match="loss 'old-style' returned a dict; a loss returns rlkit_core.LossTerms"):
        StepTerms.share_of("old-style", {"loss_policy": torch.tensor(1.0)}, torch.tensor(1.0))  # pyright: ignore[reportArgumentType]  # the mistake under test


def test_cispo_trains_a_step(recipe_document, builtin_registry):
    recipe_document["loss"] = {"type": "ppo-clip", "surrogate": "cispo", "clip_high": 0.28}
    recipe_document["run"]["steps"] = 1
    trainer = Trainer(parse_recipe(recipe_document, builtin_registry))
    before = [p.detach().clone() for p in trainer.engine.parameters]
    metrics = trainer.step()
    assert math.isfinite(metrics["train/loss_policy"]) and math.isfinite(metrics["train/loss"])
    assert 0.0 <= metrics["train/clipfrac"] <= 1.0 and metrics["train/skipped"] == 0.0
    assert any(not torch.equal(b, p) for b, p in zip(before, trainer.engine.parameters))


class LogitLoss(Loss):
    """Reads the response logits: the mean log-sum-exp of the counted positions, as a policy term."""

    needs_logits = True
    seen: list = []

    def __init__(self, config, context):
        pass

    def __call__(self, minibatch, current, token_count):
        assert current.logits is not None, "declared: the loop keeps them"
        LogitLoss.seen.append(current.logits)
        mask = minibatch.response_mask.bool()
        return LossTerms(losses={"policy": current.logits.logsumexp(-1)[mask].sum() / token_count})


def test_the_loop_keeps_the_logits_only_for_a_loss_that_declares_them(recipe_document, builtin_registry):
    module = plugin_module("logits", register_losses=lambda register: register("logits", LogitLoss, EmptyConfig))
    registry = load_registry(environ={"RLKIT_PLUGINS": "none"}, extra_plugins=[("logits", module, "rlkit-logits", "0.1")])
    recipe_document["loss"] = {"type": "logits"}
    recipe_document["ppo"].update(batch_size=8, minibatch_size=8, epochs=1)
    trainer = Trainer(parse_recipe(recipe_document, registry))
    trainer.step()
    [logits] = LogitLoss.seen
    vocabulary = trainer.components.policy.model.config.vocab_size
    assert logits.requires_grad and logits.dim() == 3 and logits.shape[2] == vocabulary

    ppo_clip = build_loss(recipe_document, builtin_registry)
    assert not ppo_clip.needs_logits and not ppo_clip.needs_entropy_grad  # entropy_coef 0: no entropy graph either
    assert build_loss(recipe_document, builtin_registry, entropy_coef=0.01).needs_entropy_grad


class VagueLoss(LogitLoss):
    needs_logits = "maybe"  # pyright: ignore[reportAssignmentType]  # the mistake under test


def test_a_need_that_is_not_a_boolean_breaks_the_plugin():
    module = plugin_module("vague", register_losses=lambda register: register("vague", VagueLoss, EmptyConfig))
    registry = load_registry(environ={"RLKIT_PLUGINS": "none"}, extra_plugins=[("vague", module, "rlkit-vague", "0.1")])
    assert "VagueLoss.needs_logits must be True or False, got 'maybe'" in registry.broken["vague"]
