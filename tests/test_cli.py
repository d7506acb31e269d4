"""The `rlkit` command as a user meets it: a real subprocess, real exit codes, no tracebacks for bad input."""

import json
import os
import subprocess
import sys

import pytest

from rlkit_core.recipe.plugins import HOOKS

pytestmark = pytest.mark.slow  # every test starts the rlkit command


def rlkit(*args, cwd=None):
    env = {**os.environ, "RLKIT_PLUGINS": "none"}
    return subprocess.run([sys.executable, "-m", "rlkit_core.runtime.cli", *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=300)


def test_plugins_json_lists_a_builtin_of_every_kind():
    result = rlkit("plugins", "--json")
    assert result.returncode == 0, result.stderr
    listing = json.loads(result.stdout)
    kinds = {row["kind"] for row in listing["components"]}
    assert kinds == set(HOOKS.values())
    adaptive = next(r for r in listing["components"] if r["kind"] == "kl_controller" and r["name"] == "adaptive")
    assert adaptive["distribution"] == "rlkit"
    target = next(f for f in adaptive["fields"] if f["name"] == "target")
    assert target["default"] == 6.0 and "target KL" in target["help"]


def test_plugins_text_shows_fields_with_help():
    result = rlkit("plugins")
    assert result.returncode == 0
    assert "adaptive" in result.stdout and "horizon" in result.stdout and "initial KL coefficient" in result.stdout


def test_plugins_lists_the_core_tables_with_their_help():
    listing = json.loads(rlkit("plugins", "--json").stdout)
    tables = {table["table"]: {f["name"]: f for f in table["fields"]} for table in listing["core"]}
    assert list(tables) == ["run", "ppo", "optim", "eval", "health", "scheduler"]
    assert "one-step-off" in tables["scheduler"]["type"]["help"] and tables["scheduler"]["max_staleness"]["default"] == 0
    assert all(field["help"] for table in tables.values() for field in table.values())
    assert "exit 3" in tables["health"]["stop_on"]["help"]
    assert tables["run"]["steps"]["required"] and "PPO iterations" in tables["run"]["steps"]["help"]
    assert tables["ppo"]["batch_size"]["default"] == 64
    assert "get_scheduler" in tables["optim"]["schedule"]["help"]
    text = rlkit("plugins").stdout
    assert "  [optim]\n      learning_rate" in text and "AdamW learning rate of the policy" in text


def test_check_valid_recipe_prints_the_plan(recipe_document, write_recipe):
    result = rlkit("check", write_recipe(recipe_document), "--set", "run.steps=5")
    assert result.returncode == 0, result.stderr
    assert "is valid" in result.stdout
    assert "iterations          5" in result.stdout
    assert "[kl] adaptive" in result.stdout


def test_check_plans_for_several_processes_with_a_memory_estimate(recipe_document, write_recipe):
    recipe_document["ppo"].update(gradient_accumulation_steps=2)
    result = rlkit("check", write_recipe(recipe_document), "--num-processes", "2")
    assert result.returncode == 0, result.stderr
    assert "processes           2, each with 8 rollouts per iteration (8 prompts)" in result.stdout
    assert "micro-batches       2 of 2 rollouts per process and optimiser step" in result.stdout
    assert "MiB per process at the peak" in result.stdout
    refused = rlkit("check", write_recipe(recipe_document), "--num-processes", "3")
    assert refused.returncode == 2 and "do not split evenly over 3 processes" in refused.stderr


@pytest.mark.parametrize("change, message", [
    (("run", "stpes", 3), "$.run.stpes: unknown key; did you mean 'steps'?"),
    (("ppo", "batch_size", "many"), "$.ppo.batch_size: expected an integer, got 'many' (str)"),
    (("ppo", "epochs", 0), "$.ppo.epochs: must be > 0, got 0"),
    (("kl", "type", "adaptve"), "$.kl.type: unknown kl_controller 'adaptve'; registered: adaptive, fixed; did you mean 'adaptive'?"),
])
def test_check_bad_recipe_exits_2_with_one_located_message(recipe_document, write_recipe, change, message):
    table, key, value = change
    recipe_document.setdefault(table, {})[key] = value
    result = rlkit("check", write_recipe(recipe_document))
    assert result.returncode == 2
    assert message in result.stderr
    assert "1 problem in the recipe" in result.stderr
    assert "Traceback" not in result.stderr
    assert result.stdout == ""


def test_bad_override_exits_2(recipe_document, write_recipe):
    result = rlkit("check", write_recipe(recipe_document), "--set", "kl.target=-1")
    assert result.returncode == 2
    assert "$.kl.target: must be > 0, got -1.0" in result.stderr


def test_missing_recipe_exits_2(tmp_path):
    result = rlkit("run", str(tmp_path / "missing.toml"))
    assert result.returncode == 2 and "no recipe at" in result.stderr and "Traceback" not in result.stderr


def test_bad_arguments_exit_2():
    assert rlkit("run").returncode == 2
    assert rlkit("launch").returncode == 2


def test_runtime_failure_exits_1(recipe_document, write_recipe, tmp_path):
    broken = tmp_path / "broken_reward.py"
    broken.write_text("def score(prompts, responses, **columns):\n    return [1.0]\n")
    recipe_document["reward"]["function"] = f"{broken}:score"
    result = rlkit("run", write_recipe(recipe_document), "--quiet")
    assert result.returncode == 1
    assert "returned 1 scores for 16 responses" in result.stderr and "Traceback" not in result.stderr


def test_run_trains_and_writes_metrics(recipe_document, write_recipe):
    result = rlkit("run", write_recipe(recipe_document))
    assert result.returncode == 0, result.stderr
    assert "== rlkit report ==" in result.stdout and "before:" in result.stdout
    assert "tracking cost: median" in result.stdout
    lines = open(os.path.join(recipe_document["run"]["output_dir"], "metrics.jsonl")).read().splitlines()
    assert [json.loads(line)["iteration"] for line in lines] == [1, 2]


def test_an_earlier_scheduler_name_works_with_one_plain_line_naming_max_staleness(recipe_document, write_recipe):
    recipe_document["scheduler"] = {"type": "one-step-off"}
    recipe_document["loss"] = {"type": "ppo-clip", "tis_cap": 2.0}
    result = rlkit("check", write_recipe(recipe_document))
    assert result.returncode == 0, result.stderr
    assert "rlkit check: warning: scheduler.type = 'one-step-off' is deprecated: write max_staleness = 1 in [scheduler] instead\n" \
        in result.stderr
    assert "Warning" not in result.stderr and "max_staleness = 1: batches sampled ahead" in result.stdout
