"""The loss contract as types: surrogates registered by a hook with settings of their own (built-in
and a plugin's) and picked in `[loss.surrogate]`, `LossTerms` combined over a step by field, the
names the loop refuses and the ones it logs for every loss, and the forward-pass needs a loss declares."""

import importlib.util
import math
from pathlib import Path

import pytest
import torch
from pytest import approx
from rlkit_plugins.cispo import CISPOConfig
from test_plugins import EmptyConfig, plugin_module

from rlkit_core import Loss, LossTerms, RatioClip
from rlkit_core.context import BuildContext
from rlkit_core.errors import PluginError, RecipeError, RunError
from rlkit_core.interfaces import LossInputs
from rlkit_core.recipe.document import parse_recipe
from rlkit_core.recipe.inventory import inventory_rows, registry_rows
from rlkit_core.recipe.plugins import load_registry
from rlkit_core.runtime.distributed import StepTerms, add_terms
from rlkit_core.runtime.trainer import Trainer
from rlkit_core.testing import rollout_batch

NAN = float("nan")
DEMO = Path(__file__).parent / "data" / "rlkit_surrogate_demo.py"
UNREAD = RatioClip(low=0.2, high=0.2)  # the loss's clip, which cispo does not read

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


def cispo_by_registry(builtin_registry):
    """The function `ppo-clip` registers as surrogate cispo (what the loss calls)."""
    component = builtin_registry.get("surrogate", "cispo", "test")
    assert component.plugin == "ppo-clip" and component.config_class is CISPOConfig
    return component.factory


def test_cispo_by_hand(builtin_registry):
    cispo = cispo_by_registry(builtin_registry)
    logprobs = (OLD + RATIO.log()).requires_grad_()
    log_ratio = torch.where(MASK.bool(), logprobs - OLD, torch.zeros_like(logprobs))
    out = cispo(log_ratio, ADVANTAGES, MASK, CISPOConfig(eps_high_is=0.28), UNREAD)
    # weights sg(clip(r, 1 - 1, 1.28)) (eps_low_is 1: no lower bound): [1.28, 0.8, 1.1], [1.28, 1.0]; per token -w·A·log r:
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


def test_cispo_lower_bound_by_hand(builtin_registry):
    cispo = cispo_by_registry(builtin_registry)
    logprobs = (OLD + RATIO.log()).requires_grad_()
    log_ratio = torch.where(MASK.bool(), logprobs - OLD, torch.zeros_like(logprobs))
    out = cispo(log_ratio, ADVANTAGES, MASK, CISPOConfig(eps_high_is=0.28, eps_low_is=0.1), UNREAD)
    # clip(r, 0.9, 1.28): the second token's 0.8 rises to 0.9, so its term is -0.9 · -1 · ln 0.8 = -0.200829;
    # the others as in test_cispo_by_hand; three of the five weights clipped (1.5, 0.8, 2.0)
    expected = [-1.28 * math.log(1.5), 0.9 * math.log(0.8), -2.2 * math.log(1.1), 0.64 * math.log(2.0), 0.0]
    assert out.per_token[MASK.bool()].tolist() == approx(expected, abs=1e-6)
    assert out.diagnostics["clipfrac"].item() == approx(3 / 5)
    (out.per_token[MASK.bool()].sum() / 5).backward()
    assert logprobs.grad is not None
    assert logprobs.grad.flatten().tolist() == approx([-1.28 / 5, 0.9 / 5, -2.2 / 5, 0.64 / 5, -1.0 / 5, 0.0])


def test_ppo_clip_runs_the_surrogate_a_recipe_names_with_its_settings(recipe_document, builtin_registry):
    loss = build_loss(recipe_document, builtin_registry, surrogate={"type": "cispo", "eps_high_is": 0.28})
    current = LossInputs(logprobs=OLD + RATIO.log(), values=None, entropy=torch.ones(2, 3))
    terms = loss(example_batch(), current, token_count=5.0)
    # the token mean of test_cispo_by_hand's per-token losses: -0.463578 / 5
    expected = (-1.28 * math.log(1.5) + 0.8 * math.log(0.8) - 2.2 * math.log(1.1) + 0.64 * math.log(2.0)) / 5
    assert float(terms.losses["policy"]) == approx(expected, abs=1e-6)
    assert float(terms.diagnostics["clipfrac"]) == approx(2 / 5)
    assert float(terms.diagnostics["ratio_mean"]) == approx((1.5 + 0.8 + 1.1 + 2.0 + 1.0) / 5)
    assert float(terms.maxima["ratio_max"]) == approx(2.0)
    assert float(terms.skip) == 0.0
    assert "entropy" not in terms.diagnostics and "approx_kl" not in terms.diagnostics  # the loop's own


def test_a_surrogate_named_alone_has_its_default_settings_and_none_is_ppo(recipe_document, builtin_registry):
    recipe_document["loss"] = {"type": "ppo-clip", "surrogate": "cispo"}
    choice = parse_recipe(recipe_document, builtin_registry)["loss"].config.surrogate
    assert (choice.table, choice.component.name, choice.config) == ("loss.surrogate", "cispo", CISPOConfig())
    recipe_document["loss"] = {"type": "ppo-clip"}
    recipe = parse_recipe(recipe_document, builtin_registry)
    assert recipe["loss"].config.surrogate.component.name == "ppo"
    assert ("loss.surrogate", "surrogate", "ppo", "ppo-clip") in [
        (row["table"], row["kind"], row["type"], row["plugin"]) for row in inventory_rows(recipe)]


@pytest.mark.parametrize("surrogate, message", [
    ("ppo2", "$.loss.surrogate: unknown surrogate 'ppo2'; registered: cispo, gspo, ppo; did you mean 'ppo'?"),
    ({"type": "gpso"}, "$.loss.surrogate.type: unknown surrogate 'gpso'; registered: cispo, gspo, ppo; did you mean 'gspo'?"),
    ({"type": "cispo", "eps_high_is": -1}, "$.loss.surrogate.eps_high_is: must be > 0, got -1.0"),
    ({"type": "ppo", "eps_high_is": 0.28}, "$.loss.surrogate.eps_high_is: unknown key; it takes no settings"),
    ({"type": "ppo", "clip_high": 0.28}, "$.loss.surrogate.clip_high: clip_high is a setting of the loss, which ppo and gspo clip by: "
                                         "write it in [loss]"),
], ids=["alone", "table", "setting", "another-surrogates-setting", "the-losss-setting"])
def test_a_surrogate_table_is_checked_where_it_sits(recipe_document, builtin_registry, surrogate, message):
    recipe_document["loss"] = {"type": "ppo-clip", "surrogate": surrogate}
    with pytest.raises(RecipeError) as caught:
        parse_recipe(recipe_document, builtin_registry)
    assert caught.value.problems == [message]


def test_ratio_level_is_gone_and_a_recipe_naming_it_is_told_the_gspo_surrogate(recipe_document, builtin_registry):
    recipe_document["loss"] = {"type": "ppo-clip", "ratio_level": "sequence"}
    with pytest.raises(RecipeError) as caught:
        parse_recipe(recipe_document, builtin_registry)
    assert caught.value.problems == ['$.loss.ratio_level: removed; ratio_level = "sequence" is GSPO\'s one ratio per response: '
                                     'write surrogate = "gspo" instead (ratio_level = "token" was the default: drop it)']


def test_a_name_another_surrogate_holds_is_refused_naming_both_plugins():
    def impostor(log_ratio, advantages, mask, settings, clip):
        raise AssertionError("never called")

    clash = plugin_module("impostor", register_surrogates=lambda register: register("ppo", impostor, EmptyConfig))
    with pytest.raises(PluginError) as caught:
        load_registry(environ={"RLKIT_PLUGINS": "none"}, extra_plugins=[("impostor", clash, "rlkit-impostor", "0.1")])
    assert "duplicate surrogate 'ppo'" in str(caught.value)
    assert "plugin 'ppo-clip' (rlkit" in str(caught.value) and "plugin 'impostor' (rlkit-impostor 0.1)" in str(caught.value)


class NotAFunction:
    def __call__(self, log_ratio, advantages, mask, settings, clip):
        raise AssertionError("never called")


@pytest.mark.parametrize("function, reason", [
    (NotAFunction, "is not a function; register a function (log_ratio, advantages, mask, settings, clip) as rlkit_core.Surrogate says"),
    (lambda log_ratio, advantages, mask, settings: None, "must take (log_ratio, advantages, mask, settings, clip): too many positional"),
], ids=["class", "old-signature"])
def test_a_surrogate_that_breaks_the_signature_breaks_its_plugin(function, reason):
    module = plugin_module("odd", register_surrogates=lambda register: register("odd", function, EmptyConfig))
    registry = load_registry(environ={"RLKIT_PLUGINS": "none"}, extra_plugins=[("odd", module, "rlkit-odd", "0.1")])
    assert "plugin 'odd' registers surrogate 'odd', which breaks the plugin contract" in registry.broken["odd"]
    assert reason in registry.broken["odd"] and "odd" not in registry.names("surrogate")


def test_a_plugin_registers_its_own_surrogate_with_its_own_settings(recipe_document):
    """What an entry point does: import the plugin's module, whose hook registers the surrogate and its config class."""
    spec = importlib.util.spec_from_file_location("rlkit_surrogate_demo", DEMO)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    registry = load_registry(environ={"RLKIT_PLUGINS": "none"}, extra_plugins=[("demo", module, "rlkit-surrogate-demo", "0.1")])
    [listed] = [row for row in registry_rows(registry) if row["name"] == "demo-reinforce"]  # as `rlkit plugins` lists it
    assert (listed["kind"], listed["plugin"], [f["name"] for f in listed["fields"]]) == ("surrogate", "demo", ["scale"])
    loss = build_loss(recipe_document, registry, surrogate={"type": "demo-reinforce", "scale": 2.0})
    logprobs = (OLD + RATIO.log()).requires_grad_()
    terms = loss(example_batch(), LossInputs(logprobs=logprobs, values=None, entropy=torch.ones(2, 3)), token_count=5.0)
    # -2·A·log r per token: -2 ln 1.5, 2 ln 0.8, -4 ln 1.1, ln 2, 0, over the 5 counted tokens
    expected = 2 * (-math.log(1.5) + math.log(0.8) - 2 * math.log(1.1) + 0.5 * math.log(2.0)) / 5
    assert terms.losses["policy"].item() == approx(expected, abs=1e-6)
    terms.total().backward()
    assert logprobs.grad is not None
    assert logprobs.grad.flatten().tolist() == approx([-0.4, 0.4, -0.8, 0.2, -0.4, 0.0])  # -2·A / 5, unclipped


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
    (LossTerms(losses={"policy": torch.tensor(1.0)}, diagnostics={"entropy": torch.tensor(1.0)}),
     "diagnostics['entropy'] would be logged as train/entropy, which the loop logs itself"),
    (LossTerms(losses={"policy": torch.tensor(1.0)}, diagnostics={"approx_kl": torch.tensor(0.0)}),
     "diagnostics['approx_kl'] would be logged as train/approx_kl, which the loop logs itself"),
], ids=["loop-metric", "loop-loss", "loss-and-diagnostic", "skipped", "entropy", "approx-kl"])
def test_a_term_the_loop_cannot_log_under_its_name_is_refused(terms, named):
    with pytest.raises(RunError) as refused:
        StepTerms.share_of("mine", terms, torch.tensor(1.0))
    assert "loss 'mine' returns terms the loop cannot log" in str(refused.value) and named in str(refused.value)


def test_a_loss_that_returns_a_dict_is_told_to_return_loss_terms():
    with pytest.raises(RunError, match="loss 'old-style' returned a dict; a loss returns rlkit_core.LossTerms"):
        StepTerms.share_of("old-style", {"loss_policy": torch.tensor(1.0)}, torch.tensor(1.0))  # pyright: ignore[reportArgumentType]  # the mistake under test


def test_cispo_trains_a_step(recipe_document, builtin_registry):
    recipe_document["loss"] = {"type": "ppo-clip", "surrogate": {"type": "cispo", "eps_high_is": 0.28}}
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
    metrics = trainer.step()
    [logits] = LogitLoss.seen
    # a loss that logs neither still gets the loop's entropy and approx KL (ratio 1 in one epoch: 0)
    assert metrics["train/entropy"] > 0 and metrics["train/approx_kl"] == approx(0.0, abs=1e-6)
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
