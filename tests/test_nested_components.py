"""Component tables inside component tables: each nested table is checked against its own
registered config class, located (`$.reward.parts[1].weight`), and built through the context."""

import types

import attrs
import pytest
import torch

from rlkit_core import hookimpl
from rlkit_core.config import fields_help, nested_component, nested_components, setting
from rlkit_core.context import BuildContext
from rlkit_core.errors import RecipeError
from rlkit_core.interfaces import KLController, RewardSource
from rlkit_core.recipe.document import ComponentChoice, parse_recipe, structure_table
from rlkit_core.recipe.plugins import load_registry
from rlkit_core.records import Component


@attrs.frozen
class Share:
    weight: float = setting(1.0, help="multiplies the part's score")


@attrs.frozen
class MixConfig:
    parts: list[ComponentChoice] = nested_components("reward", extra=Share, help="rewards to mix")
    judge: ComponentChoice | None = nested_component("reward", default=None, help="a reward that may veto (score 0 below 0.5)")


class Mix(RewardSource):
    """Σ weight · part score, zeroed where the judge scores below 0.5."""

    def __init__(self, config: MixConfig, context):
        self.parts = [(part.extra.weight, context.build(part)) for part in config.parts]
        self.judge = context.build(config.judge) if config.judge else None

    def score(self, prompts, responses, **columns):
        totals = [0.0] * len(responses)
        for weight, reward in self.parts:
            totals = [t + weight * s for t, s in zip(totals, reward.score(prompts, responses, **columns))]
        if self.judge:
            totals = [t if j >= 0.5 else 0.0 for t, j in zip(totals, self.judge.score(prompts, responses, **columns))]
        return totals


@attrs.frozen
class StagesConfig:
    stages: list[ComponentChoice] = nested_components("kl_controller", help="KL controllers, one after another")


class NotAReward:
    def __init__(self, config, context):
        pass


def register_rewards(register):
    register("mix", Mix, MixConfig)


MIX_PLUGIN = types.ModuleType("mix_plugin")
MIX_PLUGIN.register_rewards = hookimpl(register_rewards)


@pytest.fixture(scope="module")
def mix_registry():
    registry = load_registry(environ={"RLKIT_PLUGINS": "none"}, extra_plugins=[("mix", MIX_PLUGIN, "rlkit-mix", "0.1")])
    # the registry refuses a class that is not a RewardSource when it registers; put in by hand, the
    # build still names it (the check of last resort, for components that reach it another way)
    registry._components["reward"]["not-a-reward"] = Component("reward", "not-a-reward", NotAReward, Share, "mix", "rlkit-mix", "0.1")
    return registry


@pytest.fixture
def mix_document(recipe_document, reward_file):
    lowercase = {"type": "python", "function": f"{reward_file}:lowercase_share"}
    recipe_document["reward"] = {"type": "mix", "parts": [{**lowercase, "weight": 2.0}, lowercase],
                                 "judge": lowercase}
    return recipe_document


def problems_of(document, registry):
    with pytest.raises(RecipeError) as caught:
        parse_recipe(document, registry)
    return caught.value.problems


def test_each_nested_table_is_structured_into_its_own_config_class(mix_document, mix_registry):
    config = parse_recipe(mix_document, mix_registry)["reward"].config
    first, second = config.parts
    assert (first.table, first.component.name, first.extra.weight) == ("reward.parts[0]", "python", 2.0)
    assert second.extra.weight == 1.0  # the extra class's default
    assert first.config.function.endswith(":lowercase_share")
    assert config.judge.table == "reward.judge" and config.judge.extra is None


def test_the_factory_builds_the_nested_components_through_the_context(mix_document, mix_registry):
    recipe = parse_recipe(mix_document, mix_registry)
    reward = BuildContext(recipe, torch.device("cpu"), "unused", 0).build(recipe["reward"])
    # lowercase share of 8 bytes: "abcd" 4/8 = 0.5 → (2 + 1) · 0.5 = 1.5; "AB" 0/8 → judge 0 < 0.5 → 0
    assert reward.score(["p", "p"], ["abcd", "AB"], letter=["e", "e"]) == [1.5, 0.0]


def test_problems_in_nested_tables_are_located_and_reported_together(mix_document, mix_registry):
    parts = mix_document["reward"]["parts"]
    parts[0]["weight"] = "heavy"
    parts[1]["fuction"] = parts[1].pop("function")
    parts.append({"type": "pyhton"})
    mix_document["reward"]["judge"] = {"type": "python", "function": 3}
    mix_document["kl"] = {"type": "adaptive", "target": -1.0}
    assert problems_of(mix_document, mix_registry) == [
        "$.reward.parts[0].weight: expected a number, got 'heavy' (str)",
        "$.reward.parts[1].function: required key is missing",
        "$.reward.parts[1].fuction: unknown key; did you mean 'function'?",
        f"$.reward.parts[2].type: unknown reward 'pyhton'; registered: {', '.join(mix_registry.names('reward'))}; did you mean 'python'?",
        "$.reward.judge.function: expected a string, got 3 (int)",
        "$.kl.target: must be > 0, got -1.0",
    ]


def test_nested_tables_must_be_tables_of_the_right_shape(mix_document, mix_registry):
    mix_document["reward"]["parts"] = {"type": "python"}
    mix_document["reward"]["judge"] = "python"
    assert problems_of(mix_document, mix_registry) == [
        "$.reward.parts: expected a list of reward tables ([[reward.parts]] in TOML), got {'type': 'python'}",
        "$.reward.judge: expected a table, got 'python'",
    ]


def test_a_nested_component_that_builds_the_wrong_kind_is_named(mix_document, mix_registry):
    mix_document["reward"]["judge"] = {"type": "not-a-reward"}
    recipe = parse_recipe(mix_document, mix_registry)
    with pytest.raises(RecipeError) as caught:
        BuildContext(recipe, torch.device("cpu"), "unused", 0).build(recipe["reward"])
    assert caught.value.problems == ["$.reward.judge.type: 'not-a-reward' from plugin 'mix' built a NotAReward, which is not a "
                                     "RewardSource; the plugin is broken"]


def test_a_nested_component_is_looked_up_among_its_own_kind(mix_registry):
    """Any kind nests: a KL controller's stages are KL controllers."""
    config, problems = structure_table({"stages": [{"type": "fixed", "beta": 0.1}, {"type": "python"}]}, StagesConfig, "$.kl", mix_registry)
    assert config is None
    assert [str(p) for p in problems] == [
        "$.kl.stages[1].type: unknown kl_controller 'python'; registered: adaptive, fixed",
    ]
    config, problems = structure_table({"stages": [{"type": "fixed", "beta": 0.1}]}, StagesConfig, "$.kl", mix_registry)
    assert not problems and isinstance(config.stages[0].component.factory(config.stages[0].config, None), KLController)


def test_plugins_listing_shows_nested_settings_and_their_extra_keys():
    rows = [(name, type_name, help_text) for name, type_name, _, _, help_text in fields_help(MixConfig)]
    assert rows == [
        ("parts", "[[reward]]", "rewards to mix"),
        ("parts[].weight", "float", "multiplies the part's score"),
        ("judge", "[reward]", "a reward that may veto (score 0 below 0.5)"),
    ]


def test_an_extra_key_that_is_also_the_nested_components_setting_is_refused(mix_registry):
    @attrs.frozen
    class Takes:
        function: str = setting("", help="clashes with the python reward's own setting")

    @attrs.frozen
    class ClashConfig:
        parts: list[ComponentChoice] = nested_components("reward", extra=Takes, help="rewards")

    _, problems = structure_table({"parts": [{"type": "python", "function": "m:f"}]}, ClashConfig, "$.reward", mix_registry)
    assert [str(p) for p in problems] == [
        "$.reward.parts[0]: reward 'python' has settings named function, which this table also reads for the component it "
        "sits in; the two cannot be told apart here",
    ]


def test_the_plan_and_the_run_inventory_name_every_nested_component(mix_document, mix_registry):
    from rlkit_core.recipe.inventory import inventory_rows

    rows = [(row["table"], row["type"], row["plugin"]) for row in inventory_rows(parse_recipe(mix_document, mix_registry))]
    assert rows[3:7] == [("reward", "mix", "mix"), ("reward.parts.0", "python", "rewards"),
                         ("reward.parts.1", "python", "rewards"), ("reward.judge", "python", "rewards")]


@pytest.fixture
def broken_parts(mix_document, tmp_path):
    """A python part whose file is not there, and a reward-model judge whose model folder is not there."""
    missing = tmp_path / "gone.py"
    mix_document["reward"]["parts"][1] = {"type": "python", "function": f"{missing}:score"}
    mix_document["reward"]["judge"] = {"type": "reward-model", "model": str(tmp_path / "no-model")}
    return mix_document, missing, tmp_path / "no-model"


def test_the_static_checks_run_on_nested_tables_and_name_their_place(broken_parts, mix_registry):
    from rlkit_core.recipe.plan import preflight

    document, missing, no_model = broken_parts
    problems, _ = preflight(parse_recipe(document, mix_registry))
    assert problems == [
        f"$.reward.parts[1].function: no file {str(missing)!r} (relative paths start at the working directory)",
        f"$.reward.judge.model: no directory {str(no_model)!r}; give a local model directory (relative paths start at the "
        "working directory) or a hub name",
    ]


def test_the_plan_lists_a_nested_parts_import_at_its_own_place(mix_document, mix_registry, reward_file):
    from rlkit_core.recipe.plan import code_it_runs

    lines = code_it_runs(parse_recipe(mix_document, mix_registry))
    assert (f"[reward.parts[1]] imports the file {str(reward_file.resolve())!r} for its function 'lowercase_share' "
            "($.reward.parts[1].function)") in lines
    assert lines[-1].endswith("($.reward.judge.function)")


def test_a_nested_part_that_fails_to_build_names_its_own_place(broken_parts, mix_registry):
    document, missing, _ = broken_parts
    recipe = parse_recipe(document, mix_registry)
    context = BuildContext(recipe, torch.device("cpu"), "unused", 0)
    with pytest.raises(RecipeError) as caught:
        context.build(recipe["reward"])
    assert caught.value.problems == [f"$.reward.parts[1].function: no file {str(missing)!r} (relative paths start at the "
                                     "working directory)"]
    assert context.where == ""  # restored, so the next component is not reported at the failed part's place


def test_a_nested_reward_model_that_fails_to_load_names_its_own_place(broken_parts, mix_registry, reward_file):
    document, _, no_model = broken_parts
    document["reward"]["parts"][1] = {"type": "python", "function": f"{reward_file}:lowercase_share"}
    recipe = parse_recipe(document, mix_registry)
    with pytest.raises(RecipeError) as caught:
        BuildContext(recipe, torch.device("cpu"), "unused", 0).build(recipe["reward"])
    assert caught.value.problems == [f"$.reward.judge.model: no directory {str(no_model)!r}; give a local model directory "
                                     "(relative paths start at the working directory) or a hub name"]


def test_a_prompt_source_check_locates_its_file_under_the_place_it_is_given(tmp_path):
    from rlkit_plugins.prompt_sources import JsonlConfig, JsonlPrompts

    missing = tmp_path / "gone.jsonl"
    assert JsonlPrompts.check(JsonlConfig(path=str(missing)), None, "$.mix.sources[0]") == (
        [f"$.mix.sources[0].path: no file {str(missing)!r} (relative paths start at the working directory)"], [])
