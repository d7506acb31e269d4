"""Shared fixtures: a tiny real GPT-2 with the byte-level ByT5 tokenizer, built once per session
(no files from a hub), a prompt file, and a recipe writer."""

from __future__ import annotations

import json
import random

import pytest

from rlkit_core.testing import recipe_toml

REWARD_SOURCE = '''
def lowercase_share(prompts, responses, letter):
    """Share of lowercase letters in an 8-byte response: dense, so trivially learnable."""
    return [sum(c.islower() for c in r) / 8 for r in responses]
'''


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    from rlkit_core.testing import write_tiny_causal_lm

    return write_tiny_causal_lm(tmp_path_factory.mktemp("tiny-gpt2"))


@pytest.fixture(scope="session")
def tiny_reward_model(tmp_path_factory):
    """A GPT-2 sequence classifier with one output and the ByT5 tokenizer, built offline: a reward
    model, or the trunk of a separate critic."""
    from rlkit_core.testing.offline_models import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tiny-reward-model"), "byt5", classifier=True)


@pytest.fixture(scope="session")
def chatml(tmp_path_factory):
    """A tiny Qwen-style chat model: its BPE and ChatML template (the tool tags added, think blocks of
    earlier turns stripped), with room for a tools preamble; (its folder, its tokenizer)."""
    from transformers import AutoTokenizer

    from rlkit_core.testing.offline_models import write_tiny_model

    path = write_tiny_model(tmp_path_factory.mktemp("chatml"), "chatml")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 1024}))
    return path, AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="session")
def prompt_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "prompts.jsonl"
    rng = random.Random(0)
    with path.open("w") as out:
        for _ in range(64):
            prompt = "".join(rng.choice("abcdfg") for _ in range(rng.randint(2, 10)))
            out.write(json.dumps({"prompt": prompt, "letter": "e"}) + "\n")
    return path


@pytest.fixture(scope="session")
def reward_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("reward") / "letter_reward.py"
    path.write_text(REWARD_SOURCE)
    return path


@pytest.fixture
def recipe_document(tmp_path, tiny_model, prompt_file, reward_file):
    """A small valid recipe as a dict; tests change it and parse or write it."""
    return {
        "run": {"steps": 2, "seed": 0, "output_dir": str(tmp_path / "run"), "threads": 1},
        "ppo": {"batch_size": 16, "minibatch_size": 8, "epochs": 2},
        "optim": {"learning_rate": 1e-3},
        "policy": {"type": "hf", "model": str(tiny_model)},
        "generator": {"max_new_tokens": 8},
        "reward": {"type": "python", "function": f"{reward_file}:lowercase_share"},
        "data": {"type": "jsonl", "path": str(prompt_file)},
        "tracker": {"type": "none"},
    }


@pytest.fixture
def write_recipe(tmp_path):
    def write(document: dict, name: str = "recipe.toml") -> str:
        path = tmp_path / name
        path.write_text(recipe_toml(document))
        return str(path)

    return write


@pytest.fixture(scope="session")
def builtin_registry():
    """The built-in plugins only, whatever else is installed (a contract class's `registry` is
    every installed plugin's, see `rlkit_core.testing.contracts`)."""
    from rlkit_core.recipe.plugins import load_registry

    return load_registry(environ={"RLKIT_PLUGINS": "none"})
