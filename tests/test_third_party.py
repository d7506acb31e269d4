"""Third-party plugins as a user meets them: pip-installed into this very environment (offline),
listed and used through the `rlkit` command, and uninstalled again even when a test fails.

Discovery and training run in a fresh interpreter, as a user's shell would; the other commands run
`rlkit_core.runtime.cli.main` in this process, which is the same code without the start-up time."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from rlkit_core.errors import RecipeError
from rlkit_core.recipe.plugins import load_registry
from rlkit_core.runtime.cli import main

pytestmark = pytest.mark.slow  # pip-installs into this environment and starts rlkit

EXAMPLE = Path(__file__).parents[1] / "examples" / "rlkit-example-plugins"


def demo_pyproject(distribution: str, entry_points: dict[str, str]) -> str:
    """A plugin package's pyproject.toml: one module per entry point, built without isolation."""
    points = "".join(f'{name} = "{module}"\n' for name, module in entry_points.items())
    modules = ", ".join(f'"{module}"' for module in entry_points.values())
    return (f'[build-system]\nrequires = ["setuptools>=70.1"]\nbuild-backend = "setuptools.build_meta"\n\n'
            f'[project]\nname = "{distribution}"\nversion = "0.0.1"\n\n[project.entry-points.rlkit]\n{points}\n'
            f'[tool.setuptools]\npy-modules = [{modules}]\n')


TYPO_MODULE = """\
from rlkit_core import hookimpl


@hookimpl
def register_reward(register):  # misspelled: the hook is register_rewards
    pass
"""
BROKEN_ERROR = "this plugin needs acme-sdk: pip install acme-sdk"


def pip(*args):
    result = subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, (f"pip {' '.join(args)} failed (installing needs setuptools>=70.1 in this environment, "
                                    f"since it builds without isolation):\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}")


def install(request, source: Path, distribution: str) -> None:
    """Install offline; the uninstall is registered first, so it runs whatever happens next."""
    request.addfinalizer(lambda: pip("uninstall", "--yes", distribution))
    pip("install", "--no-build-isolation", "--no-deps", "--no-index", str(source))


def install_module(request, root: Path, distribution: str, plugin: str, source: str) -> None:
    """A one-module plugin package named `distribution`, whose entry point `plugin` is `source`, installed."""
    package, module = root / distribution, distribution.replace("-", "_")
    package.mkdir()
    (package / "pyproject.toml").write_text(demo_pyproject(distribution, {plugin: module}))
    (package / f"{module}.py").write_text(source)
    install(request, package, distribution)


def rlkit(*args, plugins=None):
    """The real command; `plugins` sets RLKIT_PLUGINS, None leaves every installed plugin on."""
    env = {k: v for k, v in os.environ.items() if k != "RLKIT_PLUGINS"}
    if plugins is not None:
        env["RLKIT_PLUGINS"] = plugins
    return subprocess.run([sys.executable, "-m", "rlkit_core.runtime.cli", *args], capture_output=True, text=True, env=env, timeout=300)


def plugins_json(plugins=None, exit_code=0) -> dict:
    result = rlkit("plugins", "--json", plugins=plugins)
    assert result.returncode == exit_code, result.stderr
    return json.loads(result.stdout)


def component_names(listing, kind) -> set[str]:
    return {row["name"] for row in listing["components"] if row["kind"] == kind}


@pytest.fixture(scope="module")
def example(request, tmp_path_factory) -> Path:
    """The example package installed from a copy: pip builds in place, leaving build/ and *.egg-info behind."""
    source = tmp_path_factory.mktemp("example") / EXAMPLE.name
    shutil.copytree(EXAMPLE, source, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__", ".pytest_cache"))
    install(request, source, "rlkit-example-plugins")
    return source


@pytest.fixture
def example_recipe(example, recipe_document, write_recipe) -> str:
    """The conftest recipe with the KL controller and the reward taken from the example package."""
    lowercase_share = recipe_document["reward"]["function"]
    recipe_document["kl"] = {"type": "pid", "target": 1.0, "kp": 0.5}
    recipe_document["reward"] = {"type": "weighted-sum"}
    path = Path(write_recipe(recipe_document))
    path.write_text(path.read_text() + (
        f'\n[[reward.parts]]\ntype = "python"\nfunction = "{lowercase_share}"\nweight = 0.5\n'
        f'\n[[reward.parts]]\ntype = "python"\nfunction = "{example / "tests" / "toy_rewards.py"}:exclamations"\n'
    ))
    return str(path)


def test_plugins_lists_the_example_with_its_distribution_and_version(example):
    rows = {(row["kind"], row["name"]): row for row in plugins_json()["components"]}
    for key, plugin in [(("kl_controller", "pid"), "example-pid-kl"), (("reward", "weighted-sum"), "example-weighted-sum"),
                        (("environment", "unit-converter"), "example-unit-converter"),
                        (("prompt_source", "conversion-tasks"), "example-unit-converter")]:
        row = rows[key]
        assert (row["plugin"], row["distribution"], row["version"]) == (plugin, "rlkit-example-plugins", "0.1.0")
        assert row["fields"] and all(field["help"] for field in row["fields"])
    assert rows[("kl_controller", "adaptive")]["distribution"] == "rlkit"


def test_a_recipe_uses_both_by_name(example_recipe, recipe_document):
    run = rlkit("run", example_recipe, "--quiet")
    assert run.returncode == 0, run.stderr
    metrics = [json.loads(line) for line in Path(recipe_document["run"]["output_dir"], "metrics.jsonl").read_text().splitlines()]
    assert [m["iteration"] for m in metrics] == [1, 2]
    assert metrics[0]["kl/beta"] == 0.05 and metrics[1]["kl/beta"] < 0.05  # KL far below target 1: pid lowered β


def test_a_recipe_trains_on_the_examples_environment_without_a_reward(example, recipe_document, write_recipe, tmp_path):
    """Its tool environment and tasks by name, the environment's rewards alone training, through the real command. The
    tiny model is made to end its turns early (`ending_model`), so that episodes reach the environment's answer."""
    from tests.test_episodes import ending_model

    recipe_document["policy"]["model"] = str(ending_model(tmp_path / "ending-gpt2"))
    del recipe_document["reward"]
    recipe_document["run"]["steps"] = 1
    recipe_document["ppo"].update(batch_size=8, minibatch_size=4, epochs=1)
    recipe_document["environment"] = {"type": "unit-converter", "max_turns": 2}
    recipe_document["data"] = {"type": "conversion-tasks", "size": 16}
    run = rlkit("run", write_recipe(recipe_document), "--quiet")
    assert run.returncode == 0, run.stderr
    [metrics] = [json.loads(line) for line in Path(recipe_document["run"]["output_dir"], "metrics.jsonl").read_text().splitlines()]
    assert metrics["iteration"] == 1 and 1 <= metrics["env/turns"] <= 2
    statuses = sum(metrics[f"env/status_{status}"] for status in ("ok", "cut_off", "overflow", "timeout", "error"))
    assert statuses == pytest.approx(1.0) and metrics["env/status_error"] == 0.0 and metrics["env/status_ok"] > 0
    assert {"env/solved", "env/converted", "env/reward"} <= set(metrics), sorted(name for name in metrics if name.startswith("env/"))


def test_rlkit_check_names_where_each_component_comes_from(example_recipe, monkeypatch, capsys):
    monkeypatch.delenv("RLKIT_PLUGINS", raising=False)
    assert main(["check", example_recipe]) == 0
    plan = capsys.readouterr().out
    assert "[kl] pid            from example-pid-kl (rlkit-example-plugins 0.1.0)" in plan
    assert "[reward] weighted-sum   from example-weighted-sum (rlkit-example-plugins 0.1.0)" in plan


def test_rlkit_check_checks_the_parts_nested_in_a_third_party_reward(example, example_recipe, monkeypatch, capsys):
    monkeypatch.delenv("RLKIT_PLUGINS", raising=False)
    toy = example / "tests" / "toy_rewards.py"
    assert main(["check", example_recipe]) == 0
    plan = capsys.readouterr().out
    assert f"[reward.parts[1]] imports the file {str(toy.resolve())!r} for its function 'exclamations' ($.reward.parts[1].function)" in plan
    missing = example / "tests" / "gone.py"
    Path(example_recipe).write_text(Path(example_recipe).read_text().replace(str(toy), str(missing)))
    assert main(["check", example_recipe]) == 2
    assert (f"$.reward.parts[1].function: no file {str(missing)!r} (relative paths start at the working directory)"
            in capsys.readouterr().err)


def test_rlkit_plugins_none_hides_the_example(example_recipe, monkeypatch, capsys):
    monkeypatch.setenv("RLKIT_PLUGINS", "none")
    assert main(["check", example_recipe]) == 2
    problems = capsys.readouterr().err
    assert "$.kl.type: unknown kl_controller 'pid'; registered: adaptive, fixed" in problems
    assert ("$.reward.type: unknown reward 'weighted-sum'; registered: exact-summary, fact-copied, http, openai-judge, python, "
            "reasoning-gym, reward-model, rouge") in problems
    assert ("installed but filtered out by RLKIT_PLUGINS: example-pid-kl (rlkit-example-plugins 0.1.0), example-unit-converter "
            "(rlkit-example-plugins 0.1.0), example-weighted-sum (rlkit-example-plugins 0.1.0); if 'weighted-sum' comes from one "
            "of them, add its name to RLKIT_PLUGINS") in problems


def test_rlkit_plugins_selects_plugins_by_name(example):
    registry = load_registry(environ={"RLKIT_PLUGINS": "example-pid-kl"})
    assert "pid" in registry.names("kl_controller")
    assert "weighted-sum" not in registry.names("reward")


def test_a_plugin_that_fails_to_import_is_named_and_the_rest_still_work(request, tmp_path):
    source = tmp_path / "rlkit-broken-demo"
    source.mkdir()
    (source / "pyproject.toml").write_text(demo_pyproject("rlkit-broken-demo", {"broken-demo": "rlkit_broken_demo", "typo-demo": "rlkit_typo_demo"}))
    (source / "rlkit_broken_demo.py").write_text(f"raise ImportError({BROKEN_ERROR!r})\n")
    (source / "rlkit_typo_demo.py").write_text(TYPO_MODULE)
    install(request, source, "rlkit-broken-demo")

    listing = plugins_json(exit_code=1)
    assert listing["broken"]["broken-demo"] == f"import failed: ImportError: {BROKEN_ERROR}"
    assert listing["broken"]["typo-demo"] == "hook 'register_reward' is not an rlkit hook; did you mean 'register_rewards'?"
    assert {"adaptive", "fixed"} <= component_names(listing, "kl_controller")
    text = rlkit("plugins")  # the broken plugins head the listing, and the command fails
    assert text.returncode == 1
    head = text.stdout.splitlines()[:4]
    assert head[0] == "BROKEN PLUGINS: 2 installed plugin(s) failed to load; their components are missing below"
    assert head[1:3] == [f"  broken-demo: import failed: ImportError: {BROKEN_ERROR}",
                         "  typo-demo: hook 'register_reward' is not an rlkit hook; did you mean 'register_rewards'?"]
    assert head[3].startswith("  fix or uninstall it, or leave it out: RLKIT_PLUGINS=")
    assert "2 broken plugin(s): broken-demo, typo-demo" in text.stderr
    left_out = rlkit("plugins", plugins="none")  # leaving them out: not imported, so nothing is broken
    assert left_out.returncode == 0
    assert "filtered out by RLKIT_PLUGINS='none' (not imported): broken-demo (rlkit-broken-demo 0.0.1)" in left_out.stdout
    with pytest.raises(RecipeError) as caught:  # what a recipe that needs a missing reward is told
        load_registry(environ={}).get("reward", "acme", "$.reward.type")
    assert f"plugins that failed to load: broken-demo (import failed: ImportError: {BROKEN_ERROR})" in str(caught.value)


DATACLASS_MODULE = """\
import dataclasses

from rlkit_core import hookimpl


@dataclasses.dataclass(frozen=True)
class ShoutConfig:
    volume: float = 1.0


@hookimpl
def register_rewards(register):
    register("shout", object, ShoutConfig)
"""


def test_a_plugin_with_a_dataclass_config_is_listed_broken_and_recipes_without_it_run(request, tmp_path, recipe_document, write_recipe):
    install_module(request, tmp_path, "rlkit-dataclass-demo", "dataclass-demo", DATACLASS_MODULE)

    listing = plugins_json(exit_code=1)
    assert "not an attrs class" in listing["broken"]["dataclass-demo"]
    assert "shout" not in component_names(listing, "reward") and "python" in component_names(listing, "reward")
    checked = rlkit("check", write_recipe(recipe_document))  # a recipe that uses none of it is not affected
    assert checked.returncode == 0, checked.stderr


def test_the_example_packages_own_tests_pass(example):
    env = {k: v for k, v in os.environ.items() if k != "RLKIT_PLUGINS"}
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"], cwd=example, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-4000:]


BASES_DEMO = Path(__file__).parent / "data" / "rlkit_bases_demo.py"


@pytest.fixture(scope="module")
def bases_demo(request, tmp_path_factory):
    """A plugin package whose policy and generator configs inherit the settings bases, and a group estimator."""
    install_module(request, tmp_path_factory.mktemp("bases"), "rlkit-bases-demo", "bases-demo", BASES_DEMO.read_text())


def with_demo_parts(document: dict, response_tokens: int) -> dict:
    """The same recipe through the demo plugin's policy and generator, with the same settings."""
    policy, generator = document["policy"], document["generator"]
    document["policy"] = {"type": "demo-lm", "model": policy["model"], "gradient_checkpointing": policy.get("gradient_checkpointing", False)}
    document["generator"] = {"type": "demo-sampler", "max_new_tokens": response_tokens, "batch_size": generator.get("batch_size", 0)}
    return document


def plan_sections(plan: str) -> str:
    """The plan's model size and memory estimate, which read the policy's and generator's settings."""
    return plan[plan.index("\nmodel:"):plan.index("\ncode this recipe runs")]


def test_a_plugin_on_the_settings_bases_gets_the_same_size_and_memory_estimate(bases_demo, recipe_document, write_recipe,
                                                                                monkeypatch, capsys):
    monkeypatch.delenv("RLKIT_PLUGINS", raising=False)
    recipe_document["policy"]["gradient_checkpointing"] = True
    recipe_document["generator"] = {"max_new_tokens": 24, "batch_size": 4}
    assert main(["check", write_recipe(recipe_document, "builtin.toml")]) == 0
    builtin = plan_sections(capsys.readouterr().out)
    assert main(["check", write_recipe(with_demo_parts(recipe_document, 24), "demo.toml")]) == 0
    plan = capsys.readouterr().out
    assert "[policy] demo-lm" in plan and "[generator] demo-sampler" in plan
    assert plan_sections(plan) == builtin and "memory" in builtin


def test_a_plugin_on_the_settings_bases_gets_every_check(bases_demo, recipe_document, write_recipe, monkeypatch, capsys):
    monkeypatch.delenv("RLKIT_PLUGINS", raising=False)
    document = with_demo_parts(recipe_document, 8)
    document["policy"].update(dtype="bfloat16", trust_remote_code=True)
    document["ppo"].update(overlong_buffer=16)
    document["run"].update(mixed_precision="fp16")
    document["advantage"] = {"type": "demo-centred"}
    assert main(["check", write_recipe(document)]) == 2
    problems = capsys.readouterr().err
    assert "$.ppo.overlong_buffer: 16 tokens is longer than generator.max_new_tokens = 8; use at most 8" in problems
    assert ("$.run.mixed_precision: 'fp16' keeps float32 master weights and scales the loss, but policy.dtype = 'bfloat16'; "
            "set policy.dtype = 'float32'") in problems
    assert "$.ppo.samples_per_prompt: advantage estimator 'demo-centred' compares the responses to each prompt" in problems
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "2")
    document["run"].update(mixed_precision="no")
    document["ppo"].update(overlong_buffer=0, samples_per_prompt=2)
    assert main(["check", write_recipe(document)]) == 2
    assert "$.policy.dtype: 'bfloat16' weights are not run under FSDP (untested); keep policy.dtype = 'float32'" in capsys.readouterr().err
    monkeypatch.delenv("ACCELERATE_USE_FSDP")
    assert main(["check", write_recipe(document)]) == 0
    plan = capsys.readouterr().out
    assert f"$.policy.trust_remote_code = true: {document['policy']['model']!r} may run Python code" in plan


def test_a_plugins_response_limit_is_checked_against_the_context_and_is_dr_grpos_norm(bases_demo, recipe_document, write_recipe,
                                                                                       monkeypatch, capsys):
    import torch

    from rlkit_core.context import BuildContext
    from rlkit_core.recipe.document import parse_recipe

    monkeypatch.delenv("RLKIT_PLUGINS", raising=False)
    document = with_demo_parts(recipe_document, 128)  # the tiny model's whole context
    assert main(["run", write_recipe(document), "--quiet"]) == 2
    assert "$.generator.max_new_tokens: 128 leaves no room for a prompt in the policy's context of 128 positions; lower it" in capsys.readouterr().err
    document["generator"]["max_new_tokens"] = 12
    document["loss"] = {"type": "ppo-clip", "aggregation": "seq-mean-token-sum-norm"}
    recipe = parse_recipe(document, load_registry())
    assert BuildContext(recipe, torch.device("cpu"), "unused", 0).build(recipe["loss"]).norm == 12


BROKEN_CONTRACT_MODULE = """\
import attrs

from rlkit_core import AdvantageEstimator, RewardSource, hookimpl
from rlkit_plugins.critic_free import GRPO, GRPOConfig


def group_estimator(config, context):
    return GRPO(config, context)


class Loud(RewardSource):
    def check(self, config, recipe, where):
        return [], []

    def score(self, prompts, responses, **columns):
        return [1.0] * len(responses)


@attrs.frozen
class LoudConfig:
    pass


@hookimpl
def register_advantage_estimators(register):
    register("fn-grpo", group_estimator, GRPOConfig)


@hookimpl
def register_rewards(register):
    register("loud", Loud, LoudConfig)
"""


def test_a_plugin_that_breaks_the_contract_is_listed_broken_and_the_rest_works(request, tmp_path):
    install_module(request, tmp_path, "rlkit-contract-demo", "contract-demo", BROKEN_CONTRACT_MODULE)

    listing = plugins_json(exit_code=1)
    why = listing["broken"]["contract-demo"]
    assert "advantage_estimator 'fn-grpo', which breaks the plugin contract: its factory <function group_estimator" in why
    assert "reward 'loud', which breaks the plugin contract: Loud.check must be a @staticmethod check(config, recipe, where)" in why
    assert "fn-grpo" not in component_names(listing, "advantage_estimator") and "grpo" in component_names(listing, "advantage_estimator")
    assert "loud" not in component_names(listing, "reward") and "python" in component_names(listing, "reward")
    env = {k: v for k, v in os.environ.items() if k != "RLKIT_PLUGINS"}
    checked = subprocess.run([sys.executable, "-m", "rlkit_core.runtime.cli", "check", str(Path(__file__).parents[1] / "recipes" / "ppo_summarize.toml")],
                             capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert checked.returncode == 0, checked.stderr
