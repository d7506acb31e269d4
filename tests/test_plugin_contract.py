"""The declared plugin contract: one table of kinds, hooks declared on the interfaces and read from
the class, components checked when they register, settings read through the core's bases."""

import inspect
from typing import ClassVar

import attrs
import pytest
from rlkit_plugins.critic_free import GRPO
from test_plugins import EmptyConfig, plugin_module

from rlkit_core import hookspecs
from rlkit_core.config import greater_than, setting
from rlkit_core.errors import RecipeError
from rlkit_core.interfaces import FUNCTION_KINDS, KIND_TABLE, NESTED_KINDS, AdvantageEstimator, Generator, Loss, LossTerms, RewardSource, class_flags
from rlkit_core.launch import Launch
from rlkit_core.recipe.assemble import Components
from rlkit_core.recipe.document import parse_recipe
from rlkit_core.recipe.plugins import HOOKS, load_registry
from rlkit_core.recipe.schema import COMPONENT_TABLES
from rlkit_core.settings import SamplingSettings


def loaded(name, **hooks):
    """A registry with only the built-ins and one plugin module holding `hooks`."""
    return load_registry(environ={"RLKIT_PLUGINS": "none"}, extra_plugins=[(name, plugin_module(name, **hooks), f"rlkit-{name}", "0.1")])


def test_the_hookspecs_are_the_table_of_kinds():
    """hookspecs.py is written out for readers and pluggy; it must say what the tables say."""
    specs = {name: function for name, function in vars(hookspecs).items() if getattr(function, "rlkit_spec", None)}
    kinds = (*KIND_TABLE, *FUNCTION_KINDS, *NESTED_KINDS)
    assert list(specs) == sorted(specs, key=[kind.hook for kind in kinds].index)  # in the tables' order
    assert set(specs) == {kind.hook for kind in kinds}
    for kind in kinds:
        assert list(inspect.signature(specs[kind.hook]).parameters) == ["register"]
        assert f"`rlkit_core.interfaces.{kind.interface.__name__}`" in specs[kind.hook].__doc__, kind.hook


def test_hooks_tables_defaults_and_components_come_from_the_table():
    assert HOOKS == {kind.hook: kind.name for kind in (*KIND_TABLE, *FUNCTION_KINDS, *NESTED_KINDS)}
    assert COMPONENT_TABLES == {kind.table: (kind.name, kind.default) for kind in KIND_TABLE}
    fields = attrs.fields(Components)
    assert [f.name for f in fields] == [kind.table for kind in KIND_TABLE]
    assert fields.kl.type is KIND_TABLE[4].interface and fields.value_head.type == KIND_TABLE[1].interface | None


def test_components_written_out_are_the_table_of_kinds():
    """`Components` is written out for type checkers; each field is its kind's interface, an
    optional kind's None too (no critic, no environment, no reward beside an environment), in the
    table's order."""
    fields = attrs.fields(Components)
    assert [(f.name, f.type) for f in fields] == [
        (kind.table, kind.interface | None if kind.optional else kind.interface) for kind in KIND_TABLE]


def group_estimator(config, context):
    return GRPO(config, context)


group_estimator.needs_groups = True  # a function carrying the flag: read before the build, lost after it


def test_a_function_factory_breaks_its_plugin_and_a_group_recipe_is_refused(recipe_document):
    """The defect: a function-built group estimator passed the samples_per_prompt check
    (its flag was read from the function) and trained on zero advantages (read from the instance)."""
    from rlkit_plugins.critic_free import GRPOConfig

    registry = loaded("fn-grpo", register_advantage_estimators=lambda register: register("fn-grpo", group_estimator, GRPOConfig))
    assert registry.broken["fn-grpo"] == (
        f"plugin 'fn-grpo' registers advantage_estimator 'fn-grpo', which breaks the plugin contract: its factory "
        f"{group_estimator!r} is not a class deriving from rlkit_core.AdvantageEstimator; register a subclass of "
        "AdvantageEstimator whose __init__ takes (config, context)")
    assert "fn-grpo" not in registry.names("advantage_estimator") and "grpo" in registry.names("advantage_estimator")
    recipe_document["advantage"] = {"type": "fn-grpo"}
    with pytest.raises(RecipeError, match=r"\$.advantage.type: unknown advantage_estimator 'fn-grpo'.*plugins that failed to load: fn-grpo"):
        parse_recipe(recipe_document, registry)


class Shared(AdvantageEstimator):
    """A group estimator whose instances say otherwise: rlkit reads the class, before and after the build."""

    needs_values = False
    needs_groups = True

    def __init__(self, config, context=None):
        self.needs_groups = False

    def estimate(self, batch):
        raise NotImplementedError


def test_a_group_estimator_class_gets_the_samples_per_prompt_check(recipe_document):
    registry = loaded("shared", register_advantage_estimators=lambda register: register("shared", Shared, EmptyConfig))
    assert registry.broken == {}
    recipe_document["advantage"] = {"type": "shared"}
    with pytest.raises(RecipeError) as caught:
        parse_recipe(recipe_document, registry)
    assert caught.value.problems == ["$.ppo.samples_per_prompt: advantage estimator 'shared' compares the responses to each "
                                     "prompt, so it needs at least 2, got 1; 4 to 16 are usual"]


class Careless(RewardSource):
    def check(self, config, recipe):  # not static, and without `where`
        return [], []

    @staticmethod
    def imports(config):  # without `where`
        return []

    def score(self, prompts, responses, **columns):
        return [0.0] * len(responses)


class Flagged(AdvantageEstimator):
    needs_groups = "yes"

    def estimate(self, batch):
        raise NotImplementedError


def test_hooks_with_other_parameters_and_flags_that_are_not_booleans_break_the_plugin():
    def register_rewards(register):
        register("careless", Careless, EmptyConfig)

    def register_advantage_estimators(register):
        register("flagged", Flagged, EmptyConfig)

    registry = loaded("careless", register_rewards=register_rewards, register_advantage_estimators=register_advantage_estimators)
    why = registry.broken["careless"]  # every breach named, from each of its hooks
    assert "Careless.check must be a @staticmethod check(config, recipe, where)" in why
    assert "Careless.imports must take (config, where): too many positional arguments" in why
    assert "Flagged.needs_groups must be True or False, got 'yes'" in why
    assert "careless" not in registry.names("reward") and "flagged" not in registry.names("advantage_estimator")
    assert "python" in registry.names("reward")  # the others still load


class Classy(RewardSource):
    """Hooks as class methods, the idiom for hooks read from the class."""

    checked: ClassVar[list] = []

    @classmethod
    def check(cls, config, recipe, where):
        cls.checked.append(where)
        return [], [f"{where}: checked by {cls.__name__}"]

    def score(self, prompts, responses, **columns):
        return [0.0] * len(responses)


def test_hooks_may_be_class_methods(recipe_document):
    from rlkit_core.interfaces import declares
    from rlkit_core.recipe.plan import preflight

    registry = loaded("classy", register_rewards=lambda register: register("classy", Classy, EmptyConfig))
    assert "classy" not in registry.broken and declares(Classy, "check") and not declares(Classy, "probe")
    recipe_document["reward"] = {"type": "classy"}
    problems, notes = preflight(parse_recipe(recipe_document, registry))
    assert problems == [] and "$.reward: checked by Classy" in notes and Classy.checked == ["$.reward"]


def test_the_flags_the_registry_checks_are_the_interfaces_declared_booleans():
    flags = {kind.name: class_flags(kind.interface) for kind in KIND_TABLE}
    assert flags["advantage_estimator"] == ("needs_values", "needs_groups", "needs_baseline_scores")
    assert flags["loss"] == ("needs_entropy_grad", "needs_logits", "takes_kl_penalty") and flags["generator"] == ("runs_under_fsdp", "runs_own_precision")
    assert flags["policy"] == flags["value_head"] == ("packs_sequences",) and flags["reward"] == ()


@attrs.frozen
class PlainSamplerConfig:
    max_tokens: int = setting(16, help="longest response", validator=greater_than(0))


@attrs.frozen
class InheritingSamplerConfig(SamplingSettings):
    heat: float = setting(1.0, help="sampling temperature", validator=greater_than(0))


class Sampler(Generator):
    temperature = 1.0

    def __init__(self, config, context):
        pass

    def generate(self, prompt_ids, prompt_mask, greedy=False):
        raise NotImplementedError


def test_a_generator_config_must_inherit_the_settings_rlkit_reads():
    why = loaded("samplers", register_generators=lambda register: register("plain", Sampler, PlainSamplerConfig)).broken["samplers"]
    assert ("registers generator 'plain', which breaks the plugin contract: config class PlainSamplerConfig does not inherit "
            "rlkit_core.SamplingSettings, which declares the generator settings rlkit reads; inherit it") in why
    registry = loaded("samplers", register_generators=lambda register: register("inheriting", Sampler, InheritingSamplerConfig))
    assert registry.find("generator", "inheriting") is not None
    config = InheritingSamplerConfig(max_new_tokens=16)
    assert (config.max_new_tokens, config.batch_size, config.heat) == (16, 0, 1.0)  # the base's fields, a default kept


class MeanLogprobLoss(Loss):
    """A loss that does not take the KL penalty: it never adds β·KL itself."""

    def __init__(self, config, context):
        pass

    def __call__(self, minibatch, current, token_count):
        return LossTerms(losses={"policy": -(current.logprobs * minibatch.loss_mask).sum() / token_count})


def test_kl_in_the_loss_needs_a_loss_that_takes_it(recipe_document):
    registry = loaded("plain-loss", register_losses=lambda register: register("plain", MeanLogprobLoss, EmptyConfig))
    recipe_document["loss"] = {"type": "plain"}
    recipe_document["ppo"]["kl_penalty"] = "loss"
    recipe_document["ppo"]["kl_estimator"] = "k3"
    with pytest.raises(RecipeError) as refused:
        parse_recipe(recipe_document, registry)
    assert [p.split(":")[0] for p in refused.value.problems] == ["$.ppo.kl_penalty"]
    assert "loss 'plain' does not take the KL penalty" in str(refused.value)
    recipe_document["ppo"]["kl_penalty"] = "reward"  # the penalty in the reward: any loss will do
    assert parse_recipe(recipe_document, registry)["loss"].component.factory is MeanLogprobLoss
    recipe_document["loss"] = {"type": "ppo-clip"}
    recipe_document["ppo"]["kl_penalty"] = "loss"
    assert parse_recipe(recipe_document, registry)["loss"].component.factory.takes_kl_penalty


def test_packing_needs_a_policy_and_critic_that_declare_it(recipe_document):
    from rlkit_plugins.hf_policy import HFPolicy, HFPolicyConfig

    class UnpackedPolicy(HFPolicy):  # its own model code, say, that builds no mask from position ids
        packs_sequences = False

    registry = loaded("unpacked", register_policies=lambda register: register("unpacked", UnpackedPolicy, HFPolicyConfig))
    recipe_document["ppo"]["pack_sequences"] = True
    assert parse_recipe(recipe_document, registry)["policy"].component.factory.packs_sequences  # the built-in declares it
    recipe_document["policy"]["type"] = "unpacked"
    with pytest.raises(RecipeError) as refused:
        parse_recipe(recipe_document, registry)
    assert [p.split(":")[0] for p in refused.value.problems] == ["$.ppo.pack_sequences"]
    assert "policy 'unpacked' does not declare packs_sequences" in str(refused.value) and "set pack_sequences = false" in str(refused.value)
    recipe_document["ppo"]["pack_sequences"] = False
    assert parse_recipe(recipe_document, registry)["policy"].component.factory is UnpackedPolicy


@attrs.frozen
class TokensSamplerConfig(SamplingSettings):
    max_new_tokens: int = setting(8, help="longest response", validator=greater_than(0))


class EngineSampler(Sampler):
    runs_under_fsdp = True  # samples with the policy module itself


def test_fsdp_runs_a_generator_that_says_it_samples_inside_the_engine(recipe_document):
    def register_generators(register):
        register("outside", Sampler, TokensSamplerConfig)
        register("inside", EngineSampler, TokensSamplerConfig)

    registry = loaded("samplers", register_generators=register_generators)
    fsdp = Launch(processes=2, sharded=True, fsdp_version=2)
    recipe_document["generator"] = {"type": "inside"}
    assert parse_recipe(recipe_document, registry, launch=fsdp)["generator"].component.factory is EngineSampler
    recipe_document["generator"] = {"type": "outside"}
    with pytest.raises(RecipeError, match=r"\$\.generator\.type: 'outside' is not run under FSDP"):
        parse_recipe(recipe_document, registry, launch=fsdp)


def test_part_is_the_earlier_name_of_component_base():
    from rlkit_core import ComponentBase

    with pytest.warns(DeprecationWarning, match="now ComponentBase"):
        from rlkit_core import Part
    assert Part is ComponentBase
