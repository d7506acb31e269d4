"""Plugin discovery and the registry's rules: duplicates are loud, misspelled hooks and broken
plugins are named, the rest keep working."""

import types

import attrs
import pytest

from rlkit_core import hookimpl
from rlkit_core.errors import PluginError, RecipeError
from rlkit_core.recipe.plugins import load_registry
from rlkit_core.recipe.registry import Registry
from rlkit_core.records import Component

KINDS_WITH_BUILTINS = ["policy", "value_head", "reward", "kl_controller", "advantage_estimator", "loss", "generator", "prompt_source", "tracker",
                       "surrogate", "tool_call_format"]


@attrs.frozen
class EmptyConfig:
    pass


def plugin_module(name, **hooks):
    module = types.ModuleType(name)
    for hook_name, function in hooks.items():
        setattr(module, hook_name, hookimpl(function))
    return module


def test_every_kind_has_a_builtin(builtin_registry):
    for kind in KINDS_WITH_BUILTINS:
        assert builtin_registry.names(kind), kind
    assert builtin_registry.get("kl_controller", "adaptive", "$.kl.type").distribution == "rlkit"
    assert builtin_registry.broken == {}


def test_duplicate_name_names_both_plugins():
    def register_kl_controllers(register):
        register("adaptive", object, EmptyConfig)

    clash = plugin_module("clash", register_kl_controllers=register_kl_controllers)
    with pytest.raises(PluginError) as caught:
        load_registry(environ={"RLKIT_PLUGINS": "none"}, extra_plugins=[("acme-kl", clash, "rlkit-acme", "1.2")])
    message = str(caught.value)
    assert "duplicate kl_controller 'adaptive'" in message
    assert "plugin 'kl' (rlkit" in message and "plugin 'acme-kl' (rlkit-acme 1.2)" in message


def test_misspelled_hook_marks_the_plugin_broken_with_a_suggestion():
    def register_reward(register):
        register("mine", object, EmptyConfig)

    typo = plugin_module("typo", register_reward=register_reward)
    registry = load_registry(environ={"RLKIT_PLUGINS": "none"}, extra_plugins=[("typo", typo, "rlkit-typo", "0.1")])
    assert registry.broken["typo"] == "hook 'register_reward' is not an rlkit hook; did you mean 'register_rewards'?"
    assert "mine" not in registry.names("reward")
    assert "python" in registry.names("reward")  # the others still load


def test_plugin_that_raises_while_registering_is_named_and_others_load():
    def register_rewards(register):
        raise RuntimeError("reward service unreachable")

    bad = plugin_module("bad", register_rewards=register_rewards)
    registry = load_registry(environ={"RLKIT_PLUGINS": "none"}, extra_plugins=[("bad", bad, "rlkit-bad", "0.1")])
    assert registry.broken["bad"] == "register_rewards failed: RuntimeError: reward service unreachable"
    with pytest.raises(RecipeError) as caught:
        registry.get("reward", "acme", "$.reward.type")
    assert "plugins that failed to load: bad (register_rewards failed" in str(caught.value)


def test_unknown_component_lists_names_and_closest():
    registry = load_registry(environ={"RLKIT_PLUGINS": "none"})
    with pytest.raises(RecipeError) as caught:
        registry.get("kl_controller", "adaptiv", "$.kl.type")
    assert caught.value.problems == ["$.kl.type: unknown kl_controller 'adaptiv'; registered: adaptive, fixed; did you mean 'adaptive'?"]


def test_config_class_must_be_attrs():
    registry = Registry()
    with pytest.raises(PluginError, match="not an attrs class"):
        registry.add(Component("reward", "x", object, dict, "p", "d", "1"))


def test_two_plugins_with_one_name_is_a_loud_error():
    def register_rewards(register):
        register("acme", object, EmptyConfig)

    same_name = plugin_module("other", register_rewards=register_rewards)
    with pytest.raises(PluginError, match="two plugins are named 'kl': one from rlkit .*, one from rlkit-acme 2.0"):
        load_registry(environ={"RLKIT_PLUGINS": "none"}, extra_plugins=[("kl", same_name, "rlkit-acme", "2.0")])


def test_pluggy_refuses_a_hook_with_arguments_the_hookspec_does_not_have():
    def register_rewards(reg):
        reg("mine", object, EmptyConfig)

    wrong = plugin_module("wrong", register_rewards=register_rewards)
    registry = load_registry(environ={"RLKIT_PLUGINS": "none"}, extra_plugins=[("wrong", wrong, "rlkit-wrong", "0.1")])
    assert "register_rewards(reg)" in registry.broken["wrong"] and "{'reg'}" in registry.broken["wrong"]
    assert "mine" not in registry.names("reward") and "python" in registry.names("reward")


def test_a_plugin_that_raises_in_one_hook_is_not_called_again():
    calls = []

    def register_rewards(register):
        calls.append("rewards")
        raise RuntimeError("down")

    def register_trackers(register):
        calls.append("trackers")

    flaky = plugin_module("flaky", register_rewards=register_rewards, register_trackers=register_trackers)
    registry = load_registry(environ={"RLKIT_PLUGINS": "none"}, extra_plugins=[("flaky", flaky, "rlkit-flaky", "0.1")])
    assert calls == ["rewards"] and registry.broken["flaky"] == "register_rewards failed: RuntimeError: down"


def test_a_plugin_whose_config_is_not_attrs_is_broken_and_the_rest_load():
    import dataclasses

    @dataclasses.dataclass(frozen=True)
    class DataclassConfig:
        scale: float = 1.0

    def register_rewards(register):
        register("acme-ok", object, EmptyConfig)  # registered first, withdrawn with the plugin
        register("acme-dc", object, DataclassConfig)

    careless = plugin_module("careless", register_rewards=register_rewards)
    registry = load_registry(environ={"RLKIT_PLUGINS": "none"}, extra_plugins=[("careless", careless, "rlkit-careless", "0.1")])
    assert "not an attrs class" in registry.broken["careless"] and "'acme-dc'" in registry.broken["careless"]
    assert "acme-ok" not in registry.names("reward") and "acme-dc" not in registry.names("reward")
    assert "python" in registry.names("reward")  # the others still load


def test_a_component_whose_package_is_missing_is_listed_with_what_to_install(builtin_registry):
    import importlib.util

    from rlkit_core.recipe.inventory import missing_requirements, registry_rows

    class NeedsTwo:
        requires = {"json": "never said: installed", "rlkit_no_such_module": "rlkit[nothing]"}

    assert missing_requirements(NeedsTwo) == ["rlkit[nothing]"] and missing_requirements(object) == []
    rows = {(row["kind"], row["name"]): row for row in registry_rows(builtin_registry)}
    for kind, name, module, extra in [("environment", "verifiers", "verifiers", "rlkit[verifiers]"), ("environment", "openenv", "openenv", "rlkit[openenv]"),
                                      ("environment", "skyrl-gym", "skyrl_gym", "rlkit[skyrl-gym]"),
                                      ("prompt_source", "reasoning-gym", "reasoning_gym", "rlkit[reasoning-gym]")]:
        assert rows[(kind, name)]["needs"] == ([] if importlib.util.find_spec(module) else [extra]), name
    assert rows[("kl_controller", "adaptive")]["needs"] == []
