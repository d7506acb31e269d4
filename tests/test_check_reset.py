"""`rlkit check` runs the data's first record through the environment's `reset`: an environment that
cannot start an episode on the recipe's own data exits 2, located, before a run that would train
nothing; one that can adds a line to the plan's episodes section."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from rlkit_plugins.guess_number import GuessNumber

from rlkit_core.messages import Reset
from rlkit_core.runtime.cli import main

SHIPPED = Path(__file__).resolve().parents[1] / "recipes" / "ppo_guess_number.toml"
OK_LINE = "  reset               on the first record of the data: 1 opening message(s), ok"


def rlkit(*args, cwd):
    env = {**os.environ, "RLKIT_PLUGINS": "none"}
    return subprocess.run([sys.executable, "-m", "rlkit_core.runtime.cli", *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=300)


@pytest.mark.slow
def test_the_shipped_guess_number_recipe_starts_an_episode(tmp_path):
    done = rlkit("check", str(SHIPPED), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    episodes = done.stdout[done.stdout.index("\nepisodes:"):done.stdout.index("\ncode this recipe runs")]
    assert episodes.splitlines()[-1] == OK_LINE, episodes


@pytest.mark.slow
@pytest.mark.parametrize("offline", [[], ["--offline"]])  # reading a local record and calling reset is local work
def test_records_without_the_column_the_environment_reads_exit_2_located(prompt_file, tmp_path, offline):
    done = rlkit("check", str(SHIPPED), "--set", f'data={{type="jsonl", path={json.dumps(str(prompt_file))}}}', *offline, cwd=tmp_path)
    assert done.returncode == 2, done.stdout
    assert "1 problem in the recipe:\n  $.environment: a record's 'secret' column is None, not a number from 1 to 16" in done.stderr
    assert "Traceback" not in done.stderr and done.stdout == ""


def guess_number_recipe(recipe_document, write_recipe, **environment) -> str:
    """The shared tiny recipe as a guess-number one (its games have a secret each)."""
    recipe_document.pop("reward")
    recipe_document["environment"] = {"type": "guess-number", "max_turns": 4, **environment}
    recipe_document["data"] = {"type": "guess-number-games", "size": 64, "seed": 0}
    return write_recipe(recipe_document)


SAID = {"raises": "raised ValueError: no such game\n", "breaks the contract": "returned dict, not a Reset",
        "says nothing": "returned no opening messages", "hangs": "did not return within environment.step_timeout_s = 0.5 s"}


@pytest.mark.parametrize("fault", SAID)
def test_an_environment_that_cannot_start_an_episode_exits_2_with_what_went_wrong(recipe_document, write_recipe, monkeypatch, capsys,
                                                                                  fault):

    def reset(self, record, seed):
        if fault == "raises":
            raise ValueError("no such game")
        if fault == "hangs":
            time.sleep(3)
        return {"messages": []} if fault == "breaks the contract" else Reset([], None)

    monkeypatch.setenv("RLKIT_PLUGINS", "none")
    monkeypatch.setattr(GuessNumber, "reset", reset)
    started = time.monotonic()
    assert main(["check", guess_number_recipe(recipe_document, write_recipe, step_timeout_s=0.5)]) == 2
    assert time.monotonic() - started < 3  # the hanging reset is left in its thread
    err = capsys.readouterr().err
    assert f"1 problem in the recipe:\n  $.environment: reset on the first record of the data {SAID[fault]}" in err, err
    if fault == "raises":  # with the line that raised, in the environment's own code
        assert 'raise ValueError("no such game")' in err


def test_a_recipe_without_an_environment_builds_nothing(recipe_document, write_recipe, monkeypatch, capsys):
    from rlkit_core.runtime import reset_check

    def first_reset(*args):
        raise AssertionError("a single-turn recipe has no environment to reset")

    monkeypatch.setattr(reset_check, "first_reset", first_reset)
    monkeypatch.setenv("RLKIT_PLUGINS", "none")
    assert main(["check", write_recipe(recipe_document)]) == 0
    out = capsys.readouterr().out
    assert "is valid" in out and "episodes:" not in out and "reset" not in out
