"""Multi-turn episodes (`rlkit_core.runtime.episodes`): the core keeps every sampled token as
sampled, only the sampled tokens of well-ended episodes count, rewards land where their turn ended,
and every fault of an episode is a status, never a score of 0 and never a hang."""

from __future__ import annotations

import contextlib
import copy
import math
import threading
import time

import attrs
import pytest
import torch

from rlkit_core.functional import gae
from rlkit_core.interfaces import Environment, Generation, Generator
from rlkit_core.messages import Reset, Step
from rlkit_core.runtime.episodes import EnvironmentFault, Episode, Sample, episodes_batch
from rlkit_core.testing.offline_models import write_tiny_model
from tests.test_hf_generator_loop import lift_logits
from tests.test_loss_mask import changed_outside_the_loss_mask, loss_and_gradients
from tests.test_trainer import advantages_with, compare_with, make_trainer, rollout_with, update_with


def ending_model(path, style: str = "byt5", end_logit: float = 6.5):
    """A tiny model of `style` that ends a turn after a token or three (`ends_turns_early`)."""
    write_tiny_model(path, style)
    return ends_turns_early(path, end_logit)


def ends_turns_early(path, end_logit: float = 6.5):
    """The GPT-2 at `path`, changed to end a turn after a token or three: its last layer norm points
    every hidden state along the end token's embedding, so episodes reach their later turns. The
    end token's logit is about `end_logit`: 6.5 makes p(end) ≈ 0.6, 5.5 about 0.35."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path)
    eos = AutoTokenizer.from_pretrained(path).eos_token_id
    norm = model.transformer.ln_f
    with torch.no_grad():
        embedding = model.get_output_embeddings().weight
        norm.weight.mul_(0.2)
        norm.bias.copy_(embedding[eos] / embedding[eos].norm() ** 2 * end_logit)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def ending_tiny_model(tmp_path_factory):
    return ending_model(tmp_path_factory.mktemp("ending-gpt2"))


def episode_document(document, model, **environment):
    """`document` (the shared tiny recipe) as a guess-number recipe on `model`."""
    document["policy"]["model"] = str(model)
    document.pop("reward")
    document["generator"]["max_new_tokens"] = 6
    document["environment"] = {"type": "guess-number", "max_turns": 4, "max_episode_tokens": 120, **environment}
    document["data"] = {"type": "guess-number-games", "size": 64, "seed": 0}
    return document


def test_an_episode_batch_counts_only_what_was_sampled(recipe_document, builtin_registry, ending_tiny_model):
    trainer = make_trainer(episode_document(recipe_document, ending_tiny_model), builtin_registry)
    batch, metrics = rollout_with(trainer, trainer.stream.batch(0))
    counted, layout = batch.loss_mask.bool(), batch.response_mask.bool()
    assert metrics["env/turns"] > 2, "the ending model should reach later turns"
    assert (counted <= layout).all() and (counted.sum() < layout.sum())
    # the environment's tokens hold no sampler log-prob (a missed mask would make a loss NaN); in a
    # trained episode they are exactly what is not counted
    trained = counted.any(dim=1)
    assert torch.isnan(batch.sampled_logprobs[trained][(layout & ~counted)[trained]]).all()
    assert torch.isfinite(batch.sampled_logprobs[counted]).all()
    statuses = [name for name in metrics if name.startswith("env/status_")]
    assert math.isclose(sum(metrics[name] for name in statuses), 1.0)
    # an episode kept out of training has no counted token; a trained one has at least one
    trains = metrics["env/status_ok"] + metrics["env/status_cut_off"] + metrics["env/status_overflow"]
    assert trained.float().mean().item() == pytest.approx(trains)
    assert batch.ended.float().mean().item() == pytest.approx(metrics["env/status_ok"])


def test_recomputed_logprobs_equal_the_generators_over_four_turns(recipe_document, builtin_registry, ending_tiny_model):
    trainer = make_trainer(episode_document(recipe_document, ending_tiny_model, max_turns=4, max_episode_tokens=200),
                           builtin_registry)
    batch, metrics = rollout_with(trainer, trainer.stream.batch(0))
    batch = compare_with(trainer, batch)
    assert metrics["env/turns"] >= 3
    assert metrics["generate/kept_prefix"] > 0.5  # later turns continued their streams' caches (sampled from them)
    sampled = batch.response_mask.bool() & ~torch.isnan(batch.sampled_logprobs)
    assert torch.allclose(batch.old_logprobs[sampled], batch.sampled_logprobs[sampled], atol=1e-5, rtol=0)


def test_episodes_sampled_on_kept_streams_are_the_episodes_of_whole_prefills(recipe_document, builtin_registry, ending_tiny_model,
                                                                              monkeypatch):
    document = episode_document(recipe_document, ending_tiny_model, max_turns=4, max_episode_tokens=200)
    trainer = make_trainer(document, builtin_registry)
    torch.manual_seed(5)
    kept, metrics = rollout_with(trainer, trainer.stream.batch(0))
    monkeypatch.setattr(type(trainer.components.generator), "continuing_streams", Generator.continuing_streams)
    torch.manual_seed(5)
    whole, whole_metrics = rollout_with(trainer, trainer.stream.batch(0))
    assert metrics["generate/kept_prefix"] > 0.5 and "generate/kept_prefix" not in whole_metrics
    assert torch.equal(kept.response_ids, whole.response_ids) and torch.equal(kept.loss_mask, whole.loss_mask)
    assert torch.allclose(kept.sampled_logprobs.nan_to_num(), whole.sampled_logprobs.nan_to_num(), atol=1e-5, rtol=0)


def test_environment_tokens_carry_no_loss_and_no_gradient(recipe_document, builtin_registry, ending_tiny_model):
    trainer = make_trainer(episode_document(recipe_document, ending_tiny_model), builtin_registry)
    batch = advantages_with(trainer, rollout_with(trainer, trainer.stream.batch(0))[0])
    hole = batch.response_mask.bool() & ~batch.loss_mask.bool()
    assert hole.any()
    token_count = float(batch.loss_mask.sum())
    loss = trainer.components.loss
    terms, gradients = loss_and_gradients(loss, batch, token_count)
    changed_terms, changed_gradients = loss_and_gradients(loss, changed_outside_the_loss_mask(batch), token_count)
    for name, value in terms.losses.items():
        assert torch.isfinite(value) and torch.equal(value, changed_terms.losses[name]), name
    assert gradients[0] is not None and gradients[1] is not None  # the policy's and the critic's
    for gradient, changed in zip(gradients, changed_gradients):
        if gradient is None:  # no entropy term in this loss
            assert changed is None
            continue
        assert torch.equal(gradient, changed)
        assert (gradient[hole] == 0).all()


def test_gae_over_an_episode_is_gae_with_its_environment_spans_deleted(recipe_document, builtin_registry, ending_tiny_model):
    trainer = make_trainer(episode_document(recipe_document, ending_tiny_model), builtin_registry,
                           advantage__type="gae", advantage__whiten=False, advantage__lam=0.9)
    batch = advantages_with(trainer, rollout_with(trainer, trainer.stream.batch(0))[0])
    counted = batch.loss_mask.bool()
    assert (batch.response_mask.bool() & ~counted).any()
    for row in range(len(batch)):
        kept = counted[row]
        if not kept.any():
            continue
        alone, _ = gae(batch.rewards[row, kept][None], batch.values[row, kept][None], torch.ones(1, int(kept.sum())), 1.0, 0.9)
        assert torch.allclose(batch.advantages[row, kept], alone[0], atol=1e-6, rtol=0)


def test_turn_rewards_land_at_each_turns_last_sampled_token_and_are_conserved(recipe_document, builtin_registry, ending_tiny_model):
    trainer = make_trainer(episode_document(recipe_document, ending_tiny_model), builtin_registry, kl__type="fixed", kl__beta=0.0)
    batch = advantages_with(trainer, rollout_with(trainer, trainer.stream.batch(0))[0])
    counted = batch.loss_mask.bool()
    for row in range(len(batch)):
        if not counted[row].any():
            continue
        given = batch.turn_rewards[row].nonzero().squeeze(1).tolist()
        for position in given:  # a turn's last sampled token: sampled, and the next one is not (or the stream ends)
            assert counted[row, position]
            assert position + 1 == batch.response_mask[row].sum() or not counted[row, position + 1]
        # every reward of the episode is in its row, once: the per-token rewards add up to its score
        assert float(batch.rewards[row][counted[row]].sum()) == pytest.approx(float(batch.scores[row]), abs=1e-6)
        assert float(batch.turn_rewards[row].sum()) == pytest.approx(float(batch.scores[row]), abs=1e-6)


class Scripted(Generator):
    """Returns the ids it was given, turn by turn: for ids no model would be asked to reproduce."""

    temperature = 1.0

    def __init__(self, turns: list[list[int]], pad: int):
        self.turns, self.pad, self.calls = turns, pad, 0

    def generate(self, prompt_ids, prompt_mask, greedy=False):
        ids = self.turns[self.calls % len(self.turns)]
        self.calls += 1
        rows = len(prompt_ids)
        response = torch.tensor([ids] * rows)
        return Generation(response_ids=response, response_mask=torch.ones_like(response), logprobs=torch.full(response.shape, -0.5))


def test_sampled_ids_are_kept_verbatim_even_when_text_would_encode_them_otherwise(recipe_document, builtin_registry, tmp_path):
    from transformers import AutoTokenizer

    path = write_tiny_model(tmp_path / "bpe", "gpt2")
    tokenizer = AutoTokenizer.from_pretrained(path)
    merged = tokenizer("the", add_special_tokens=False)["input_ids"]
    pieces = [tokenizer.convert_tokens_to_ids(c) for c in "the"]
    assert len(merged) < len(pieces)  # "the" is one token, so the pieces re-encode to something else
    assert tokenizer(tokenizer.decode(pieces), add_special_tokens=False)["input_ids"] != pieces
    eos = tokenizer.eos_token_id
    document = episode_document(recipe_document, path, max_turns=2)
    trainer = make_trainer(document, builtin_registry)
    scripted = Scripted([pieces + [eos]], eos)
    trainer.components = attrs.evolve(trainer.components, generator=scripted)
    batch, _ = rollout_with(trainer, trainer.stream.batch(0)[:2])
    row = batch.response_ids[0][batch.response_mask[0].bool()].tolist()
    assert row[:4] == pieces + [eos]  # the first turn as the generator gave it
    assert row[-4:] == pieces + [eos]  # and the second, after the environment's answer
    sampled = batch.response_ids[0][~torch.isnan(batch.sampled_logprobs[0]) & batch.response_mask[0].bool()].tolist()
    assert sampled == (pieces + [eos]) * 2


class Faulty(Environment):
    """An environment that misbehaves in the way its record's `fault` column says."""

    def tools(self):
        return []

    def reset(self, record, seed):
        if record["fault"] == "reset raises":
            raise ValueError("no such game")
        return Reset([{"role": "user", "content": "go"}], {"fault": record["fault"]})

    def step(self, state, reply):
        fault = state["fault"]
        if fault == "raises":
            raise RuntimeError("broken tool")
        if fault == "hangs":
            time.sleep(30)
        if fault == "times out":
            raise TimeoutError("the tool server did not answer within 5 s")
        if fault == "slow":
            time.sleep(0.3)
        if fault == "says error":
            return Step(status="error")
        if fault == "not a step":
            return {"messages": []}
        if fault == "unseen":  # a turn the environment did not see: there is none before it to go back to
            return Step(reward=1.0, unseen=True)
        return Step(messages=[{"role": "user", "content": "more"}], reward=1.0, done=fault == "wins")


@pytest.mark.parametrize("barrier", [True, False], ids=["turn-barrier", "as-ready"])
@pytest.mark.parametrize("fault, status", [("raises", "error"), ("reset raises", "error"), ("hangs", "timeout"),
                                           ("times out", "timeout"), ("says error", "error"), ("not a step", "error"),
                                           ("unseen", "error"), ("wins", "ok")])
def test_every_fault_of_an_environment_is_a_status_never_a_score(recipe_document, builtin_registry, ending_tiny_model, fault, status,
                                                                 barrier):
    trainer = make_trainer(episode_document(recipe_document, ending_tiny_model, step_timeout_s=0.5, turn_barrier=barrier), builtin_registry)
    trainer.components = attrs.evolve(trainer.components, environment=Faulty())
    records = [{"prompt": "p", "secret": 1, "fault": fault}] * 16
    started = time.monotonic()
    said = {"raises": "broken tool", "reset raises": "no such game", "not a step": "not a Step",  # every fault is said, with its reason
            "hangs": "the environment's step did not return within environment.step_timeout_s = 0.5 s",
            "times out": "the environment's step timed out: the tool server did not answer within 5 s; the episode ends as a timeout",
            "unseen": "unseen=True for the episode's first turn"}.get(fault)
    with pytest.warns(EnvironmentFault, match=said) if said else contextlib.nullcontext():
        batch, metrics = rollout_with(trainer, records)
    assert time.monotonic() - started < 20  # a hanging step ends its episode after the timeout
    assert metrics[f"env/status_{status}"] > 0
    if status != "ok":
        assert not batch.loss_mask.any()  # out of training, whatever its score
        assert metrics["env/status_ok"] == 0


def test_an_episode_past_its_time_is_said_with_the_limit(recipe_document, builtin_registry, ending_tiny_model):
    """Each step takes 0.3 s and the episode may take 0.2: every episode ends as a timeout after its
    first step, and the warning names the limit, once."""
    trainer = make_trainer(episode_document(recipe_document, ending_tiny_model, episode_timeout_s=0.2), builtin_registry)
    trainer.components = attrs.evolve(trainer.components, environment=Faulty())
    with pytest.warns(EnvironmentFault) as said:
        batch, metrics = rollout_with(trainer, [{"prompt": "p", "secret": 1, "fault": "slow"}] * 4)
    assert metrics["env/status_timeout"] == 1.0 and not batch.loss_mask.any()
    assert [str(w.message) for w in said] == ["the episode ran past environment.episode_timeout_s = 0.2 s (its turns' generation and the "
                                              "environment's calls, from its reset): it ends as a timeout, kept out of training "
                                              "(env/status_timeout); raise the limit (0: no limit)"]


class Sleepy(Environment):
    """Guess-number's opening; every step sleeps its record's `sleep` seconds and says 'more',
    until the turns run out."""

    def reset(self, record, seed):
        return Reset([{"role": "user", "content": record["prompt"]}], dict(record))

    def step(self, state, reply):
        time.sleep(state["sleep"])
        return Step(messages=[{"role": "user", "content": "more"}], reward=0.1 * reply.turn)


def test_without_a_turn_barrier_a_slow_step_holds_only_its_own_episode(recipe_document, builtin_registry, tmp_path):
    """`turn_barrier = false`: an episode whose steps take 0.3 s does not hold the others, which
    play their three turns meanwhile; with a generator whose ids do not depend on the batch, the
    rows are those the barrier gives, to the token."""
    from transformers import AutoTokenizer

    path = write_tiny_model(tmp_path / "bpe", "gpt2")
    tokenizer = AutoTokenizer.from_pretrained(path)
    turn = tokenizer("7", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    records = [{"prompt": f"Guess my number, 1-{n}.", "secret": 1, "sleep": 0.3 if n == 9 else 0.0} for n in range(2, 10)]
    rows = {}
    for barrier in (True, False):
        trainer = make_trainer(episode_document(copy.deepcopy(recipe_document), path, max_turns=3, turn_barrier=barrier), builtin_registry)
        trainer.components = attrs.evolve(trainer.components, environment=Sleepy(), generator=Scripted([turn], tokenizer.eos_token_id))
        batch, metrics = rollout_with(trainer, records, samples_per_prompt=1)
        rows[barrier] = (batch.prompt_ids.tolist(), batch.response_ids.tolist(), batch.loss_mask.tolist(), batch.turn_rewards.tolist())
        generations = trainer.components.generator.calls
        assert metrics["env/turns"] == 3 and metrics["env/status_ok"] == 1
    assert rows[True] == rows[False]
    assert generations > 3  # the fast episodes' turns were generated without waiting for the slow one's


class Counting(Sleepy):
    """Sleepy, noting the most threads alive while a step runs."""

    def __init__(self):
        self.most_threads = 0

    def step(self, state, reply):
        self.most_threads = max(self.most_threads, threading.active_count())
        return super().step(state, reply)


def test_without_a_turn_barrier_steps_run_in_the_pool_and_no_thread_more(recipe_document, builtin_registry, tmp_path):
    """`turn_barrier = false` gives each step to the environment's pool as its episode's turn ends:
    eight episodes stepping at once, uneven, with `call_threads = 2`, never have more threads than
    the pool's two beside those alive before the rollout, and the rows are the barrier's."""
    from transformers import AutoTokenizer

    path = write_tiny_model(tmp_path / "bpe", "gpt2")
    tokenizer = AutoTokenizer.from_pretrained(path)
    turn = tokenizer("7", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    records = [{"prompt": f"Guess my number, 1-{n}.", "secret": 1, "sleep": 0.05 * (n % 3)} for n in range(2, 10)]
    rows = {}
    for barrier in (True, False):
        document = episode_document(copy.deepcopy(recipe_document), path, max_turns=3, turn_barrier=barrier, call_threads=2)
        trainer = make_trainer(document, builtin_registry)
        environment = Counting()
        trainer.components = attrs.evolve(trainer.components, environment=environment, generator=Scripted([turn], tokenizer.eos_token_id))
        before = threading.active_count()
        batch, metrics = rollout_with(trainer, records, samples_per_prompt=1)
        rows[barrier] = (batch.prompt_ids.tolist(), batch.response_ids.tolist(), batch.loss_mask.tolist())
        assert metrics["env/turns"] == 3 and metrics["env/status_ok"] == 1
        assert environment.most_threads <= before + 2, (barrier, before, environment.most_threads)
    assert rows[True] == rows[False]


@pytest.mark.parametrize("style", ["byt5", "qwen3"])
def test_without_a_turn_barrier_hf_serves_every_turn_in_one_decoding_loop(recipe_document, builtin_registry, ending_tiny_model, tmp_path,
                                                                          style):
    """On `hf`, episodes without a barrier are requests to one decoding loop (`serve`), never a
    `generate` call: greedy, every row is the barrier's to the token (on the byte-level toy, and on
    a Qwen-style BPE with Qwen3's real template), and the later turns continue their episode's kept
    cache there too."""
    model = ending_tiny_model
    if style == "qwen3":
        from transformers import AutoTokenizer

        from tests.test_chat_format import qwen3_template

        model = write_tiny_model(tmp_path / "qwen3", "chatml")
        tokenizer = AutoTokenizer.from_pretrained(model)
        tokenizer.chat_template = qwen3_template()
        tokenizer.save_pretrained(model)
    rows, reused = {}, {}
    for barrier in (True, False):
        trainer = make_trainer(episode_document(copy.deepcopy(recipe_document), model, turn_barrier=barrier), builtin_registry)
        if style == "qwen3":  # a turn ends after a token or three: <|im_end|>'s logit raised
            lift_logits(trainer.components.policy, trainer.components.policy.eos_token_ids, 4.0)
        if not barrier:
            trainer.components.generator.generate = None  # serve's loop samples every turn itself
        batch, metrics = rollout_with(trainer, trainer.stream.batch(0), greedy=True)
        rows[barrier] = (batch.prompt_ids.tolist(), batch.response_ids.tolist(), batch.loss_mask.tolist(), batch.sampled_logprobs)
        reused[barrier] = metrics["generate/kept_prefix"]
        assert metrics["env/turns"] > 2
    assert rows[True][:3] == rows[False][:3]
    assert torch.allclose(rows[True][3], rows[False][3], atol=1e-5, equal_nan=True)
    assert reused[False] == pytest.approx(reused[True]) and reused[False] > 0.3


def test_a_turn_cut_off_by_max_new_tokens_trains_as_a_response_that_never_ended(recipe_document, builtin_registry, tiny_model):
    # the shared tiny model almost never ends a turn within 2 tokens
    trainer = make_trainer(episode_document(recipe_document, tiny_model), builtin_registry, generator__max_new_tokens=2,
                           ppo__missing_eos_penalty=0.5)
    batch, metrics = rollout_with(trainer, trainer.stream.batch(0))
    assert metrics["env/status_cut_off"] > 0.5
    cut = ~batch.ended
    assert cut.any() and (batch.response_mask[cut].sum(dim=1) == 2).all()
    assert torch.equal(batch.loss_mask[cut], batch.response_mask[cut])  # both sampled tokens count
    # scored by what the episode got, then the recipe's penalty for a response that never ended
    batch = advantages_with(trainer, batch)
    assert torch.allclose(batch.rewards[cut].sum(dim=1), batch.scores[cut] - 0.5 - trainer.components.kl.beta * batch.kl[cut].sum(dim=1))


def test_the_token_budget_ends_an_episode_as_overflow(recipe_document, builtin_registry, ending_tiny_model):
    trainer = make_trainer(episode_document(recipe_document, ending_tiny_model, max_episode_tokens=6), builtin_registry)
    batch, metrics = rollout_with(trainer, trainer.stream.batch(0))
    assert metrics["env/status_overflow"] > 0
    assert (batch.response_mask.sum(dim=1) <= 6).all()
    assert not batch.ended[batch.response_mask.sum(dim=1) == 6].any()


def test_a_split_episode_gives_each_sample_the_episodes_score():
    first, second = Sample(prompt=[5, 6]), Sample(prompt=[7, 8, 9])
    first.extend([1, 2]), first.extend([3], None), second.extend([4, 2], [-0.1, -0.2])
    first.sampled, first.logprobs = [True, True, False], [-0.3, -0.4, math.nan]
    first.rewards[1] = -0.1
    second.rewards[1] = 1.0
    episode = Episode(record={"prompt": "p"}, group=0, samples=[first, second], status="ok")
    batch = episodes_batch([episode], [0.9], pad=0, device=torch.device("cpu"))
    assert batch.loss_mask.tolist() == [[1, 1, 0], [1, 1, 0]]
    assert torch.equal(batch.turn_rewards, torch.tensor([[0.0, -0.1, 0.0], [0.0, 1.0, 0.0]]))
    assert batch.scores.tolist() == pytest.approx([0.9, 0.9]) and batch.group_ids.tolist() == [0, 0]


def test_dynamic_sampling_joins_episode_batches_row_by_row():
    """The rounds of dynamic sampling as one batch: each episode's turn rewards and versions stay on
    its row, a narrower round padded."""
    from rlkit_core.runtime.dynamic_sampling import concatenated

    rewarded, other = Sample(prompt=[5]), Sample(prompt=[6, 7])
    rewarded.extend([1, 2, 3], [-0.1, -0.2, -0.3], version=4)
    rewarded.rewards[2] = 0.5
    other.extend([4], [-0.4], version=5)
    first, second = (episodes_batch([Episode(record={"prompt": p}, group=g, samples=[s], status="ok")], [score], pad=0, device="cpu")
                     .with_(responses=[p]) for p, g, s, score in (("a", 0, rewarded, 1.0), ("b", 1, other, 2.0)))
    joined = concatenated([first, second, first], pad_token_id=0)
    assert joined.turn_rewards.tolist() == [[0.0, 0.0, 0.5], [0.0, 0.0, 0.0], [0.0, 0.0, 0.5]]
    assert joined.sampled_versions.tolist() == [[4, 4, 4], [5, -1, -1], [4, 4, 4]]
    assert joined.response_ids.tolist() == [[1, 2, 3], [4, 0, 0], [1, 2, 3]] and joined.scores.tolist() == [1.0, 2.0, 1.0]
    assert joined.responses == ["a", "b", "a"] and joined.episode_ids is None


def test_dynamic_sampling_trains_episodes_through_its_extra_rounds(recipe_document, builtin_registry, ending_tiny_model):
    document = episode_document(recipe_document, ending_tiny_model)
    trainer = make_trainer(document, builtin_registry, ppo__dynamic_sampling=True, ppo__max_extra_rounds=2, ppo__samples_per_prompt=4,
                           advantage__type="grpo", value_head__type="none")
    metrics = trainer.step()
    assert metrics["batch/extra_rounds"] >= 1 and math.isfinite(metrics["train/loss"]) and metrics["env/turns"] > 1


@pytest.mark.parametrize("estimator", ["gae", "grpo"])
def test_ppo_with_a_critic_and_the_critic_free_estimators_train_episodes(recipe_document, builtin_registry, ending_tiny_model, estimator):
    changes = {"advantage__type": estimator}
    if estimator == "grpo":
        changes.update(ppo__samples_per_prompt=4, value_head__type="none")
    trainer = make_trainer(episode_document(recipe_document, ending_tiny_model), builtin_registry, **changes)
    before = [p.detach().clone() for p in trainer.components.policy.parameters()]
    metrics = trainer.step()
    assert math.isfinite(metrics["train/loss"]) and metrics["env/turns"] > 1
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.components.policy.parameters()))


def test_the_recipes_reward_scores_each_transcript_on_top_of_the_environments(recipe_document, builtin_registry, ending_tiny_model,
                                                                              tmp_path):
    reward = tmp_path / "transcript_reward.py"
    reward.write_text("def score(prompts, responses, secret):\n"
                      "    return [s / 100 + r.count('higher') for r, s in zip(responses, secret)]\n")
    document = episode_document(recipe_document, ending_tiny_model)
    document["reward"] = {"type": "python", "function": f"{reward}:score"}
    trainer = make_trainer(document, builtin_registry)
    batch, _ = rollout_with(trainer, trainer.stream.batch(0))
    assert batch.responses is not None
    # the reward read the records' columns and each whole transcript after the first prompt
    extra = torch.tensor([s / 100 + r.count("higher") for r, s in zip(batch.responses, batch.columns["secret"])])
    assert torch.allclose(batch.scores, batch.turn_rewards.sum(dim=1) + extra)
    assert not any(r.startswith("Guess my number") for r in batch.responses)
    assert any("say a number" in r for r in batch.responses)


def test_the_readmes_environment_works_as_written(builtin_registry):
    import re
    from pathlib import Path

    from rlkit_core.messages import Reply
    from rlkit_core.recipe.registry import contract_problems

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    [source] = [block for block in re.findall(r"```python\n(.*?)```", readme, re.S) if "register_environments" in block]
    namespace: dict = {}
    exec(compile(source, "README.md", "exec"), namespace)
    assert not contract_problems("environment", namespace["Quiz"], namespace["QuizConfig"])
    quiz = namespace["Quiz"](namespace["QuizConfig"]())
    opening = quiz.reset({"prompt": "2 + 2?", "answer": 4}, seed=0)
    assert opening.messages == [{"role": "user", "content": "2 + 2?"}]
    wrong, right = quiz.step(opening.state, Reply(text="5", turn=1)), quiz.step(opening.state, Reply(text=" 4", turn=2))
    assert (wrong.done, wrong.reward, wrong.messages[0]["content"]) == (False, -0.1, "try again")
    assert (right.done, right.reward, right.info) == (True, 1.0, {"solved": 1.0})


def render_ids(tokenizer, conversation, generation_prompt=False) -> list[int]:
    text = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=generation_prompt)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("think", [False, True])
def test_a_chatml_episode_is_the_templates_render_or_splits_where_the_template_rewrites_history(recipe_document, builtin_registry,
                                                                                                 tmp_path, think):
    """Through the whole runner with a Qwen-style template (`<|im_end|>\\n` after every turn, the
    reasoning of earlier turns dropped): without reasoning an episode is one sample, equal to the
    template's render of the whole conversation but for the final boundary; with it, each turn
    after the first starts a new sample from the re-rendered conversation, and nothing merges."""
    from transformers import AutoTokenizer

    path = write_tiny_model(tmp_path / "chatml", "chatml")
    tokenizer = AutoTokenizer.from_pretrained(path)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    text = "<think>hm</think>7" if think else "7"
    turn = tokenizer(text, add_special_tokens=False)["input_ids"] + [end]
    trainer = make_trainer(episode_document(recipe_document, path, max_turns=3), builtin_registry)
    trainer.components = attrs.evolve(trainer.components, generator=Scripted([turn], tokenizer.pad_token_id))
    records = [{"prompt": "Guess my number, 1-16.", "secret": 16}]
    batch, metrics = rollout_with(trainer, records * 2)
    conversation = [{"role": "user", "content": "Guess my number, 1-16."}]
    # "7" is a guess (then out of the open range); with its reasoning it is no number the game reads
    answers = ("say a number: 1-16",) * 2 if think else ("higher: 8-16", "say a number: 8-16")
    for answer in answers:
        conversation += [{"role": "assistant", "content": text}, {"role": "user", "content": answer}]
    conversation.append({"role": "assistant", "content": text})
    rows = [torch.cat([batch.prompt_ids[i][batch.prompt_mask[i].bool()], batch.response_ids[i][batch.response_mask[i].bool()]]).tolist()
            for i in range(len(batch))]
    if not think:
        whole = render_ids(tokenizer, conversation)
        assert metrics["env/splits"] == 0 and len(batch) == 2
        assert rows[0] == whole[:-1]  # all but the "\n" the template puts after the last turn's end
    else:
        assert metrics["env/splits"] == 2 and len(batch) == 6  # turns 2 and 3 each start a sample
        for sample, turns in zip(rows[:3], (1, 2, 3)):  # each is the render of the conversation up to its turn
            assert sample == render_ids(tokenizer, conversation[:2 * turns - 1], generation_prompt=True) + turn
        assert batch.group_ids.tolist() == [0, 0, 0, 1, 1, 1]
    sampled = [row[~torch.isnan(batch.sampled_logprobs[i]) & batch.response_mask[i].bool()].tolist()
               for i, row in enumerate(batch.response_ids)]
    assert all(s == turn * (len(s) // len(turn)) and s for s in sampled)  # only the generator's ids count as sampled


def test_the_update_of_episodes_divides_by_their_sampled_tokens(recipe_document, builtin_registry, ending_tiny_model, monkeypatch):
    from rlkit_core.runtime import update

    trainer = make_trainer(episode_document(recipe_document, ending_tiny_model), builtin_registry, ppo__minibatch_size=16,
                           ppo__epochs=1)
    batch = advantages_with(trainer, rollout_with(trainer, trainer.stream.batch(0))[0])
    counts, micro_step = [], update._micro_step
    monkeypatch.setattr(update, "_micro_step", lambda engine, components, recipe, micro, rows, token_count:
                        counts.append(float(token_count)) or micro_step(engine, components, recipe, micro, rows, token_count))
    update_with(trainer, batch)
    sampled = int((batch.response_mask.bool() & ~torch.isnan(batch.sampled_logprobs)).sum())
    assert counts and set(counts) == {float(batch.loss_mask.sum())} and batch.loss_mask.sum() == sampled
    assert sampled < batch.response_mask.sum()
