"""reasoning-gym's datasets as rlkit parts (plugins/reasoning_gym_tasks.py): records that carry what
the dataset's own score reads, scores that are reasoning-gym's, located errors from `rlkit check`,
and the shipped recipe training through the `rlkit` command. Skipped without reasoning-gym."""

from __future__ import annotations

import importlib
import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("reasoning_gym")

from rlkit_plugins.reasoning_gym_tasks import (  # noqa: E402 (after the skip)
    ReasoningGymConfig,
    ReasoningGymPrompts,
    ReasoningGymReward,
    ReasoningGymRewardConfig,
)

from rlkit_core.errors import RecipeError  # noqa: E402
from rlkit_core.runtime.cli import main  # noqa: E402
from rlkit_core.testing.contracts import PromptSourceContract, RewardContract  # noqa: E402

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "grpo_reasoning_gym.toml"


def chain_sums(size: int = 3, **settings) -> list[dict]:
    """chain_sum records with seed 1; the first asks "4 - 1 - 7 =" (answer "-4")."""
    return ReasoningGymPrompts(ReasoningGymConfig(dataset="chain_sum", size=size, seed=1, **settings)).load()


def columns_of(records: list[dict]) -> dict[str, list]:
    return {key: [r[key] for r in records] for key in records[0] if key != "prompt"}


class TestReasoningGymPrompts(PromptSourceContract):
    component = "reasoning-gym"
    config = {"dataset": "chain_sum", "size": 8, "seed": 1, "dataset_config": {"max_terms": 3}}


class TestReasoningGymReward(RewardContract):
    component = "reasoning-gym"
    columns = columns_of(chain_sums())


def test_records_carry_the_question_the_instruction_and_the_entry(monkeypatch):
    def no_network(*args, **kwargs):
        raise AssertionError("the dataset opened a socket")

    monkeypatch.setattr(socket, "socket", no_network)  # chain_sum is generated, not downloaded
    records = chain_sums(4)
    first = records[0]
    assert first["entry"]["question"] == "State the final answer to the following arithmetic problem: 4 - 1 - 7 ="
    assert first["entry"]["answer"] == "-4"
    assert first["prompt"] == first["entry"]["question"] + "\n\nGive your final answer between <answer> and </answer> tags, with nothing else inside them."
    assert first["dataset"] == {"name": "chain_sum", "settings": {}, "seed": 1, "size": 4}
    # JSON text (reasoning-gym's tuples become arrays): what data/prompts_crc and a reward service read; the entry itself
    # stays as the dataset made it, for its score_answer
    assert json.dumps(chain_sums(4), sort_keys=True) == json.dumps(records, sort_keys=True)  # the same seed, the same records


def test_a_chat_record_holds_the_prompt_as_a_user_message_and_no_instruction_means_the_bare_question():
    [chat] = chain_sums(1, chat=True)
    assert chat["messages"] == [{"role": "user", "content": chat["prompt"]}]
    [bare] = chain_sums(1, instruction="")
    assert bare["prompt"] == bare["entry"]["question"] and "messages" not in bare


# chain_sum's score (reasoning_gym.utils.compute_decimal_reward) against the answer "-4": equal as a
# decimal → 1; the answer inside a longer one → len("-4") / len(answer); anything else, or no
# <answer> tags at all (extract_answer gives None), → 0
SCORED = {
    "<answer>-4</answer>": 1.0,
    "first <answer>5</answer>, then <answer> -04.0 </answer>": 1.0,  # the last pair counts; -04.0 == -4
    "<answer>-4 apples</answer>": 2 / 9,
    "<answer>5</answer>": 0.0,
    "-4": 0.0,
}


@pytest.mark.parametrize("response", SCORED)
def test_the_answer_in_tags_scores_what_reasoning_gym_says(response):
    [record] = chain_sums(1)
    reward = ReasoningGymReward(ReasoningGymRewardConfig())
    assert reward.score([record["prompt"]], [response], **columns_of([record])) == [pytest.approx(SCORED[response])]


def test_a_reward_on_other_data_is_a_located_error():
    reward = ReasoningGymReward(ReasoningGymRewardConfig())
    with pytest.raises(RecipeError, match=r"\$\.reward: the data has no `entry` and `dataset` columns \(columns: letter\); "
                                          r"use data.type = 'reasoning-gym'"):
        reward.score(["p"], ["<answer>1</answer>"], letter=["e"])


def test_the_plugin_registers_without_reasoning_gym(monkeypatch):
    """`rlkit plugins` imports every plugin: this one must import without the package."""
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # import reasoning_gym now raises ImportError
    monkeypatch.delitem(sys.modules, "rlkit_plugins.reasoning_gym_tasks")
    importlib.import_module("rlkit_plugins.reasoning_gym_tasks")


def check(recipe_document, write_recipe, capsys, data: dict) -> tuple[int, str]:
    recipe_document["reward"] = {"type": "reasoning-gym"}
    recipe_document["data"] = {"type": "reasoning-gym", **data}
    code = main(["check", "--offline", write_recipe(recipe_document)])
    return code, capsys.readouterr().err


def test_rlkit_check_makes_the_first_record(recipe_document, write_recipe, capsys):
    code, err = check(recipe_document, write_recipe, capsys, {"dataset": "chain_sum", "dataset_config": {"max_terms": 3}})
    assert code == 0, err


ERRORS = {
    "unknown dataset": ({"dataset": "chain_sums"}, "$.data.dataset: reasoning-gym has no dataset 'chain_sums'; did you mean 'chain_sum'"),
    "unsupported dataset": ({"dataset": "composite"}, "$.data.dataset: 'composite' is not supported here"),
    "unknown setting": ({"dataset": "chain_sum", "dataset_config": {"max_term": 3}},
                        "$.data.dataset_config.max_term: 'chain_sum' has no setting 'max_term'; did you mean 'max_terms'?"),
    "seed in the wrong place": ({"dataset": "chain_sum", "dataset_config": {"seed": 3}}, "$.data.dataset_config.seed: set data.seed instead"),
    "refused settings": ({"dataset": "chain_sum", "dataset_config": {"min_terms": 5, "max_terms": 2}},
                         "$.data.dataset_config: 'chain_sum' refuses these settings: AssertionError: max_terms must be >= min_terms"),
}


@pytest.mark.parametrize("case", ERRORS)
def test_rlkit_check_locates_a_bad_data_table(recipe_document, write_recipe, capsys, case):
    data, line = ERRORS[case]
    code, err = check(recipe_document, write_recipe, capsys, data)
    assert code == 2 and f"  {line}" in err and "Traceback" not in err, err


def test_without_the_package_rlkit_check_says_how_to_install_it(recipe_document, write_recipe, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)
    code, err = check(recipe_document, write_recipe, capsys, {"dataset": "chain_sum"})
    assert code == 2, err
    for table in ("data", "reward"):
        assert f"  $.{table}.type: 'reasoning-gym' needs the reasoning-gym package: pip install 'rlkit[reasoning-gym]'" in err


@pytest.mark.slow
def run_shrunk(recipe: Path, small: dict, tmp_path: Path) -> list[dict]:
    """`rlkit run recipe` with the settings `small` (its output in tmp_path/run); its metrics rows."""
    overrides = [f"--set={key}={value!r}" if isinstance(value, str) else f"--set={key}={value}" for key, value in small.items()]
    done = subprocess.run([str(Path(sys.executable).with_name("rlkit")), "run", str(recipe), *overrides, "--quiet"],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]


def test_the_shipped_recipe_trains_on_a_tiny_chat_model(tmp_path):
    """recipes/grpo_reasoning_gym.toml as a user would shrink it to try it: a tiny Llama-style chat
    model built offline in place of the hub model, two iterations, through the `rlkit` command."""
    from rlkit_core.testing.offline_models import write_tiny_model

    model = write_tiny_model(tmp_path / "model", "chat")
    small = {"run.steps": 2, "run.output_dir": str(tmp_path / "run"), "run.threads": 1, "policy.model": str(model), "policy.dtype": "float32",
             "ppo.batch_size": 8, "ppo.samples_per_prompt": 4, "ppo.minibatch_size": 4, "generator.max_new_tokens": 12, "data.size": 32,
             "eval.size": 4, "eval.every": 0, "tracker.type": "none"}
    rows = run_shrunk(RECIPE, small, tmp_path)
    trained = [row for row in rows if "score/mean" in row]
    assert len(trained) == 2 and all(0.0 <= row["score/mean"] <= 1.0 and "train/approx_kl" in row for row in trained)
    assert any("eval/score" in row for row in rows)


OFFLINE_RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "grpo_chain_sum_offline.toml"


def test_the_offline_warm_start_learns_the_recipes_own_questions_answered_right_a_share_of_the_time(tmp_path):
    """warm-start-answerer's supervised examples: the prompt exactly as the recipe's [data] renders
    it (from another seed), then `<answer>N</answer>` and the end, only those counted; right about
    `right_share` of the time, the rest off by 1 or 2."""
    from rlkit_plugins.reasoning_gym_tasks import AnswererConfig, WarmStartAnswerer
    from transformers import ByT5Tokenizer

    from rlkit_core.recipe.document import load_recipe
    from rlkit_core.recipe.plugins import load_registry

    recipe = load_recipe(str(OFFLINE_RECIPE), load_registry(environ={"RLKIT_PLUGINS": "none"}))
    answerer = object.__new__(WarmStartAnswerer)  # its examples, without building the model
    answerer.data, answerer.where = recipe["data"].config, "$.policy"
    tokenizer = ByT5Tokenizer()
    examples = answerer.examples(AnswererConfig(right_share=0.3), tokenizer, 400, 0)
    records = ReasoningGymPrompts(ReasoningGymConfig(**{**{f: getattr(recipe["data"].config, f) for f in ("dataset", "instruction", "dataset_config")},
                                                       "seed": recipe["data"].config.seed + 1, "size": 400})).load()
    right = 0
    for (ids, counted), record in zip(examples, records):
        cut = counted.index(True)
        assert not any(counted[:cut]) and all(counted[cut:])
        assert tokenizer.decode(ids[:cut]) == record["prompt"] and record["prompt"].endswith("=\n\nAnswer in <answer></answer> tags.")
        answer = tokenizer.decode(ids[cut:-1])
        assert answer.startswith("<answer>") and answer.endswith("</answer>") and ids[-1] == tokenizer.eos_token_id
        slip = int(answer.removeprefix("<answer>").removesuffix("</answer>")) - int(record["entry"]["answer"])
        assert slip in (-2, -1, 0, 1, 2)
        right += slip == 0
    assert 0.25 * 400 <= right <= 0.35 * 400  # 30% chosen right


def test_the_offline_warm_start_needs_reasoning_gym_data(recipe_document, builtin_registry):
    from tests.test_trainer import make_trainer

    recipe_document["policy"] = {"type": "warm-start-answerer", "sft_steps": 1}
    with pytest.raises(RecipeError, match=r"\$\.policy\.type: 'warm-start-answerer' learns the questions of a \[data\] table of type "
                                          r"'reasoning-gym', not 'jsonl'"):
        make_trainer(recipe_document, builtin_registry)


@pytest.mark.slow
def test_the_offline_recipe_trains_from_its_warm_start(tmp_path):
    """recipes/grpo_chain_sum_offline.toml through the `rlkit` command, its warm start made small
    (a few supervised steps, in a cache of the test's own), two iterations and an evaluation."""
    small = {"run.steps": 2, "run.output_dir": str(tmp_path / "run"), "run.threads": 1, "policy.cache_dir": str(tmp_path / "cache"),
             "policy.sft_steps": 20, "ppo.batch_size": 16, "ppo.minibatch_size": 8, "data.size": 64, "eval.size": 8, "eval.every": 1}
    rows = run_shrunk(OFFLINE_RECIPE, small, tmp_path)
    trained = [row for row in rows if "score/mean" in row]
    assert len(trained) == 2 and all(0.0 <= row["score/mean"] <= 1.0 for row in trained)
    assert [row["iteration"] for row in rows if "eval/score" in row] == [0, 1, 2]
