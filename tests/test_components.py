"""Built-in components on their own: response masks, prompt encoding, rewards and prompt files."""

import json

import pytest
import torch
from rlkit_plugins.hf_policy import load_tokenizer
from rlkit_plugins.prompt_sources import JsonlConfig, JsonlPrompts
from rlkit_plugins.rewards import PythonReward, PythonRewardConfig

from rlkit_core.errors import RecipeError
from rlkit_core.functional import response_mask
from rlkit_core.prompts import encode_prompts
from rlkit_core.runtime.faults import checked_scores


def test_response_mask_counts_up_to_and_including_the_first_eos():
    eos = 1
    ids = torch.tensor([[5, 6, 1, 0, 0], [5, 1, 7, 1, 0], [5, 6, 7, 8, 9], [1, 0, 0, 0, 0]])
    assert response_mask(ids, [eos]).tolist() == [[1, 1, 1, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]]


def test_response_mask_ends_on_any_of_several_end_ids():
    ids = torch.tensor([[5, 7, 1, 0], [5, 1, 7, 0], [5, 6, 8, 9]])
    assert response_mask(ids, [1, 7]).tolist() == [[1, 1, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1]]


def test_tokenizer_gets_a_pad_distinct_from_eos(tiny_model):
    tokenizer = load_tokenizer(str(tiny_model))
    assert tokenizer.pad_token_id != tokenizer.eos_token_id
    assert tokenizer.padding_side == "left"


def test_encode_prompts_left_pads_and_drops_the_appended_eos(tiny_model):
    tokenizer = load_tokenizer(str(tiny_model))
    ids, mask = encode_prompts(tokenizer, [{"prompt": "ab"}, {"prompt": "abcd"}], "cpu")
    # ByT5: byte b → id b + 3; 'a' = 97 → 100. Its trailing EOS (1) is dropped; pad is 0.
    assert ids.tolist() == [[0, 0, 100, 101], [100, 101, 102, 103]]
    assert mask.tolist() == [[0, 0, 1, 1], [1, 1, 1, 1]]


def test_python_reward_passes_columns_it_accepts(tmp_path):
    module = tmp_path / "my_reward.py"
    module.write_text("def score(prompts, responses, target):\n    return [float(r == t) for r, t in zip(responses, target)]\n")
    reward = PythonReward(PythonRewardConfig(function=f"{module}:score"))
    assert reward.score(["p", "q"], ["x", "y"], target=["x", "z"], unused=[1, 2]) == [1.0, 0.0]


def test_python_reward_bad_specs_are_located(tmp_path):
    with pytest.raises(RecipeError, match=r"\$.reward.function: expected 'module:function'"):
        PythonReward(PythonRewardConfig(function="no_colon"))
    with pytest.raises(RecipeError, match="no file"):
        PythonReward(PythonRewardConfig(function=f"{tmp_path}/missing.py:f"))
    with pytest.raises(RecipeError, match="has no function 'nope'"):
        PythonReward(PythonRewardConfig(function="json:nope"))
    module = tmp_path / "narrow.py"
    module.write_text("def f(texts):\n    return []\n")
    with pytest.raises(RecipeError, match="must accept keyword arguments prompts and responses"):
        PythonReward(PythonRewardConfig(function=f"{module}:f"))


def test_python_reward_check_reads_the_source_and_runs_none_of_it(tmp_path, monkeypatch):
    """`rlkit check` finds the function in a package without running the package's __init__."""
    package = tmp_path / "acme_rewards"
    package.mkdir()
    (package / "__init__.py").write_text(f"open({str(tmp_path / 'ran')!r}, 'w').close()\n")
    (package / "scores.py").write_text("from json import loads as parsed\n\nmade = parsed\n\n"
                                       "def good(prompts, responses, **columns):\n    return []\n\n"
                                       "def narrow(texts):\n    return []\n")
    monkeypatch.syspath_prepend(str(tmp_path))

    def check(name):
        return PythonReward.check(PythonRewardConfig(function=f"acme_rewards.scores:{name}"), recipe=None, where="$.reward")

    assert check("good") == ([], [])
    problems, _ = check("narrow")
    assert problems == ["$.reward.function: acme_rewards.scores:narrow must accept keyword arguments prompts and responses "
                        "(missing: prompts, responses); add **columns to receive the data's other columns"]
    for made_at_import in ("made", "parsed"):  # only running the module would show their signatures
        assert check(made_at_import) == ([], [f"$.reward.function: {made_at_import!r} in {str(package / 'scores.py')!r} is not "
                                              "a plain def; its signature is checked when rlkit run imports it"])
    problems, _ = check("missing")
    assert problems == [f"$.reward.function: {str(package / 'scores.py')!r} has no function 'missing' (functions defined there: good, narrow)"]
    assert not (tmp_path / "ran").exists()


def test_reward_results_are_checked():
    assert checked_scores(torch.tensor([1, 2]), 2) == [1.0, 2.0]
    with pytest.raises(ValueError, match="returned 1 scores for 2 responses"):
        checked_scores([1.0], 2)
    with pytest.raises(ValueError, match=r"not a finite float32 number \(nan\) for response 1"):
        checked_scores([1.0, float("nan")], 2)
    with pytest.raises(ValueError, match=r"not a finite float32 number \(1e\+300\)"):
        checked_scores([1e300, 0.0], 2)  # finite in Python, inf once it is a float32 tensor
    with pytest.raises(ValueError, match="returned \\['high', 'low'\\], not a list of numbers"):
        checked_scores(["high", "low"], 2)
    with pytest.raises(ValueError, match="returned None, not a list of numbers"):
        checked_scores(None, 2)


def test_jsonl_errors_name_the_line(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "a"}) + "\n" + json.dumps({"text": "b"}) + "\n")
    with pytest.raises(RecipeError, match=r"p.jsonl:2: has no field 'prompt' and no `messages` \(fields: text\); set data.prompt_field"):
        JsonlPrompts(JsonlConfig(path=str(path))).load()
    path.write_text("{not json\n")
    with pytest.raises(RecipeError, match=r"p.jsonl:1: not valid JSON"):
        JsonlPrompts(JsonlConfig(path=str(path))).load()


def test_jsonl_keeps_other_columns(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"text": "a", "reference": "r"}) + "\n")
    assert JsonlPrompts(JsonlConfig(path=str(path), prompt_field="text")).load() == [{"prompt": "a", "reference": "r"}]


@pytest.fixture
def local_dataset(tmp_path):
    """A data set folder with two configurations, as a hub data set's README declares them."""
    import pandas

    folder = tmp_path / "dataset"
    (folder / "short").mkdir(parents=True)
    for split, count in (("train", 5), ("test", 3)):
        rows = [{"query": f"{split} document {i}", "summary": f"{split} {i}"} for i in range(count)]
        (folder / "short" / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "long.jsonl").write_text((json.dumps({"query": "a long document", "summary": "long"}) + "\n") * 4)
    pandas.DataFrame({"query": ["a parquet document"] * 4, "summary": ["p"] * 4}).to_parquet(tmp_path / "rows.parquet")
    (folder / "README.md").write_text(
        "---\nconfigs:\n- config_name: short\n  data_files:\n  - split: train\n    path: short/train.jsonl\n"
        "  - split: test\n    path: short/test.jsonl\n- config_name: long\n  data_files: long.jsonl\n---\n")
    return folder


def hf_dataset(**settings):
    from rlkit_plugins.prompt_sources import HFDatasetConfig, HFDatasetPrompts

    return HFDatasetPrompts(HFDatasetConfig(**settings)).load()


def test_hf_dataset_reads_a_named_configuration_and_split_with_renamed_fields(local_dataset):
    records = hf_dataset(path=str(local_dataset), name="short", split="test", prompt_field="query", fields={"reference": "summary"})
    assert records == [{"prompt": f"test document {i}", "reference": f"test {i}"} for i in range(3)]
    long = hf_dataset(path=str(local_dataset), name="long", prompt_field="query", limit=2)
    assert [r["prompt"] for r in long] == ["a long document"] * 2


def test_hf_dataset_reads_local_json_and_parquet_files(local_dataset):
    json_records = hf_dataset(path="json", data_files=[str(local_dataset / "short" / "train.jsonl")], prompt_field="query")
    assert len(json_records) == 5 and json_records[0]["summary"] == "train 0"
    parquet_records = hf_dataset(path="parquet", data_files=[str(local_dataset.parent / "rows.parquet")], prompt_field="query")
    assert len(parquet_records) == 4


def test_hf_dataset_errors_name_the_field_or_split(local_dataset):
    with pytest.raises(RecipeError, match=r"\$\.data\.fields: no column 'headline' in .* \(columns: query, summary\)"):
        hf_dataset(path=str(local_dataset), name="short", prompt_field="query", fields={"reference": "headline"})
    with pytest.raises(RecipeError, match=r"\$\.data: cannot load .* \(split 'validation'\)"):
        hf_dataset(path=str(local_dataset), name="short", split="validation", prompt_field="query")
