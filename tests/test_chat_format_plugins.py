"""Chat formats as a plugin kind: the core's own, and a third party's in one module
(examples/chat_formats/role_lines.py) registered, checked by the contract kit, picked by a
recipe with its settings, and trained through the episode runner."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from rlkit_core.errors import RecipeError
from rlkit_core.imports import load_module
from rlkit_core.recipe.document import parse_recipe
from rlkit_core.recipe.plugins import load_registry
from rlkit_core.testing.contracts import ChatFormatContract

ROLE_LINES = Path(__file__).parents[1] / "examples" / "chat_formats" / "role_lines.py"


def role_lines_registry():
    module = load_module(str(ROLE_LINES), "rlkit_example_role_lines")
    return load_registry(environ={"RLKIT_PLUGINS": "none"}, extra_plugins=[("role-lines", module, "rlkit-role-lines", "0.1")])


class TestPlainContract(ChatFormatContract):
    component = "plain"


class TestRoleLinesContract(ChatFormatContract):
    component = "role-lines"
    config = {"separator": " > "}

    @pytest.fixture(scope="class")
    @classmethod
    def registry(cls):
        return role_lines_registry()


class TestRoleLinesOnABPE(TestRoleLinesContract):
    """The same contract on a real-style tokenizer: a byte-level BPE with no pad token of its own,
    whose merges cross the boundaries that ByT5 never merges."""

    @pytest.fixture
    def tokenizer(self, chatml):
        return chatml[1]


@pytest.fixture
def counter_document(recipe_document):
    recipe_document.pop("reward")
    recipe_document["environment"] = {"type": "counter", "max_turns": 3, "max_episode_tokens": 200}
    recipe_document["data"] = {"type": "counter-tasks", "size": 8}
    return recipe_document


def test_the_recipe_picks_a_registered_format_with_its_settings_and_names_an_unknown_one(counter_document):
    registry = role_lines_registry()
    default = parse_recipe(counter_document, registry)["environment"].config.chat_format
    assert (default.component.name, default.table) == ("auto", "environment.chat_format")
    counter_document["environment"]["chat_format"] = {"type": "role-lines", "separator": " > "}
    chosen = parse_recipe(counter_document, registry)["environment"].config.chat_format
    assert (chosen.component.name, chosen.config.separator) == ("role-lines", " > ")
    counter_document["environment"]["chat_format"] = {"type": "role-lines", "separater": " > "}
    with pytest.raises(RecipeError, match=r"\$\.environment\.chat_format\.separater"):
        parse_recipe(counter_document, registry)
    counter_document["environment"]["chat_format"] = "role-line"
    with pytest.raises(RecipeError, match=r"\$\.environment\.chat_format: unknown chat_format 'role-line'.*did you mean 'role-lines'"):
        parse_recipe(counter_document, registry)


def test_an_episode_trains_in_a_third_partys_format(counter_document):
    """The runner renders with the plugin's format: the sample's first prompt is its lines, and the
    turns after it are bridged in it (one sample an episode, as the format keeps the stream)."""
    from rlkit_core.runtime.episodes import EpisodeRunner
    from tests.test_trainer import make_trainer

    counter_document["environment"]["chat_format"] = {"type": "role-lines", "separator": " > "}
    trainer = make_trainer(counter_document, role_lines_registry())
    played = EpisodeRunner(trainer.engine, trainer.components, trainer.recipe)(trainer.stream.batch(0)[:2], [0, 1], [0, 1])
    tokenizer = trainer.components.policy.tokenizer
    first = tokenizer.decode(played[0].samples[0].prompt)
    assert first.startswith("tools > add, read\nuser > ") and first.endswith("\nassistant > "), first
    assert all(len(episode.samples) == 1 for episode in played)
    metrics = trainer.step()
    assert metrics["env/turns"] >= 1


def test_an_episode_in_a_third_partys_format_on_a_bpe_keeps_the_ids_it_sampled(counter_document, chatml):
    """On a BPE the ids the model samples need not be the ids their text encodes to: a turn sampled as
    single characters (a call of the `read` tool) stays so in the trained stream, after the plugin's opening and before its bridge
    (one sample an episode), and the rows train."""
    import attrs

    from rlkit_core.runtime.episodes import EpisodeRunner
    from tests.test_episodes import Scripted
    from tests.test_trainer import make_trainer

    path, tokenizer = chatml
    call = '{"name":"read","arguments":{}}'
    pieces = [tokenizer.convert_tokens_to_ids("<tool_call>"), *map(tokenizer.convert_tokens_to_ids, call), tokenizer.convert_tokens_to_ids("</tool_call>")]
    assert tokenizer(tokenizer.decode(pieces), add_special_tokens=False)["input_ids"] != pieces  # text would merge "arguments"
    turn = [*pieces, tokenizer.eos_token_id]
    counter_document["policy"]["model"] = str(path)
    counter_document["environment"]["chat_format"] = {"type": "role-lines"}
    trainer = make_trainer(counter_document, role_lines_registry())
    trainer.components = attrs.evolve(trainer.components, generator=Scripted([turn], tokenizer.pad_token_id))
    runner = EpisodeRunner(trainer.engine, trainer.components, trainer.recipe)
    played = runner(trainer.stream.batch(0)[:2], [0, 1], [0, 1])
    for episode in played:
        [sample] = episode.samples
        assert tokenizer.decode(sample.prompt).startswith("tools: add, read\nuser: ")
        assert episode.turns == 3 and sample.sampled.count(True) == 3 * len(turn)
        at = 0
        for _ in range(episode.turns):  # each turn's sampled ids, verbatim, then the bridge the plugin rendered
            start = sample.sampled.index(True, at)
            assert sample.ids[start:start + len(turn)] == turn
            at = start + len(turn)
        assert tokenizer.decode(sample.ids[len(turn):sample.sampled.index(True, len(turn))]) == "\ntool: 0\nassistant: "  # the tool's answer
    metrics = trainer.step()
    assert metrics["env/turns"] == 3


def test_rlkit_plugins_lists_the_chat_formats():
    done = subprocess.run([sys.executable, "-m", "rlkit_core.runtime.cli", "plugins"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "chat_format" in done.stdout
    for name in ("auto", "template", "plain"):
        assert any(line.split()[:1] == [name] for line in done.stdout.splitlines() if "core:" in line), done.stdout
