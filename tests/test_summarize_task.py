"""The miniature summarisation task, its ROUGE reward, and the warm-start builder."""

from __future__ import annotations

import math
from functools import partial

import pytest
from rlkit_plugins import summarize_task as st
from rlkit_plugins import warm_start as ws
from rlkit_plugins.summarize import SummarizerConfig, WarmStartSummarizer

REF = "The baker sold bread in Paris."  # words: the baker sold bread in paris (6)


# --- ROUGE, against values worked out by hand -------------------------------------------------


def test_rouge1_identical_and_case_punctuation_insensitive():
    assert st.rouge_n_f1(REF, REF) == 1.0
    # "The, BAKER!!" -> [the, baker]; same two words as the reference "the baker".
    assert st.rouge_n_f1("The, BAKER!!", "the baker") == 1.0


def test_rouge1_partial_overlap():
    # candidate words: the cook sold fish in paris (6); shared with the reference: the, sold, in,
    # paris = 4. P = 4/6, R = 4/6, F1 = 2/3.
    assert st.rouge_n_f1("the cook sold fish in paris", REF) == pytest.approx(2 / 3)


def test_rouge1_clips_repeated_words():
    # candidate "the the the": count(the) = 3; reference "the cat": count(the) = 1.
    # clipped overlap = min(3, 1) = 1; P = 1/3, R = 1/2; F1 = 2·(1/3)(1/2) / (1/3 + 1/2) = (1/3)/(5/6) = 2/5.
    assert st.rouge_n_f1("the the the", "the cat") == pytest.approx(0.4)


def test_rouge2():
    # candidate bigrams: (the baker) (baker sold) (sold fish) = 3.
    # reference "the baker sold bread in paris" bigrams: (the baker) (baker sold) (sold bread)
    # (bread in) (in paris) = 5. Shared: 2. P = 2/3, R = 2/5; F1 = 2·(4/15) / (16/15) = 1/2.
    assert st.rouge_n_f1("the baker sold fish", REF, n=2) == pytest.approx(0.5)


def test_rouge_l_order_matters():
    # The reference's six distinct words reversed: every unigram matches (ROUGE-1 = 1), but the
    # longest common subsequence of a sequence of distinct words and its reverse is 1 word:
    # P = 1/6, R = 1/6, F1 = 1/6.
    reversed_ref = "paris in bread sold baker the"
    assert st.rouge_n_f1(reversed_ref, REF) == 1.0
    assert st.rouge_l_f1(reversed_ref, REF) == pytest.approx(1 / 6)


def test_rouge_l_partial():
    # candidate: the cook sold bread yesterday in rome (7 words); LCS with the reference
    # = the, sold, bread, in = 4. P = 4/7, R = 4/6; F1 = 2·(16/42) / (4/7 + 2/3) = (16/21)/(26/21) = 8/13.
    assert st.rouge_l_f1("the cook sold bread yesterday in rome", REF) == pytest.approx(8 / 13)


def test_rouge_empty_sides_score_zero():
    assert st.rouge_n_f1("", REF) == 0.0
    assert st.rouge_l_f1("", REF) == 0.0
    assert st.rouge_n_f1("...", REF) == 0.0
    assert st.rouge_n_f1("a", "a", n=2) == 0.0  # no bigram on either side


# --- the reward ---------------------------------------------------------------------------------


def test_summary_reward_values_and_mix():
    assert st.summary_reward(REF, REF) == 1.0
    assert st.summary_reward("", REF) == 0.0
    assert st.summary_reward("the cook sold fish in paris", REF) == pytest.approx(2 / 3)
    # reversed reference, half ROUGE-L: 0.5·1 + 0.5·(1/6) = 7/12.
    assert st.summary_reward("paris in bread sold baker the", REF, rouge_l_weight=0.5) == pytest.approx(7 / 12)
    with pytest.raises(ValueError):
        st.summary_reward(REF, REF, rouge_l_weight=1.5)


def test_summary_reward_range_on_many_responses():
    records = st.make_corpus(200, seed=3)
    candidates = [r["document"] for r in records] + [r["reference"] for r in records] + ["", "x" * 300]
    for i, record in enumerate(records):
        for response in (candidates[i], candidates[(i + 1) % len(candidates)], candidates[-1]):
            value = st.summary_reward(response, record["reference"])
            assert 0.0 <= value <= 1.0 and math.isfinite(value)


# --- the corpus ---------------------------------------------------------------------------------


def test_corpus_is_deterministic_and_seed_dependent():
    assert st.make_corpus(50, seed=7) == st.make_corpus(50, seed=7)
    assert st.make_corpus(50, seed=7) != st.make_corpus(50, seed=8)
    assert st.make_corpus(20, seed=7) == st.make_corpus(50, seed=7)[:20]


def test_corpus_records_are_well_formed():
    for record in st.make_corpus(500, seed=0) + st.make_corpus(100, seed=0, split="eval"):
        assert set(record) == {"prompt", "document", "reference"}
        assert record["prompt"] == record["document"] + st.PROMPT_SEPARATOR
        assert len(record["document"].encode()) <= st.MAX_DOCUMENT_BYTES
        assert 2 <= record["document"].count(".") <= 3  # 2-3 sentences
        words = st.words(record["reference"])
        assert len(words) == 6 and words[0] == "the" and words[4] == "in"
        who, _, what, where = words[1], words[2], words[3], words[5]
        document = record["document"].lower()
        assert who in document and what in document and where in document


def test_key_sentence_position_and_phrasing_vary():
    records = st.make_corpus(300, seed=1)
    starts_with_reference = sum(r["document"].startswith(r["reference"]) for r in records)
    contains_reference = sum(r["reference"] in r["document"] for r in records)
    assert starts_with_reference < len(records) / 4  # not a fixed slice at the front
    assert contains_reference < len(records) / 2  # mostly rephrased, not copied verbatim


def test_train_and_eval_share_no_fact():
    train = st.make_corpus(5000, seed=0)
    evaluation = st.make_corpus(500, seed=0, split="eval")  # same seed on purpose
    # The reference spells out the whole fact (who, verb, object, city).
    assert not {r["reference"] for r in train} & {r["reference"] for r in evaluation}
    assert not {r["document"] for r in train} & {r["document"] for r in evaluation}
    with pytest.raises(ValueError):
        st.make_corpus(1, seed=0, split="test")


def test_filler_sentences_are_the_ones_without_the_event():
    record = {"document": "It rained in Lima. The guard had left Berlin. Yesterday the lawyer hid cheese in Dublin.",
              "reference": "The lawyer hid cheese in Dublin."}
    assert st.filler_sentences(record) == ["It rained in Lima.", "The guard had left Berlin."]
    for record in st.make_corpus(300, seed=4):
        fillers = st.filler_sentences(record)
        assert 1 <= len(fillers) <= 2 and all(filler in record["document"] for filler in fillers)
        assert len(record["document"].split(". ")) == len(fillers) + 1  # every other sentence is the event


# --- the warm start -----------------------------------------------------------------------------

TINY = dict(n_layer=1, n_embd=32, n_head=2, sft_steps=5, batch_size=4, lr=1e-3, seed=0, corpus_size=16)


def summaries(filler_share: float = 0.0):
    """The summarizer's (examples, corpus), as `warm-start-summarizer` builds with them."""
    config = SummarizerConfig(sft_filler_share=filler_share)
    return partial(WarmStartSummarizer.examples, config), WarmStartSummarizer.corpus(config)


def built_here(folder) -> list[str]:
    """What a build left in `folder`, besides the lock file that builders of one folder share."""
    return sorted(p.name for p in folder.iterdir() if not p.name.endswith(".lock"))


def test_tiny_warm_start_builds_loads_and_is_reused(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = ws.build_warm_start(tmp_path / "policy", *summaries(), **TINY)
    assert out == tmp_path / "policy"
    assert built_here(tmp_path) == ["policy"]  # no temp dir left behind

    model = AutoModelForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert model.config.vocab_size == 384 and model.config.n_positions == 256
    assert (model.config.pad_token_id, model.config.eos_token_id, model.config.bos_token_id) == (0, 1, 1)
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id) == (0, 1)


    # Same settings: reused, not rebuilt. Other settings: rebuilt in place.
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    assert ws.build_warm_start(out, *summaries(), **TINY) == out
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp
    ws.build_warm_start(out, *summaries(), **{**TINY, "sft_steps": 2})
    assert '"sft_steps": 2' in (out / ws.MARKER_FILE).read_text()
    assert built_here(tmp_path) == ["policy"]


def test_supervised_summaries_go_on_with_filler_at_the_share_asked():
    import random

    from rlkit_plugins.summarize import summary_examples

    tokenizer = ws._tokenizer()
    records = st.make_corpus(2000, seed=0)

    def summaries(share):
        examples = summary_examples(tokenizer, records, share, random.Random(0))
        assert all(ids[-1] == ws.EOS_ID for ids, _ in examples)
        return [tokenizer.decode([i for i, counted in zip(ids[:-1], counts) if counted]) for ids, counts in examples]

    assert summaries(0.0) == [r["reference"] for r in records]
    for text, r in zip(summaries(1.0), records):
        assert text.startswith(r["reference"] + " ") and text[len(r["reference"]) + 1:] in st.filler_sentences(r)
    careless = sum(text != r["reference"] for text, r in zip(summaries(0.75), records))
    assert 1440 <= careless <= 1560  # 1500 expected; binomial sd 19


def test_filler_share_is_part_of_the_build_settings(tmp_path):
    out = ws.build_warm_start(tmp_path / "policy", *summaries(), **TINY)
    ws.build_warm_start(out, *summaries(0.5), **TINY)
    assert '"filler_share": 0.5' in (out / ws.MARKER_FILE).read_text()
    with pytest.raises(ValueError, match="between 0.0 and 1.0"):
        SummarizerConfig(sft_filler_share=1.5)


def test_warm_start_is_deterministic(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    a = AutoModelForCausalLM.from_pretrained(ws.build_warm_start(tmp_path / "a", *summaries(), **TINY))
    b = AutoModelForCausalLM.from_pretrained(ws.build_warm_start(tmp_path / "b", *summaries(), **TINY))
    for (name, pa), (_, pb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(pa, pb), name


def test_building_the_warm_start_leaves_the_callers_random_stream_alone(tmp_path):
    """A run that builds the warm start draws the same numbers afterwards as one that finds it cached."""
    import torch

    torch.manual_seed(3)
    cached_run_draw = torch.rand(4)
    torch.manual_seed(3)
    ws.build_warm_start(tmp_path / "policy", *summaries(), **TINY)
    assert torch.equal(torch.rand(4), cached_run_draw)


def test_interrupted_build_leaves_nothing(tmp_path, monkeypatch):
    from transformers import GPT2LMHeadModel

    def interrupted(self, path, *args, **kwargs):
        (path / "partial.bin").write_bytes(b"half a model")
        raise KeyboardInterrupt

    monkeypatch.setattr(GPT2LMHeadModel, "save_pretrained", interrupted)
    with pytest.raises(KeyboardInterrupt):
        ws.build_warm_start(tmp_path / "policy", *summaries(), **TINY)
    assert built_here(tmp_path) == []


def test_foreign_directory_is_never_overwritten(tmp_path):
    (tmp_path / "policy").mkdir()
    (tmp_path / "policy" / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError):
        ws.build_warm_start(tmp_path / "policy", *summaries(), **TINY)
    assert (tmp_path / "policy" / "keep.txt").read_text() == "mine"


def test_rouge_reward_names_a_missing_reference_column():
    from rlkit_plugins.summarize import Rouge, RougeConfig

    from rlkit_core.errors import RecipeError

    with pytest.raises(RecipeError, match=r"\$.reward.reference_field: the data has no column 'reference' \(columns: summary\)"):
        Rouge(RougeConfig()).score(["p"], ["r"], summary=["s"])


def test_warm_start_n_head_must_divide_width(tmp_path):
    from rlkit_core.errors import RecipeError

    with pytest.raises(RecipeError, match=r"\$.policy.n_head: 3 does not divide n_embd=16"):
        WarmStartSummarizer(SummarizerConfig(cache_dir=str(tmp_path), n_embd=16, n_head=3), None)


def test_fact_copied_needs_every_part_of_the_fact():
    from rlkit_plugins.summarize_task import fact_copied

    reference = "The pilot cooked boxes in Berlin."
    assert fact_copied("The pilot cooked boxes in Berlin.", reference) == 1.0
    assert fact_copied("In Berlin the pilot cooked boxes, they say.", reference) == 1.0  # order and extra words are free
    assert fact_copied("The pilot cooked boxes in Sofia.", reference) == 0.0  # wrong place
    assert fact_copied("The pilot cooked boks in Berlin.", reference) == 0.0  # a misspelt word is not a copy
    assert fact_copied("", reference) == 0.0


def test_exact_summary_is_the_reference_word_for_word():
    from rlkit_plugins.summarize import ExactSummary, ReferenceMetricConfig

    reference = "The pilot cooked boxes in Berlin."
    assert st.exact_summary("the pilot cooked boxes in berlin", reference) == 1.0  # case and punctuation aside
    assert st.exact_summary("The pilot cooked boxes in Berlin. The sky was grey.", reference) == 0.0  # filler after the fact
    assert st.exact_summary("In Berlin the pilot cooked boxes.", reference) == 0.0  # every word, another order
    assert ExactSummary(ReferenceMetricConfig()).score(["p", "p"], ["The pilot cooked boxes in Berlin.", "The pilot"],
                                                       reference=[reference, reference]) == [1.0, 0.0]


def test_rouge_fact_bonus_is_added_only_for_a_whole_fact():
    from rlkit_plugins.summarize import Rouge, RougeConfig

    reward = Rouge(RougeConfig(fact_bonus=0.5))
    reference = "The pilot cooked boxes in Berlin."
    scores = reward.score(["p", "p"], ["The pilot cooked boxes in Berlin.", "The pilot cooked boxes in Sofia."],
                          reference=[reference, reference])
    assert scores[0] == 1.5  # ROUGE-1 F1 of 1 plus the bonus
    assert scores[1] == pytest.approx(5 / 6)  # 5 of 6 words match, no bonus


BUILDER = """
import sys, time
from functools import partial
from pathlib import Path
from rlkit_plugins import warm_start as ws
from rlkit_plugins.summarize import SummarizerConfig, WarmStartSummarizer

folder, me = Path(sys.argv[1]), sys.argv[2]

class StepLog:  # records every SFT step this process runs
    def show(self, step, text):
        with open(folder / "steps.log", "a") as log:
            log.write(me + "\\n")
    def close(self):
        pass

(folder / f"ready-{me}").touch()
while len(list(folder.glob("ready-*"))) < 2:  # both processes start building together
    time.sleep(0.01)
config = SummarizerConfig()
ws.build_warm_start(folder / "policy", partial(WarmStartSummarizer.examples, config), WarmStartSummarizer.corpus(config),
                    progress=StepLog(), **%r)
"""


@pytest.mark.slow
def test_two_processes_building_one_folder_build_it_once(tmp_path):
    """The processes of a torchrun launch all build the warm start on first use: one builds, the
    other waits and reuses it (without the lock, both trained and one swapped the folder away
    under the other's loader)."""
    import subprocess
    import sys

    script = BUILDER % (TINY,)
    builders = [subprocess.Popen([sys.executable, "-c", script, str(tmp_path), str(i)], stderr=subprocess.PIPE, text=True)
                for i in range(2)]
    errors = [b.communicate(timeout=120)[1] for b in builders]
    assert [b.returncode for b in builders] == [0, 0], errors
    steps = (tmp_path / "steps.log").read_text().split()
    assert len(steps) == TINY["sft_steps"] and len(set(steps)) == 1  # one process ran SFT, once
    assert (tmp_path / "policy" / ws.MARKER_FILE).exists()


def test_default_recipe_shrunk_runs_on_its_careless_warm_start(tmp_path):
    """The shipped default recipe, shrunk: its warm start is built with the filler share it asks for."""
    import io
    import json
    from pathlib import Path

    from rlkit_core.recipe.document import load_recipe
    from rlkit_core.recipe.plugins import load_registry
    from rlkit_core.runtime.run import run_recipe

    overrides = [
        "run.steps=2", f"run.output_dir={tmp_path / 'run'}", "run.threads=1", "tracker.type=none",
        "policy.n_layer=1", "policy.n_embd=16", "policy.n_head=2", "policy.sft_steps=2", "policy.sft_batch_size=4",
        f"policy.cache_dir={tmp_path / 'cache'}", "generator.max_new_tokens=6", "data.size=40", "eval.size=4",
        "ppo.batch_size=8", "ppo.minibatch_size=4",
    ]
    recipe = load_recipe(Path(__file__).parent.parent / "recipes" / "ppo_summarize.toml",
                         load_registry(environ={"RLKIT_PLUGINS": "none"}), overrides)
    history = run_recipe(recipe, quiet=True, out=io.StringIO())
    assert [row["iteration"] for row in history] == [0, 1, 2]
    [built] = (tmp_path / "cache").glob("summarizer-*")
    assert built.name == "summarizer-l1-d16-h2-s2-f0.75-seed0"
    assert json.loads((built / ws.MARKER_FILE).read_text())["settings"]["filler_share"] == 0.75


def test_the_guessers_games_count_only_the_guesses_and_their_end_tokens():
    from rlkit_plugins import guess_number

    tokenizer = ws._tokenizer()
    examples = guess_number.sft_examples(tokenizer, 200, seed=0)
    for ids, counted in examples:
        assert len(ids) == len(counted) <= ws.N_POSITIONS and not counted[0]
        text = tokenizer.decode([i for i, c in zip(ids, counted) if c and i != ws.EOS_ID])
        assert text.isdigit()  # the guesses alone
        assert sum(c and i == ws.EOS_ID for i, c in zip(ids, counted)) == sum(i == ws.EOS_ID for i in ids)  # every end token counts
    # the environment's answers are in the stream as the episodes render them
    first = tokenizer.decode(examples[0][0])
    assert first.startswith("Guess my number, 1-16.\n") and ("higher: " in first or "lower: " in first or first.count("</s>") == 1)
