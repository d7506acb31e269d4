"""skyrl-gym's environments as the rlkit environment `skyrl-gym` (plugins/skyrl_gym_envs.py): the
contract, episodes whose rewards are skyrl-gym's own scorers', located errors from `rlkit check`,
and a short run through the `rlkit` command. Skipped without skyrl-gym."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("skyrl_gym")

from rlkit_plugins.skyrl_gym_envs import SkyRLGym, SkyRLGymConfig  # noqa: E402 (after the skip)

from rlkit_core.errors import RecipeError  # noqa: E402
from rlkit_core.runtime.cli import main  # noqa: E402
from rlkit_core.testing.contracts import EnvironmentContract, read_reply  # noqa: E402

# gsm8k-style records, in the shape skyrl-gym's own gsm8k dataset gives its envs: the question, and
# the answer under reward_spec.ground_truth (a string: the scorer compares strings)
QUESTIONS = [("Tom has 3 apples and buys 4 more. How many apples does he have?", "7"),
             ("A box holds 6 eggs. How many eggs are in 5 boxes?", "30"),
             ("Sam had 20 marbles and lost 8. How many are left?", "12")]
RECORDS = [{"prompt": f"{question} Let's think step by step and output the final answer after '####'.",
            "reward_spec": {"method": "rule", "ground_truth": answer}} for question, answer in QUESTIONS]


def write_records(path: Path, count: int = 32) -> Path:
    with path.open("w") as out:
        for index in range(count):
            out.write(json.dumps(RECORDS[index % len(RECORDS)]) + "\n")
    return path


def play(environment, record, texts):
    state, steps = environment.reset(record, 0).state, []
    for turn, text in enumerate(texts, 1):
        steps.append(environment.step(state, read_reply(text, turn)))
    return steps


class TestGsm8kContract(EnvironmentContract):
    component = "skyrl-gym"
    config = {"env_id": "gsm8k"}
    records = RECORDS


class TestGsm8kMultiTurnContract(EnvironmentContract):
    component = "skyrl-gym"
    config = {"env_id": "gsm8k_multi_turn", "extras": {"max_turns": 3}}
    records = RECORDS


def test_reset_opens_with_the_prompt_as_a_user_message_and_leaves_the_record():
    record = json.loads(json.dumps(RECORDS[0]))
    opening = SkyRLGym(SkyRLGymConfig(env_id="gsm8k")).reset(record, 0)
    assert opening.messages == [{"role": "user", "content": RECORDS[0]["prompt"]}] and record == RECORDS[0]
    chat = {"prompt": None, "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1 + 1?"}],
            "reward_spec": {"ground_truth": "2"}}
    assert SkyRLGym(SkyRLGymConfig(env_id="gsm8k")).reset(chat, 0).messages == chat["messages"]


# skyrl-gym's gsm8k scorer (envs/gsm8k/utils.py, strict): the number after the first "#### ", commas
# and $ dropped, equal as a string to the ground truth → 1; another number or none → 0; one step, done
GSM8K = {"7 apples.\n#### 7": 1.0, "#### 1,000": 0.0, "#### 7.0": 0.0, "7": 0.0, "#### 8": 0.0}


@pytest.mark.parametrize("text", GSM8K)
def test_gsm8k_scores_the_turn_as_skyrl_gym_does_and_ends(text):
    [step] = play(SkyRLGym(SkyRLGymConfig(env_id="gsm8k")), RECORDS[0], [text])
    assert step.reward == GSM8K[text] and step.done and step.messages == []


def test_gsm8k_multi_turn_asks_again_until_right_with_its_format_score():
    """gsm8k_multi_turn (max_turns = 3 from the extras): a well-formed wrong answer earns 0.2 / 3 and
    a request to try again; the right one earns 1 and ends; get_metrics' `steps` is in the info."""
    environment = SkyRLGym(SkyRLGymConfig(env_id="gsm8k_multi_turn", extras={"max_turns": 3}))
    wrong, unformatted, right = play(environment, RECORDS[0], ["#### 8", "seven", "#### 7"])
    assert wrong.reward == pytest.approx(0.2 / 3) and not wrong.done and "'#### ANSWER'" in wrong.messages[0]["content"]
    assert wrong.messages[0]["role"] == "user"
    assert unformatted.reward == 0.0 and not unformatted.done and unformatted.messages[0]["content"].startswith("Now provide only")
    assert right.reward == 1.0 and right.done and right.messages == [] and right.info == {"steps": 3.0}


def test_the_core_closes_each_episodes_env_however_it_ended(monkeypatch):
    """An episode the env ended (done) and one the core ended before (a turn limit): each env is
    closed once, by the core's `close`, and never by a step."""
    from skyrl_gym.envs.gsm8k.env import GSM8kEnv

    closed = []
    monkeypatch.setattr(GSM8kEnv, "close", lambda self: closed.append(self))
    environment = SkyRLGym(SkyRLGymConfig(env_id="gsm8k"))
    done = environment.reset(RECORDS[0], 0).state
    assert environment.step(done, read_reply("#### 7", 1)).done
    cut = environment.reset(RECORDS[1], 0).state
    assert closed == []
    environment.close(done)
    environment.close(cut)
    assert closed == [done.env, cut.env]


def test_numeric_metadata_becomes_info_and_the_rest_is_left_out():
    """aime's step gives {acc: bool, pred: str}: acc is a number the run can average, pred is not.
    Its scorer reads the last "Answer: ..." line: 1 when right, -1 otherwise."""
    record = {"prompt": "What is 6 * 7?", "reward_model": {"ground_truth": "42"}}
    [right] = play(SkyRLGym(SkyRLGymConfig(env_id="aime")), record, ["6 * 7 = 42.\nAnswer: 42"])
    assert right.reward == 1.0 and right.done and right.info == {"acc": 1.0}
    [wrong] = play(SkyRLGym(SkyRLGymConfig(env_id="aime")), record, ["Answer: 41"])
    assert wrong.reward == -1.0 and wrong.done and wrong.info == {"acc": 0.0}


def test_a_record_without_the_extras_the_env_needs_is_a_located_error():
    with pytest.raises(RecipeError, match=r"\$\.environment: skyrl-gym's 'gsm8k' refuses a record's extras \(columns: answer\): "
                                          r"AssertionError: reward_spec field is required; "):
        SkyRLGym(SkyRLGymConfig(env_id="gsm8k")).reset({"prompt": "1 + 1?", "answer": "2"}, 0)


def test_a_record_of_another_env_class_is_a_located_error():
    with pytest.raises(RecipeError, match=r"\$\.environment\.env_id: is 'gsm8k', but a record's `env_class` is 'aime'"):
        SkyRLGym(SkyRLGymConfig(env_id="gsm8k")).reset({**RECORDS[0], "env_class": "aime"}, 0)


def test_the_plugin_registers_without_skyrl_gym(monkeypatch):
    """`rlkit plugins` imports every plugin: this one must import without the package."""
    monkeypatch.setitem(sys.modules, "skyrl_gym", None)
    monkeypatch.delitem(sys.modules, "rlkit_plugins.skyrl_gym_envs")
    importlib.import_module("rlkit_plugins.skyrl_gym_envs")


def check(recipe_document, write_recipe, capsys, tmp_path, environment: dict, records: list[dict] | None = None) -> tuple[int, str, str]:
    data = tmp_path / "questions.jsonl"
    if records is None:
        write_records(data)
    else:
        data.write_text("".join(json.dumps(record) + "\n" for record in records))
    recipe_document.pop("reward")
    recipe_document["environment"] = {"type": "skyrl-gym", **environment}
    recipe_document["data"] = {"type": "jsonl", "path": str(data)}
    code = main(["check", "--offline", write_recipe(recipe_document)])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_rlkit_check_probes_the_first_record(recipe_document, write_recipe, capsys, tmp_path):
    code, out, err = check(recipe_document, write_recipe, capsys, tmp_path, {"env_id": "gsm8k"})
    assert code == 0, err
    assert "  reset               on the first record of the data: 1 opening message(s), ok" in out


ERRORS = {
    "unknown env": ({"env_id": "gsm8"}, None, "$.environment.env_id: skyrl-gym has no environment 'gsm8'; did you mean 'gsm8k'"),
    "far from any env": ({"env_id": "chess"}, None,
                         "$.environment.env_id: skyrl-gym has no environment 'chess'; the registered ones: aime, gsm8k, gsm8k_multi_turn"),
    "records without the extras": ({"env_id": "gsm8k"}, [{"prompt": "1 + 1?", "answer": "2"}],
                                   "$.environment: skyrl-gym's 'gsm8k' refuses a record's extras (columns: answer)"),
}


@pytest.mark.parametrize("case", ERRORS)
def test_rlkit_check_locates_a_bad_environment(recipe_document, write_recipe, capsys, tmp_path, case):
    environment, records, line = ERRORS[case]
    code, _, err = check(recipe_document, write_recipe, capsys, tmp_path, environment, records)
    assert code == 2 and f"  {line}" in err and "Traceback" not in err, err


def test_without_the_package_rlkit_check_says_how_to_install_it(recipe_document, write_recipe, capsys, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "skyrl_gym", None)
    code, _, err = check(recipe_document, write_recipe, capsys, tmp_path, {"env_id": "gsm8k"})
    assert code == 2 and "  $.environment.type: 'skyrl-gym' needs the skyrl-gym package: pip install 'rlkit[skyrl-gym]'" in err, err


@pytest.mark.slow
def test_a_gsm8k_recipe_trains_on_a_tiny_chat_model(tmp_path, recipe_document, write_recipe):
    """gsm8k through the `rlkit` command: a tiny Llama-style chat model built offline, the env's
    rewards alone, two iterations; each trained row carries the episodes' `env/` figures."""
    from rlkit_core.testing.offline_models import write_tiny_model

    model = write_tiny_model(tmp_path / "model", "chat")
    recipe_document.pop("reward")
    recipe_document["policy"] = {"type": "hf", "model": str(model), "dtype": "float32"}
    recipe_document["ppo"] = {"batch_size": 8, "minibatch_size": 4, "samples_per_prompt": 4, "epochs": 1}
    recipe_document["generator"] = {"max_new_tokens": 12}
    recipe_document["environment"] = {"type": "skyrl-gym", "env_id": "gsm8k_multi_turn", "extras": {"max_turns": 2}, "max_turns": 2}
    recipe_document["data"] = {"type": "jsonl", "path": str(write_records(tmp_path / "questions.jsonl"))}
    done = subprocess.run([str(Path(sys.executable).with_name("rlkit")), "run", write_recipe(recipe_document), "--quiet"],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    trained = [row for row in rows if "score/mean" in row]
    assert len(trained) == 2, rows
    for row in trained:
        assert 0.0 <= row["score/mean"] <= 2.0 and "train/approx_kl" in row and row["env/turns"] >= 1
        assert any(name.startswith("env/status_") for name in row)


def test_an_env_that_needs_more_than_the_package_is_noted():
    problems, notes = SkyRLGym.check(SkyRLGymConfig(env_id="search"), None, "$.environment")
    assert problems == [] and notes == ["$.environment.env_id: 'search' needs a retrieval server over HTTP (env_config.search_url); "
                                        "rlkit does not test it"]


@pytest.mark.slow
def test_the_shipped_recipe_trains_on_gsm8k_records_its_script_makes(tmp_path):
    """recipes/grpo_skyrl_gym.toml as a user would run it, shrunk: examples/skyrl_gym/gsm8k.py turns
    rows in GSM8K's own format into the records the recipe reads (data/gsm8k_train.jsonl, from the
    working directory), `rlkit check --offline` passes and resets the environment on the first one,
    and a tiny model in place of the hub one trains two iterations whose episodes the env scored."""
    from tests.test_episodes import ending_model

    root, rlkit = Path(__file__).resolve().parents[1], str(Path(sys.executable).with_name("rlkit"))
    recipe = root / "recipes" / "grpo_skyrl_gym.toml"
    source = tmp_path / "gsm8k_source.jsonl"  # GSM8K's own rows: the worked answer, then "#### <number>"
    source.write_text("".join(json.dumps({"question": question, "answer": f"We work it out.\n#### {answer}"}) + "\n"
                              for question, answer in QUESTIONS * 11))
    made = subprocess.run([sys.executable, str(root / "examples" / "skyrl_gym" / "gsm8k.py"), "--source", str(source)],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert made.returncode == 0 and made.stdout.strip() == "wrote 33 records to data/gsm8k_train.jsonl", made.stdout + made.stderr
    first = json.loads((tmp_path / "data" / "gsm8k_train.jsonl").read_text().splitlines()[0])
    assert first["prompt"] == f"{QUESTIONS[0][0]} Let's think step by step and output the final answer after \"####\"."
    assert first["reward_spec"] == {"method": "rule", "ground_truth": "7"} and first["extra_info"] == {"split": "train", "index": 0}
    [right] = play(SkyRLGym(SkyRLGymConfig(env_id="gsm8k")), first, ["3 + 4 = 7.\n#### 7"])  # the env reads the record as made
    assert right.reward == 1.0 and right.done
    checked = subprocess.run([rlkit, "check", "--offline", str(recipe)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert checked.returncode == 0, checked.stdout[-2000:] + checked.stderr[-3000:]
    assert "  reset               on the first record of the data: 1 opening message(s), ok" in checked.stdout
    model = ending_model(tmp_path / "model", "gpt2")  # ends its turn after a token or three, so the env scores it
    small = {"run.steps": 2, "run.output_dir": str(tmp_path / "run"), "run.threads": 1, "policy.model": str(model), "policy.dtype": "float32",
             "ppo.batch_size": 8, "ppo.samples_per_prompt": 4, "ppo.minibatch_size": 4, "generator.max_new_tokens": 8,
             "eval.size": 4, "eval.every": 0, "tracker.type": "none"}
    overrides = [f"--set={key}={value!r}" if isinstance(value, str) else f"--set={key}={value}" for key, value in small.items()]
    done = subprocess.run([rlkit, "run", str(recipe), *overrides, "--quiet"], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    trained = [row for row in rows if "score/mean" in row]
    assert len(trained) == 2, rows
    for row in trained:
        assert 0.0 <= row["score/mean"] <= 1.0 and "train/approx_kl" in row and row["env/turns"] == 1.0 and row["env/status_ok"] > 0.0
    assert any("eval/score" in row for row in rows)
