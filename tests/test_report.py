"""The end-of-run report's samples: the episodes it plays before and after training, which call an
agent as training does, and `run.report_samples = 0`, which plays none."""

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlkit_core.recipe.document import parse_recipe
from rlkit_core.runtime.run import run_recipe
from rlkit_core.testing import recipe_toml

COUNTING_AGENT = """\
import os


def play(record, client):
    with open(os.environ["AGENT_CALLS"], "a") as calls:
        calls.write("call\\n")
    client.chat.completions.create(model="policy", messages=[{"role": "user", "content": record["prompt"]}])
    return 1.0
"""


def agent_recipe(tmp_path: Path, model: Path, run: dict, held_out: int) -> Path:
    """One iteration of 4 one-turn episodes of an agent that counts its calls, with `held_out` prompts
    evaluated before and after it."""
    agent = tmp_path / "counting_agent.py"
    agent.write_text(COUNTING_AGENT)
    document = {
        "run": {"steps": 1, "output_dir": str(tmp_path / "run"), "threads": 1, "sample_every": 1, **run},
        "ppo": {"batch_size": 4, "minibatch_size": 4, "epochs": 1},
        "policy": {"type": "hf", "model": str(model)},
        "generator": {"max_new_tokens": 4},
        "environment": {"type": "agent", "harness": f"{agent}:play", "max_turns": 1},
        "data": {"type": "guess-number-games", "size": 64},
        "eval": {"size": held_out},
        "tracker": {"type": "none"},
    }
    recipe = tmp_path / "recipe.toml"
    recipe.write_text(recipe_toml(document))
    return recipe


@pytest.mark.slow
@pytest.mark.parametrize("run, held_out, calls, shown", [
    ({}, 0, 4 + 5 + 5, 5),  # the batch's, and the report's on the first 5 training prompts, before and after training
    ({"report_samples": 0}, 2, 4 + 2 + 2, 0),  # the batch's, and the held-out ones before and after training: no more
], ids=["default", "none"])
def test_the_report_plays_its_samples_as_episodes_unless_told_not_to(tmp_path, chatml, run, held_out, calls, shown):
    pytest.importorskip("openai")
    recipe = agent_recipe(tmp_path, chatml[0], run, held_out)
    counted = tmp_path / "calls.txt"
    env = {**os.environ, "RLKIT_PLUGINS": "none", "AGENT_CALLS": str(counted)}
    result = subprocess.run([sys.executable, "-m", "rlkit_core.runtime.cli", "run", str(recipe), "--quiet"],
                            capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr
    assert len(counted.read_text().splitlines()) == calls
    assert "== rlkit report ==" in result.stdout
    assert result.stdout.count("\nsample ") == shown and result.stdout.count("  before: ") == shown
    assert (tmp_path / "run" / "samples_before.json").exists() == bool(shown)


def test_a_run_resumed_with_samples_shows_none_when_it_started_without(recipe_document, builtin_registry, tmp_path):
    """Its starting policy is gone: what the resumed one says is not what the run started from."""
    recipe_document["run"].update(steps=1, report_samples=0)
    run_recipe(parse_recipe(recipe_document, builtin_registry), quiet=True, out=io.StringIO())
    recipe_document["run"].update(steps=2, report_samples=5)
    report = io.StringIO()
    run_recipe(parse_recipe(recipe_document, builtin_registry), quiet=True, resume="auto", out=report)
    assert "== rlkit report ==" in report.getvalue() and "sample 1" not in report.getvalue()
    assert not (tmp_path / "run" / "samples_before.json").exists()
