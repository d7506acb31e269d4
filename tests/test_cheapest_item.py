"""The tool task on real chat templates (rlkit_plugins.cheapest_item): the environment's rewards by
hand, the careless demonstrations, transcripts that are exactly the streams episodes are made of on
Qwen3's and Qwen2.5's real templates (read from the installed `trl`), and the contracts."""

from __future__ import annotations

import random

import pytest
from rlkit_plugins.cheapest_item import (
    CheapestItem,
    CheapestItemConfig,
    Puzzles,
    PuzzlesConfig,
    ToolChatConfig,
    WarmStartToolChat,
    call_text,
    careless_turns,
    installed_template,
    transcript_examples,
)

from rlkit_core.chat_format import chat_format_for
from rlkit_core.testing.contracts import EnvironmentContract, PolicyContract, PromptSourceContract, read_reply

PUZZLE = {"prompt": "Which is cheapest: 1 fig or 2 pear? Look up each price by its position, then answer with the cheapest's.",
          "prices": [7, 3]}


def play(environment, record, texts):
    """Each text as the model's turn, through the environment; the steps."""
    state, steps = environment.reset(record, 0).state, []
    for turn, text in enumerate(texts, 1):
        steps.append(environment.step(state, read_reply(text, turn)))
    return steps


def test_the_fewest_calls_then_the_cheapest_earn_1():
    steps = play(CheapestItem(CheapestItemConfig()), PUZZLE, [call_text(1), call_text(2), "The cheapest is item 2."])
    assert [m["content"] for s in steps[:2] for m in s.messages] == ["7", "3"]
    assert steps[-1].done and steps[-1].reward == 1.0 and steps[-1].info["optimal"] == 1.0 and steps[-1].info["tool_calls"] == 2


def test_every_call_beyond_one_per_item_costs_call_cost():
    """Four calls (1 twice, and 3, which does not exist) for two items: 2 calls too many, 1 − 2·0.1 = 0.8."""
    steps = play(CheapestItem(CheapestItemConfig()), PUZZLE,
                 [call_text(1), call_text(1), call_text(3), call_text(2), "2, I think"])
    assert "no item at position 3; the positions are 1 to 2" in steps[2].messages[0]["content"]
    assert steps[-1].reward == pytest.approx(0.8) and steps[-1].info == {
        "solved": 1.0, "optimal": 0.0, "tool_calls": 4.0, "malformed_tool_calls": 0.0, "tool_errors": 1.0}


@pytest.mark.parametrize("answer", ["The cheapest is item 1.", "I don't know", "2 or 1"])
def test_a_wrong_or_missing_answer_earns_0(answer):
    """The last number written is the answer."""
    steps = play(CheapestItem(CheapestItemConfig()), PUZZLE, [call_text(1), call_text(2), answer])
    assert steps[-1].reward == 0.0 and steps[-1].info["solved"] == 0.0


def test_puzzles_have_one_cheapest_item_and_repeat_by_seed():
    puzzles = Puzzles(PuzzlesConfig(size=200, seed=4)).load()
    assert puzzles == Puzzles(PuzzlesConfig(size=200, seed=4)).load() != Puzzles(PuzzlesConfig(size=200, seed=5)).load()
    for puzzle in puzzles:
        prices = puzzle["prices"]
        assert 2 <= len(prices) <= 3 and len(set(prices)) == len(prices)
        assert f" or {len(prices)} " in puzzle["prompt"]


def test_careless_turns_by_their_shares():
    puzzle = {"prompt": "", "prices": [7, 3, 5]}
    rng = random.Random(0)
    assert careless_turns(rng, puzzle, 0, 0, 0) == [call_text(1), call_text(2), call_text(3), "The cheapest is item 2."]
    for _ in range(20):
        skipped = careless_turns(rng, puzzle, 1, 0, 0)
        assert len(skipped) == 3 and skipped[0] == call_text(1)  # one item after the first is never looked up
        assert skipped[-1] == ("The cheapest is item 3." if call_text(2) not in skipped else "The cheapest is item 2.")
        repeated = careless_turns(rng, puzzle, 0, 1, 0)
        assert len(repeated) == 5 and len(set(repeated[:-1])) == 3
        assert careless_turns(rng, puzzle, 0, 0, 1)[-1] in ("The cheapest is item 1.", "The cheapest is item 3.")


@pytest.fixture(scope="module")
def made():
    """The recipe's tokenizer and a fresh model for each family's real template (no supervised step)."""
    pytest.importorskip("trl", reason="the real chat templates come with trl (pip install -e .[test])")
    return {name: WarmStartToolChat.model_maker(ToolChatConfig(chat_template=name))(1, 16, 2) for name in ("qwen3", "qwen2_5")}


@pytest.mark.parametrize("name", ["qwen3", "qwen2_5"])
def test_transcripts_are_the_whole_conversation_rendered_with_only_the_turns_counted(made, name):
    """Each careless transcript is the template's render of the whole conversation (the prompt of
    its last turn, then that turn), and the loss counts exactly the model's turns and their ends."""
    tokenizer, model = made[name]
    tools = CheapestItem(CheapestItemConfig()).tools()
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    chat = chat_format_for("template", tokenizer, (end,))
    for ids, counted in transcript_examples(tokenizer, tools, 30, 0, 0.3, 0.2, 0.1):
        assert len(ids) <= model.config.max_position_embeddings
        turns = tokenizer.decode([i for i, c in zip(ids, counted) if c]).split("<|im_end|>")[:-1]
        assert len(turns) >= 2 and all(t.startswith("<tool_call>") for t in turns[:-1]) and turns[-1].startswith("The cheapest is")
        last_start = max(i for i in range(len(ids)) if not counted[i]) + 1  # the last turn begins after the last rendered id
        history = [{"role": "user", "content": tokenizer.decode(ids).split("<|im_start|>user\n")[1].split("<|im_end|>")[0]}]
        assert tokenizer.decode(ids[:last_start]).endswith("<|im_start|>assistant\n")
        assert ids[:len(chat.opening(history, tools))] == chat.opening(history, tools)
    assert installed_template(name) == tokenizer.chat_template


def test_a_template_trl_does_not_ship_is_a_located_error():
    pytest.importorskip("trl")
    from rlkit_core.errors import RecipeError

    with pytest.raises(RecipeError, match=r"\$\.policy\.chat_template: trl ships no template 'qwen99'; it has .*qwen3"):
        installed_template("qwen99")


class TestCheapestItem(EnvironmentContract):
    component = "cheapest-item"
    records = [PUZZLE, {"prompt": "Which is cheapest: 1 apple, 2 lime or 3 plum?", "prices": [2, 9, 4]}]


class TestCheapestItemPuzzles(PromptSourceContract):
    component = "cheapest-item-puzzles"
    config = {"size": 16, "seed": 3}


class TestWarmStartToolChat(PolicyContract):
    component = "warm-start-tool-chat"

    @pytest.fixture(scope="class")
    @classmethod
    def cache(cls, tmp_path_factory):
        pytest.importorskip("trl")
        return tmp_path_factory.mktemp("warm-start-cache")

    @pytest.fixture
    def component_config(self, cache):
        return {"cache_dir": str(cache), "n_layer": 1, "n_embd": 16, "n_head": 2, "sft_steps": 2, "sft_batch_size": 4, "sft_examples": 8}


@pytest.mark.slow
@pytest.mark.parametrize(("name", "template"), [("ppo_tool_qwen3", "qwen3"), ("ppo_tool_qwen3", "qwen2_5"), ("grpo_tool_qwen3", "qwen3"),
                                               ("ppo_agent_qwen3", "qwen3")])
def test_the_tool_recipes_train_on_a_real_template(tmp_path, name, template):
    """recipes/ppo_tool_qwen3.toml (its GRPO twin, and the default agent recipe, whose episodes an
    OpenAI-client agent plays through the endpoint) as shipped, made small (a warm start of a few
    steps, two iterations of 8 episodes), through the `rlkit` command: it builds its chat model on
    Qwen3's real template, or on Qwen2.5's, which never rewrites history, plays tool episodes and trains."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("trl")
    recipe = Path(__file__).parent.parent / "recipes" / f"{name}.toml"
    small = {"run.steps": 2, "run.output_dir": str(tmp_path / "run"), "policy.cache_dir": str(tmp_path / "cache"), "policy.n_embd": 32,
             "policy.n_head": 2, "policy.sft_steps": 4, "policy.sft_examples": 16, "policy.sft_batch_size": 4, "ppo.batch_size": 8,
             "ppo.minibatch_size": 4, "eval.size": 4, "eval.every": 2, "policy.chat_template": template}
    overrides = [f"--set={key}={value!r}" if isinstance(value, str) else f"--set={key}={value}" for key, value in small.items()]
    done = subprocess.run([str(Path(sys.executable).with_name("rlkit")), "run", str(recipe), *overrides, "--quiet"],
                          capture_output=True, text=True, timeout=600, cwd=recipe.parent.parent)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "episodes: chat format: template" in done.stderr
    assert "episodes: stream vs the conversation rendered at once: a token prefix at every turn" in done.stderr
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    trained = [row for row in rows if "score/mean" in row]
    counted = "env/agent_requests" if name == "ppo_agent_qwen3" else "env/tool_calls"  # the agent's figures are its own
    assert len(trained) == 2 and all(counted in row and "train/approx_kl" in row for row in trained)
