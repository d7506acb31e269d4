"""Real-model tokenizers, built offline (rlkit_core.testing.offline_models): no PAD or PAD = EOS (GPT-2,
Pythia), several end ids and a chat template (Llama 3), a reward model with a tokenizer of its
own, and a hub-style generation_config.json with sampling defaults."""

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from rlkit_core.errors import RecipeError
from rlkit_core.recipe.document import parse_recipe
from rlkit_core.runtime.forward import response_view, rows_of
from rlkit_core.runtime.trainer import Trainer
from rlkit_core.testing.offline_models import write_tiny_model
from tests.test_trainer import advantages_with, rollout_with, update_with

RM_TEMPLATE = "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"


@pytest.fixture(scope="session")
def gpt2_lm(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("gpt2-style"), "gpt2")


@pytest.fixture(scope="session")
def chat_lm(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("chat-style"), "chat")


@pytest.fixture(scope="session")
def gpt2_classifier(tmp_path_factory):
    """Shares the GPT-2-style vocabulary; its tokenizer carries a chat template unlike the chat
    policy's, so it also serves as a reward model with a tokenizer of its own."""
    from transformers import AutoTokenizer

    path = write_tiny_model(tmp_path_factory.mktemp("gpt2-classifier"), "gpt2", classifier=True)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = RM_TEMPLATE
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def chat_classifier(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("chat-classifier"), "chat", classifier=True)


@pytest.fixture(scope="session")
def chat_prompts(tmp_path_factory):
    path = tmp_path_factory.mktemp("chat-data") / "chats.jsonl"
    with path.open("w") as out:
        for i in range(16):
            messages = [{"role": "system", "content": "be brief" + " please" * (i % 5)},
                        {"role": "user", "content": f"write a happy sentence number {i}"}]
            out.write(json.dumps({"messages": messages, "topic": "happy", "letter": "e"}) + "\n")
    return path


def document(base, **tables):
    base = {k: dict(v) for k, v in base.items()}
    for table, values in tables.items():
        if "type" in values:  # another component: its table starts afresh
            base[table] = {}
        base.setdefault(table, {}).update(values)
    return base


# --- no PAD: rlkit adds one that no model ever sees and the policy never samples ----------------


def test_padless_tokenizer_gets_a_pad_that_is_never_sampled(recipe_document, builtin_registry, gpt2_lm):
    from transformers import AutoTokenizer

    original = AutoTokenizer.from_pretrained(gpt2_lm)
    assert original.pad_token_id is None
    trainer = Trainer(parse_recipe(document(recipe_document, policy={"model": str(gpt2_lm)},
                                            generator={"max_new_tokens": 32, "temperature": 2.0},
                                            ppo={"batch_size": 64, "minibatch_size": 32}), builtin_registry))
    tokenizer, policy = trainer.components.policy.tokenizer, trainer.components.policy
    assert tokenizer.pad_token_id == len(original) and tokenizer.pad_token_id not in policy.eos_token_ids
    assert policy.suppressed_token_ids == (tokenizer.pad_token_id,)
    assert policy.model.get_input_embeddings().num_embeddings == len(original) + 1  # no spare row: one added
    batch = advantages_with(trainer, rollout_with(trainer, trainer.stream.batch(0))[0])
    counted = batch.response_mask.bool()
    # 2048 draws at T=2: a PAD row in the softmax (p ≈ 1/320 each) would show up almost surely.
    assert counted.sum() > 1000 and not (batch.response_ids[counted] == tokenizer.pad_token_id).any()
    assert (batch.old_logprobs - batch.sampled_logprobs)[counted].abs().max() < 1e-4


def test_spare_embedding_rows_take_the_pad_without_a_resize(recipe_document, builtin_registry, chat_lm):
    from transformers import AutoConfig

    rows = AutoConfig.from_pretrained(chat_lm).vocab_size
    trainer = Trainer(parse_recipe(document(recipe_document, policy={"model": str(chat_lm)}), builtin_registry))
    assert trainer.components.policy.model.get_input_embeddings().num_embeddings == rows
    assert trainer.components.policy.tokenizer.pad_token_id < rows


def test_separate_critic_reads_a_padless_policys_ids(recipe_document, builtin_registry, gpt2_lm, gpt2_classifier):
    trainer = Trainer(parse_recipe(document(recipe_document, policy={"model": str(gpt2_lm)},
                                            value_head={"type": "separate", "model": str(gpt2_classifier)}), builtin_registry))
    assert trainer.components.policy.tokenizer.pad_token_id >= trainer.components.value_head.model.get_input_embeddings().num_embeddings
    batch = advantages_with(trainer, rollout_with(trainer, trainer.stream.batch(0))[0])
    assert update_with(trainer, batch)["train/value_loss"] > 0


def test_critic_with_another_vocabulary_is_refused_at_build_and_by_check(recipe_document, builtin_registry, gpt2_lm, chat_classifier):
    from rlkit_core.recipe.plan import describe_plan

    recipe = parse_recipe(document(recipe_document, policy={"model": str(gpt2_lm)},
                                   value_head={"type": "separate", "model": str(chat_classifier)}), builtin_registry)
    with pytest.raises(RecipeError, match=r"\$\.value_head\.model: .*vocabulary is not the policy's .*value_head.type = 'shared'"):
        describe_plan(recipe)
    with pytest.raises(RecipeError, match=r"\$\.value_head\.model: .*vocabulary is not the policy's"):
        Trainer(recipe)


# --- several end ids: a response that ends on the other one has ended ----------------------------


def test_a_response_ending_on_the_second_end_id_counts_as_ended(recipe_document, builtin_registry, chat_lm):
    trainer = Trainer(parse_recipe(document(recipe_document, policy={"model": str(chat_lm)},
                                            ppo={"missing_eos_penalty": 1.0}), builtin_registry))
    tokenizer = trainer.components.policy.tokenizer
    end_of_turn = tokenizer.convert_tokens_to_ids("<|eot_id|>")
    assert trainer.components.policy.eos_token_ids == (tokenizer.eos_token_id, end_of_turn)

    def favour_end_of_turn(module, inputs, output):
        output[..., end_of_turn] += 50.0
        return output

    trainer.components.policy.model.lm_head.register_forward_hook(favour_end_of_turn)
    batch = advantages_with(trainer, rollout_with(trainer, trainer.stream.batch(0))[0])
    assert (batch.response_ids[:, 0] == end_of_turn).all() and (batch.response_mask.sum(dim=1) == 1).all()
    assert batch.ended.all()
    assert torch.allclose(batch.rewards[:, 0], batch.scores - trainer.components.kl.beta * batch.kl[:, 0])  # no missing-EOS penalty


def test_end_tokens_from_the_recipe_join_the_end_ids(recipe_document, builtin_registry, gpt2_lm, chat_lm):
    trainer = Trainer(parse_recipe(document(recipe_document, policy={"model": str(chat_lm), "end_tokens": ["<|start_header_id|>"]}), builtin_registry))
    assert trainer.components.policy.eos_token_ids[-1] == trainer.components.policy.tokenizer.convert_tokens_to_ids("<|start_header_id|>")
    with pytest.raises(RecipeError, match=r"\$\.policy\.end_tokens: '<\|im_end\|>' is not a token of the policy's tokenizer"):
        Trainer(parse_recipe(document(recipe_document, policy={"model": str(gpt2_lm), "end_tokens": ["<|im_end|>"]}), builtin_registry))


# --- sampling is exactly π/T whatever the checkpoint's generation_config says --------------------


@pytest.fixture(scope="session")
def opinionated_lm(tmp_path_factory):
    """A GPT-2-style model whose generation_config.json would forbid any repeated token and keep
    only the two likeliest: what a hub checkpoint's sampling defaults can do."""
    from transformers import AutoModelForCausalLM

    path = write_tiny_model(tmp_path_factory.mktemp("opinionated"), "gpt2")
    model = AutoModelForCausalLM.from_pretrained(path)
    model.generation_config.update(no_repeat_ngram_size=1, repetition_penalty=5.0, top_k=2, do_sample=True)
    model.save_pretrained(path)
    return path


def test_checkpoint_sampling_defaults_are_ignored(recipe_document, builtin_registry, opinionated_lm):
    trainer = Trainer(parse_recipe(document(recipe_document, policy={"model": str(opinionated_lm)},
                                            generator={"max_new_tokens": 32, "temperature": 2.0},
                                            ppo={"batch_size": 32, "minibatch_size": 16}), builtin_registry))
    batch = advantages_with(trainer, rollout_with(trainer, trainer.stream.batch(0))[0])
    counted = batch.response_mask.bool()
    rows = [ids[mask].tolist() for ids, mask in zip(batch.response_ids, counted)]
    # Pure sampling of 32 tokens from ~320 repeats a token in most rows; no_repeat_ngram_size=1 never would.
    assert any(len(set(row)) < len(row) for row in rows)
    # The sampler's log-probs are read after every processor: they equal π/T only if none applied.
    assert (batch.old_logprobs - batch.sampled_logprobs)[counted].abs().max() < 1e-4


def test_top_k_asked_for_shows_in_the_logprob_gap(recipe_document, builtin_registry, gpt2_lm):
    trainer = Trainer(parse_recipe(document(recipe_document, policy={"model": str(gpt2_lm)},
                                            generator={"max_new_tokens": 16, "temperature": 2.0, "top_k": 5}), builtin_registry))
    metrics = trainer.step()
    assert metrics["check/logprob_gap"] > 0.05  # the sampler renormalises over 5 of ~320 tokens


# --- KL in the loss, entropy ---------------------------------------------------------------------


def test_full_estimator_in_the_loss_is_refused(recipe_document, builtin_registry):
    with pytest.raises(RecipeError, match=r'\$\.ppo\.kl_estimator: "full" .* use "k3"'):
        parse_recipe(document(recipe_document, ppo={"kl_penalty": "loss", "kl_estimator": "full"}), builtin_registry)


def test_check_warns_on_k1_in_the_loss(recipe_document, builtin_registry):
    from rlkit_core.recipe.plan import describe_plan

    plan = describe_plan(parse_recipe(document(recipe_document, ppo={"kl_penalty": "loss", "kl_estimator": "k1"}), builtin_registry))
    assert "warnings:" in plan and "zero expected gradient" in plan
    assert "warnings:" not in describe_plan(parse_recipe(document(recipe_document, ppo={"kl_penalty": "loss", "kl_estimator": "k3"}), builtin_registry))


@pytest.mark.parametrize("coef, graphed", [(0.0, False), (0.01, True)])
def test_entropy_keeps_a_graph_only_when_the_loss_uses_it(recipe_document, builtin_registry, coef, graphed):
    trainer = Trainer(parse_recipe(document(recipe_document, loss={"entropy_coef": coef}), builtin_registry))
    batch = advantages_with(trainer, rollout_with(trainer, trainer.stream.batch(0))[0])
    _, _, entropy, _ = response_view(trainer.components, batch, rows_of(batch, trainer.recipe.ppo.pack_sequences), grad=True)
    assert entropy.requires_grad is graphed
    assert torch.isfinite(entropy).all()


# --- chat prompts, and a reward model with its own tokenizer --------------------------------------


def test_chat_records_render_with_the_policys_template_and_rewards_see_text_and_messages(
        recipe_document, builtin_registry, chat_lm, chat_prompts, tmp_path):
    seen = tmp_path / "seen.json"
    reward = tmp_path / "chat_reward.py"
    reward.write_text(f"import json\ndef score(prompts, responses, messages, topic):\n"
                      f"    open({str(seen)!r}, 'w').write(json.dumps({{'prompt': prompts[0], 'messages': messages[0], 'topic': topic[0]}}))\n"
                      f"    return [float(len(r)) for r in responses]\n")
    trainer = Trainer(parse_recipe(document(recipe_document, policy={"model": str(chat_lm)},
                                            reward={"function": f"{reward}:score"},
                                            data={"path": str(chat_prompts)}, ppo={"batch_size": 8, "minibatch_size": 4}), builtin_registry))
    trainer.step()
    got = json.loads(seen.read_text())
    assert got["prompt"].startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>")
    assert got["prompt"].endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert got["messages"][1]["role"] == "user" and got["topic"] == "happy"
    ids = trainer.components.policy.tokenizer(got["prompt"], add_special_tokens=False)["input_ids"]
    assert ids.count(trainer.components.policy.tokenizer.bos_token_id) == 1  # the template's BOS, not a second one


def test_reward_model_rerenders_the_conversation_with_its_own_template(chat_classifier, gpt2_classifier):
    from rlkit_plugins.rewards import RewardModel, RewardModelConfig

    class Context:
        device = torch.device("cpu")

    messages = [{"role": "user", "content": "hello world"}]
    model = RewardModel(RewardModelConfig(model=str(gpt2_classifier)), Context())
    ids = model.token_ids("<|start_header_id|>user...", "fine, thanks", messages)
    assert model.tokenizer.decode(ids) == "user: hello world\nassistant: fine, thanks\n"
    plain = model.token_ids("hello ", "world", None)
    assert model.tokenizer.decode(plain) == "hello world"
    scores = model.score(["a", "b"], ["fine", "thanks"], messages=[messages, messages])
    assert len(scores) == 2


def test_reward_model_with_a_tokenizer_too_big_for_it_is_refused(gpt2_classifier, tiny_model):
    from rlkit_plugins.rewards import RewardModel, RewardModelConfig

    class Context:
        device = torch.device("cpu")

    with pytest.raises(RecipeError, match=r"\$\.reward\.tokenizer: .* tokens but the reward model's embedding has \d+ rows"):
        RewardModel(RewardModelConfig(model=str(gpt2_classifier), tokenizer=str(tiny_model)), Context())  # 384 byte ids


# --- prompt length ---------------------------------------------------------------------------------


@pytest.mark.parametrize("truncate, kept, cut, skipped", [("left", 16, 9, 0), ("skip", 7, 0, 9)])
def test_long_prompts_are_cut_or_skipped_and_counted(recipe_document, builtin_registry, chat_lm, chat_prompts, truncate, kept, cut, skipped):
    trainer = Trainer(parse_recipe(document(recipe_document, policy={"model": str(chat_lm)},
                                            data={"path": str(chat_prompts), "max_prompt_tokens": 70, "truncate": truncate}), builtin_registry))
    assert trainer.prompts.counts == {"loaded": 16, "cut": cut, "skipped": skipped, "empty": 0}
    assert len(trainer.prompts.train) == kept
    batch, _ = rollout_with(trainer, trainer.stream.batch(0))
    assert batch.prompt_ids.shape[1] <= 70


def test_a_too_long_prompt_with_truncate_error_names_the_record(recipe_document, builtin_registry, chat_lm, chat_prompts):
    recipe = parse_recipe(document(recipe_document, policy={"model": str(chat_lm)},
                                   data={"path": str(chat_prompts), "max_prompt_tokens": 70, "truncate": "error"}), builtin_registry)
    with pytest.raises(RecipeError, match=r"\$\.data\.max_prompt_tokens: record 2 has 73 prompt tokens, over the limit of 70"):
        Trainer(recipe)


# --- end to end through `rlkit run` -----------------------------------------------------------------


def rlkit(*args, cwd):
    env = {**os.environ, "RLKIT_PLUGINS": "none"}
    return subprocess.run([sys.executable, "-m", "rlkit_core.runtime.cli", *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=300)


def last_metrics(output_dir):
    lines = (output_dir / "metrics.jsonl").read_text().splitlines()
    return len(lines), json.loads(lines[-1])


@pytest.mark.slow
def test_run_padless_policy_with_separate_critic_and_reward_model(recipe_document, write_recipe, gpt2_lm, gpt2_classifier, tmp_path):
    recipe = write_recipe(document(recipe_document, policy={"model": str(gpt2_lm)},
                                   value_head={"type": "separate", "model": str(gpt2_classifier)},
                                   reward={"type": "reward-model", "model": str(gpt2_classifier)}))
    result = rlkit("run", recipe, "--quiet", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    count, metrics = last_metrics(tmp_path / "run")
    assert count == 2 and metrics["check/logprob_gap"] < 1e-4


@pytest.mark.slow
def test_run_chat_policy_with_two_end_ids_and_a_reward_model_of_another_tokenizer(
        recipe_document, write_recipe, chat_lm, gpt2_classifier, chat_prompts, tmp_path):
    recipe = write_recipe(document(recipe_document, policy={"model": str(chat_lm)},
                                   reward={"type": "reward-model", "model": str(gpt2_classifier)},
                                   data={"path": str(chat_prompts), "max_prompt_tokens": 70},
                                   ppo={"batch_size": 8, "minibatch_size": 4}))
    result = rlkit("run", recipe, "--quiet", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "prompts: 16 loaded, 9 cut from the left to 70 tokens, 0 skipped" in result.stdout
    count, metrics = last_metrics(tmp_path / "run")
    assert count == 2 and metrics["check/logprob_gap"] < 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("name", ["ppo_tldr_pythia", "ppo_sentiment_gpt2"])
def test_real_model_recipes_pass_check_offline(name, tmp_path):
    from pathlib import Path

    recipe = Path(__file__).parent.parent / "recipes" / f"{name}.toml"
    env = {**os.environ, "RLKIT_PLUGINS": "none", "HF_HOME": str(tmp_path / "empty-hf-cache")}
    result = subprocess.run([sys.executable, "-m", "rlkit_core.runtime.cli", "check", "--offline", str(recipe)],
                            capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "is valid" in result.stdout and "not checked offline" in result.stdout


def test_check_names_a_reward_model_tokenizer_that_cannot_be_loaded(recipe_document, builtin_registry, gpt2_classifier, tmp_path):
    from rlkit_core.recipe.plan import describe_plan

    empty, other = tmp_path / "unwritten", tmp_path / "no-tokenizer-here"
    empty.mkdir()
    other.mkdir()
    (other / "notes.txt").write_text("not a tokenizer")
    for tokenizer, message in [(str(tmp_path / "missing"), r"\$\.reward\.tokenizer: no directory"),
                               (str(empty), r"\$\.reward\.tokenizer: '.*unwritten' is an empty folder"),
                               (str(other), r"\$\.reward\.tokenizer: cannot load a tokenizer from")]:
        recipe = parse_recipe(document(recipe_document, reward={"type": "reward-model", "model": str(gpt2_classifier),
                                                                "tokenizer": tokenizer}), builtin_registry)
        with pytest.raises(RecipeError, match=message):
            describe_plan(recipe)


def test_held_out_evaluation_on_chat_prompts_with_two_end_ids(recipe_document, builtin_registry, chat_lm, gpt2_classifier, chat_prompts, tmp_path):
    import math

    from rlkit_core.runtime.run import run_recipe

    doc = document(recipe_document, policy={"model": str(chat_lm)},
                   reward={"type": "reward-model", "model": str(gpt2_classifier)},
                   data={"path": str(chat_prompts)}, ppo={"batch_size": 8, "minibatch_size": 4},
                   eval={"size": 4, "greedy": False})
    history = run_recipe(parse_recipe(doc, builtin_registry), quiet=True, out=open(os.devnull, "w"))
    evaluations = [h for h in history if "eval/score" in h]
    assert [h["iteration"] for h in evaluations] == [0, 2]
    assert all(math.isfinite(h["eval/score"]) and math.isfinite(h["eval/kl"]) for h in evaluations)
    samples = json.loads((tmp_path / "run" / "samples_before.json").read_text())
    assert samples[0]["prompt"].endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")  # rendered with the template


# --- critic-free estimators on real-style tokenizers ----------------------------------------------


@pytest.mark.parametrize("estimator, samples, model", [("remax", 1, "chat_lm"), ("grpo", 2, "gpt2_lm")])
def test_critic_free_estimators_on_real_style_tokenizers(recipe_document, builtin_registry, chat_prompts, tmp_path, request,
                                                         estimator, samples, model):
    """ReMax's extra greedy generation on chat-templated prompts with two end ids, and GRPO's groups
    on a pad-less policy: one whole iteration each, with no critic."""
    reward = tmp_path / "length.py"
    reward.write_text("def score(prompts, responses, **columns):\n    return [len(r) / 40 for r in responses]\n")
    tables = dict(policy={"model": str(request.getfixturevalue(model))}, reward={"function": f"{reward}:score"},
                  advantage={"type": estimator}, value_head={"type": "none"},
                  ppo={"batch_size": 8, "minibatch_size": 4, "samples_per_prompt": samples})
    if model == "chat_lm":
        tables["data"] = {"path": str(chat_prompts)}
    trainer = Trainer(parse_recipe(document(recipe_document, **tables), builtin_registry))
    iteration = trainer.iterate()
    metrics = iteration.metrics
    assert trainer.components.value_head is None and not [name for name in metrics if "value" in name]
    assert all(math.isfinite(value) for value in metrics.values())
    assert ("time/baseline" in metrics) == (estimator == "remax")
    assert trainer.components.policy.tokenizer.pad_token_id not in iteration.batch.response_ids[iteration.batch.response_mask.bool()]


@pytest.mark.slow
@pytest.mark.parametrize("estimator, samples, model", [("remax", 1, "chat_lm"), ("grpo", 2, "gpt2_lm")])
def test_two_processes_run_critic_free_estimators_on_real_style_tokenizers(recipe_document, write_recipe, chat_prompts, tmp_path,
                                                                          request, estimator, samples, model):
    """The same two runs as above under torchrun: ReMax's greedy generation per process on chat prompts
    with two end ids, GRPO's groups gathered across processes on a pad-less policy; both with a held-out
    evaluation and the end-of-run report's greedy samples."""
    from test_scaling import rlkit_script, torchrun

    reward = tmp_path / "length.py"
    reward.write_text("def score(prompts, responses, **columns):\n    return [len(r) / 40 for r in responses]\n")
    tables = dict(policy={"model": str(request.getfixturevalue(model))}, reward={"function": f"{reward}:score"},
                  advantage={"type": estimator}, value_head={"type": "none"}, eval={"size": 4},
                  ppo={"batch_size": 8, "minibatch_size": 4, "samples_per_prompt": samples})
    if model == "chat_lm":
        tables["data"] = {"path": str(chat_prompts)}
    else:  # the default task's documents and its text metrics, through a pad-less tokenizer
        tables["data"] = {"type": "toy-summaries", "size": 64}
        tables["eval"]["metrics"] = ["exact-summary", "fact-copied"]
    done = torchrun(rlkit_script(), "run", write_recipe(document(recipe_document, **tables)))
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [row["iteration"] for row in rows] == [0, 1, 2]  # the held-out evaluation, then two iterations
    trained = rows[1:]
    assert all(("time/baseline" in row) == (estimator == "remax") for row in trained)
    assert not [name for row in trained for name in row if "value" in name]
    assert all(math.isfinite(value) for row in trained for value in row.values())
    assert done.stdout.count("== rlkit report ==") == 1 and "greedy responses to 4 held-out prompts" in done.stdout
    if model == "gpt2_lm":
        assert all(row["eval/exact-summary"] in (0.0, 0.25, 0.5, 0.75, 1.0) for row in (rows[0], rows[-1]))
