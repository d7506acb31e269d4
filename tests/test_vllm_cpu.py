"""The vllm generator on a real vLLM engine (vLLM's CPU build), against the hf generator and
transformers on the same small GPT-2 with a pad-less GPT-2-style tokenizer.

Skipped, with the reason, unless vLLM's CPU build is installed: CI (.ci/run) builds a virtual
environment with it and runs this module there (docs/generators.md: vLLM on a CPU). One engine serves each
model of the module (an engine starts in about 5 s).
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from rlkit_plugins.hf_generator import HFGenerator, HFGeneratorConfig
from rlkit_plugins.hf_policy import HFPolicy, HFPolicyConfig
from rlkit_plugins.vllm_generator import VLLMGenerator, VLLMGeneratorConfig, installed_vllm

from rlkit_core.context import BuildContext
from rlkit_core.functional import logprobs_from_logits
from rlkit_core.prompts import encode_prompts
from rlkit_core.recipe.document import structure_table
from rlkit_core.runtime.push_check import PushCheck
from rlkit_core.runtime.scheduling import Producer

FOUND = installed_vllm()
pytestmark = [pytest.mark.vllm, pytest.mark.skipif(FOUND is None or not FOUND.cpu, reason="needs vLLM's CPU build (docs/generators.md: vLLM on a CPU)")]

MAX_NEW = 12
TEMPERATURE = 0.8
# float32 on both sides, different kernels: measured gaps are about 1e-6 (docs/results.md)
LOGPROB_TOLERANCE = 1e-4
# Chi-square tests below reject at this p-value: with their fixed seeds each either always passes or
# always fails, and a correct sampler lands in the rejection region for one seed in a thousand.
P_VALUE = 1e-3
ENGINE = dict(max_new_tokens=MAX_NEW, temperature=TEMPERATURE, gpu_memory_fraction=0.02)


def _write_model(path: Path, layers: int, seed: int) -> Path:
    """A GPT-2 with a pad-less GPT-2-style BPE (BOS = EOS = <|endoftext|>), its logits spread wide
    enough (initializer_range 0.2) that the first-token distribution is far from uniform."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from rlkit_core.testing.offline_models import build_bpe_tokenizer

    tokenizer = build_bpe_tokenizer("gpt2")
    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=len(tokenizer), n_positions=128, n_embd=64, n_layer=layers, n_head=2, initializer_range=0.2,
                        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    GPT2LMHeadModel(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _context(path, policy=None, seed=0):
    return BuildContext(recipe=None, device=torch.device("cpu"), output_dir=str(path), seed=seed, policy=policy)


def _policy(path, **options):
    config, problems = structure_table({"model": str(path), **options}, HFPolicyConfig, "policy")
    assert not problems
    return HFPolicy(config, _context(path))


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    return pad_leaning_policy(tmp_path_factory.mktemp("gpt2-style"))


def pad_leaning_policy(path: Path) -> HFPolicy:
    """Two end ids: the tokenizer's EOS and "," (common in the BPE's text); an added PAD, suppressed."""
    policy = _policy(_write_model(path, layers=2, seed=0), end_tokens=[","])
    assert len(policy.eos_token_ids) == 2 and policy.suppressed_token_ids == (policy.tokenizer.pad_token_id,)
    with torch.no_grad():  # the PAD the likeliest token everywhere (only its suppression keeps it out), "," a likely one:
        torch.manual_seed(2)  # every final hidden state leans along u, and so do their rows of the (tied) lm_head
        u = torch.nn.functional.normalize(torch.randn(policy.model.config.n_embd), dim=0)
        policy.model.transformer.ln_f.bias.copy_(2 * u)
        embeddings = policy.model.get_input_embeddings().weight
        embeddings[policy.tokenizer.pad_token_id] = 4 * u
        embeddings[policy.eos_token_ids[1]] = 2 * u
        logits = policy.model(**policy.tokenizer(["the quick"], return_tensors="pt")).logits[0, -1]
    assert int(logits.argmax()) == policy.tokenizer.pad_token_id
    return policy


@pytest.fixture(scope="module")
def generator(policy, tmp_path_factory):
    return VLLMGenerator(VLLMGeneratorConfig(**ENGINE), _context(tmp_path_factory.mktemp("vllm"), policy))


def _prompts(policy, texts):
    return encode_prompts(policy.tokenizer, [{"prompt": t} for t in texts], "cpu")


@torch.no_grad()
def _logprobs(model, suppressed, prompt_ids, prompt_mask, out, temperature=TEMPERATURE):
    """transformers' log-probs of the sampled tokens at the temperature, the suppressed ids masked."""
    input_ids = torch.cat([prompt_ids, out.response_ids], dim=1)
    attention_mask = torch.cat([prompt_mask, out.response_mask], dim=1)
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    logits = model(input_ids, attention_mask=attention_mask, position_ids=position_ids).logits[:, prompt_ids.shape[1] - 1:-1]
    logits = logits.float() / temperature
    logits[..., list(suppressed)] = float("-inf")
    return logprobs_from_logits(logits, out.response_ids)


def _max_gap(policy, prompt_ids, prompt_mask, out) -> float:
    expected = _logprobs(policy.model, policy.suppressed_token_ids, prompt_ids, prompt_mask, out)
    mask = out.response_mask.bool()
    return float((expected - out.logprobs)[mask].abs().max())


TEXTS = ["the quick", "the quick", "the quick", "hello world", "hello world", "abc", "summarise the document:", "x"]


def test_sampled_logprobs_match_transformers_before_and_after_pushes(policy, generator, capsys):
    prompt_ids, prompt_mask = _prompts(policy, TEXTS)
    gaps = []
    torch.manual_seed(0)
    for push in range(4):
        if push:
            with torch.no_grad():
                for p in policy.model.parameters():
                    p.add_(torch.randn_like(p) * 0.05)
        generator.sync_weights(policy)
        out = generator.generate(prompt_ids, prompt_mask)
        assert out.response_mask.sum() > len(TEXTS)
        gaps.append(_max_gap(policy, prompt_ids, prompt_mask, out))
    with capsys.disabled():
        print(f"\nvLLM (CPU) vs transformers, max |log-prob gap| per push (full weights): {', '.join(f'{g:.1e}' for g in gaps)}")
    assert max(gaps) < LOGPROB_TOLERANCE
    assert generator.pop_metrics()["time/weight_sync"] > 0


def _chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's goodness-of-fit p-value; the tokens with an expected count under 5 pooled into one bin."""
    expected = probs * counts.sum()
    rare = expected < 5
    observed = torch.cat([counts[~rare], counts[rare].sum(dim=0, keepdim=True)])
    expected = torch.cat([expected[~rare], expected[rare].sum(dim=0, keepdim=True)])
    statistic = ((observed - expected) ** 2 / expected).sum()
    dof = torch.tensor(len(observed) - 1, dtype=torch.float64)
    return float(torch.special.gammaincc(dof / 2, statistic / 2))  # the chi-square survival function


def test_same_first_token_distribution_as_the_hf_generator(policy, generator):
    """3000 first tokens from each generator after one prompt, each against π/T itself: both fit,
    and they fit each other's counts (a two-sample check on the same bins)."""
    draws = 3000
    prompt_ids, prompt_mask = _prompts(policy, ["the quick"] * draws)
    generator.sync_weights(policy)
    torch.manual_seed(1)
    ours = generator.generate(prompt_ids, prompt_mask).response_ids[:, 0]
    hf = HFGenerator(HFGeneratorConfig(max_new_tokens=1, temperature=TEMPERATURE), _context(".", policy)).generate(
        prompt_ids[:1].expand(draws, -1), prompt_mask[:1].expand(draws, -1)).response_ids[:, 0]
    with torch.no_grad():
        logits = policy.model(prompt_ids[:1], attention_mask=prompt_mask[:1]).logits[0, -1].float() / TEMPERATURE
    logits[list(policy.suppressed_token_ids)] = float("-inf")
    probs = torch.softmax(logits.double(), dim=-1)
    assert probs.max() > 0.05, "the test needs a distribution far from uniform"
    vocab = len(probs)
    counts = {name: torch.bincount(ids, minlength=vocab).double() for name, ids in [("vllm", ours), ("hf", hf)]}
    assert _chi_square_p(counts["vllm"], probs) > P_VALUE
    assert _chi_square_p(counts["hf"], probs) > P_VALUE
    total_variation = 0.5 * float((counts["vllm"] - counts["hf"]).abs().sum()) / draws
    assert total_variation < 0.1  # two samples of 3000 from one distribution of this shape: about 0.05
    # the test can fail: at another temperature the same draws do not fit
    hotter = torch.softmax(logits.double() * TEMPERATURE / 1.2, dim=-1)
    assert _chi_square_p(counts["vllm"], hotter) < P_VALUE


def test_the_pad_is_never_sampled_and_responses_stop_on_either_end_id(policy, generator):
    prompt_ids, prompt_mask = _prompts(policy, TEXTS * 40)
    generator.sync_weights(policy)
    out = generator.generate(prompt_ids, prompt_mask)
    counted = out.response_ids[out.response_mask.bool()]
    assert policy.tokenizer.pad_token_id not in counted.tolist()  # the likeliest token, masked
    ends = torch.tensor(policy.eos_token_ids)
    lengths = out.response_mask.sum(dim=1)
    last = out.response_ids.gather(1, (lengths - 1).unsqueeze(1)).squeeze(1)
    ended = torch.isin(last, ends)
    assert bool(((lengths == MAX_NEW) | ended).all()), "a response shorter than max_new_tokens ends on an end id"
    assert {int(t) for t in last[ended]} == set(policy.eos_token_ids), "both end ids seen ending responses"
    inside = [row[: n - 1] for row, n in zip(out.response_ids, lengths)]
    assert not any(torch.isin(row, ends).any() for row in inside), "nothing after the first end id"


def test_n_samples_per_prompt_come_back_in_order_and_differ(policy, generator):
    prompt_ids, prompt_mask = _prompts(policy, ["the quick"] * 6 + ["hello world"] * 6)
    generator.sync_weights(policy)
    out = generator.generate(prompt_ids, prompt_mask)
    assert out.response_ids.shape[0] == 12
    for group in (out.response_ids[:6], out.response_ids[6:]):
        assert len({tuple(row.tolist()) for row in group}) > 1
    assert _max_gap(policy, prompt_ids, prompt_mask, out) < LOGPROB_TOLERANCE  # each row's log-probs belong to its own prompt


def test_greedy_with_repeated_prompts_matches_transformers_greedy(policy, generator):
    """vLLM refuses n > 1 at temperature 0: repeated prompts go one request each."""
    prompt_ids, prompt_mask = _prompts(policy, TEXTS)
    generator.sync_weights(policy)
    ours = generator.generate(prompt_ids, prompt_mask, greedy=True)
    hf = HFGenerator(HFGeneratorConfig(max_new_tokens=MAX_NEW), _context(".", policy)).generate(prompt_ids, prompt_mask, greedy=True)
    assert torch.equal(ours.response_ids, hf.response_ids) and torch.equal(ours.response_mask, hf.response_mask)


class TwoWaves:
    """Requests for `serve`: the first texts at once, the rest at the next call, while the first
    decode (noting whether any was still running then)."""

    def __init__(self, policy, first: list[str], then: list[str]):
        encode = policy.tokenizer
        self.waves = [[(text, encode(text)["input_ids"]) for text in texts] for texts in (first, then)]
        self.pad_id, self.device = policy.tokenizer.pad_token_id, torch.device("cpu")
        self.answers, self.first_size, self.joined_running = {}, len(first), None

    def arrived(self, wait):
        if not self.waves:
            return []
        if len(self.waves) == 1:  # the second wave: is any of the first still decoding?
            self.joined_running = len(self.answers) < self.first_size
        return self.waves.pop(0)

    def completed(self, key, completion):
        assert key not in self.answers
        self.answers[key] = completion


def test_served_requests_join_the_running_batch_and_answer_as_generate_would(policy, generator):
    """`serve` on the engine's step loop: a second wave of requests is added while the first
    decodes, every request is answered once, and greedy answers are generate's, ids and log-probs."""
    first, then = ["the quick", "summarise the document:"], ["hello world", "abc", "x"]
    waves = TwoWaves(policy, first, then)
    generator.sync_weights(policy)
    generator.serve(waves, greedy=True)
    assert waves.joined_running is True and sorted(waves.answers) == sorted(first + then)
    prompt_ids, prompt_mask = _prompts(policy, first + then)
    reference = generator.generate(prompt_ids, prompt_mask, greedy=True).completions()
    for text, expected in zip(first + then, reference):
        assert waves.answers[text].ids == expected.ids
        assert waves.answers[text].logprobs == pytest.approx(expected.logprobs, abs=LOGPROB_TOLERANCE)


def test_the_trainers_autocast_does_not_reach_the_engine(policy, generator):
    """`mixed_precision = "bf16"` on a CPU: the trainer generates inside its autocast, unless the
    generator runs its own precision (`runs_own_precision`, which vLLM sets)."""
    from rlkit_core.runtime import rollout

    prompt_ids, prompt_mask = _prompts(policy, TEXTS)
    [out] = rollout.generate(*_generating_stage(policy, generator), [(prompt_ids, prompt_mask)], greedy=False)
    assert _max_gap(policy, prompt_ids, prompt_mask, out) < LOGPROB_TOLERANCE


def _generating_stage(policy, generator):
    """What `rollout.generate` reads of the engine (with the autocast of `mixed_precision = "bf16"`) and the components."""
    engine = types.SimpleNamespace(full_weights=contextlib.nullcontext, autocast=lambda: torch.autocast("cpu", dtype=torch.bfloat16),
                                   push_check=PushCheck(0.05), device=torch.device("cpu"),
                                   processes=types.SimpleNamespace(gather_objects=lambda value: [value]))
    return engine, types.SimpleNamespace(policy=policy, generator=generator)


def test_the_push_check_reads_vllms_prompt_logprobs_and_catches_a_push_the_engine_ignored(policy, generator, monkeypatch, capsys):
    """vLLM's prompt log-probs of the probe equal transformers' after a push; then an engine that
    takes a push without loading it (the silent failure) is caught at that push."""
    from rlkit_core.runtime import rollout
    from rlkit_core.runtime.push_check import WeightPushFailed, policy_logprobs

    prompts = [_prompts(policy, TEXTS)]
    engine, components = _generating_stage(policy, generator)
    rollout.generate(engine, components, prompts, greedy=False)
    probe = engine.push_check.probe
    assert len(probe) >= 2
    gap = float((torch.tensor(generator.score(probe)) - policy_logprobs(policy, probe, torch.device("cpu"))).abs().max())
    assert gap < LOGPROB_TOLERANCE
    saved = {name: p.detach().clone() for name, p in policy.model.named_parameters()}
    monkeypatch.setattr(generator.engine, "load_weights", lambda weights: None)
    torch.manual_seed(5)
    with torch.no_grad():
        for p in policy.model.parameters():
            p.add_(torch.randn_like(p) * 1e-3)  # a small step: under the tolerance, so the second rule must see it
    with pytest.raises(WeightPushFailed, match="the push did not land") as caught:
        rollout.generate(engine, components, prompts, greedy=False)
    with capsys.disabled():
        print(f"\nvLLM (CPU) push check: probe of {len(probe)} tokens, gap after a real push {gap:.1e}; an ignored push: {caught.value}")
    monkeypatch.undo()
    with torch.no_grad():
        for name, p in policy.model.named_parameters():
            p.copy_(saved[name])
    generator.sync_weights(policy)  # the engine holds the fixture's weights again for the tests after this one


def test_a_push_that_leaves_weights_out_is_refused(policy, generator):
    """What a dropped weight would do silently: vLLM keeps its placeholder (or, for the rest of a
    layer given only part of its tensors, uninitialised memory)."""
    from rlkit_plugins.vllm_generator import vllm_weights

    from rlkit_core.errors import RunError

    partial = [(name, w) for name, w in vllm_weights(policy.model) if name == "transformer.h.0.attn.c_attn.weight"]
    with pytest.raises(RunError, match="the weight push left .* of vLLM's weights unloaded"):
        generator.engine.load_weights(iter(partial))
    generator.sync_weights(policy)  # whole again for the tests after this one


# --- LoRA on several layers, and the trainer's random streams ---------------------------------------


@pytest.fixture(scope="module")
def lora_policy(tmp_path_factory):
    return moved_lora_policy(tmp_path_factory.mktemp("gpt2-4-layers"))


def moved_lora_policy(path: Path) -> HFPolicy:
    policy = _policy(_write_model(path, layers=4, seed=1), lora_r=4, lora_target_modules=["c_attn", "c_fc"])
    _move_lora(policy)
    return policy


def _move_lora(policy, scale=0.3):
    """As after training: B ≠ 0 (peft starts it at 0)."""
    with torch.no_grad():
        for name, p in policy.model.named_parameters():
            if "lora_" in name:
                p.add_(torch.randn_like(p) * scale)


def lora_push_gaps(policy, generator) -> tuple[list[float], list[float]]:
    """Three pushes (the adapters moved before the second and third), each followed by a rollout:
    per push, the largest gap between the sampled log-probs and the merged model's, and the push
    check's gap (rlkit_core.runtime.push_check)."""
    from rlkit_core.runtime import rollout

    prompt_ids, prompt_mask = _prompts(policy, TEXTS)
    engine, components = _generating_stage(policy, generator)
    gaps, push_gaps = [], []
    for push in range(3):
        if push:
            _move_lora(policy, 0.1)
        [out] = rollout.generate(engine, components, [(prompt_ids, prompt_mask)], greedy=False)
        push_gaps.append(engine.push_check.pop_metrics()["check/push_gap"])
        merged = copy.deepcopy(policy.model).merge_and_unload()
        expected = _logprobs(merged, policy.suppressed_token_ids, prompt_ids, prompt_mask, out)
        gaps.append(float((expected - out.logprobs)[out.response_mask.bool()].abs().max()))
    return gaps, push_gaps


def test_a_lora_policys_every_adapted_layer_reaches_the_engine(lora_policy, tmp_path, capsys):
    """The engine's log-probs are the merged model's, before and after more pushes; the engine's
    start leaves the trainer's random streams where they were (vLLM seeds them as it starts)."""
    torch.manual_seed(1234)
    state = torch.get_rng_state()
    generator = VLLMGenerator(VLLMGeneratorConfig(**ENGINE), _context(tmp_path, lora_policy, seed=0))
    assert torch.equal(torch.get_rng_state(), state)
    gaps, push_gaps = lora_push_gaps(lora_policy, generator)
    with capsys.disabled():
        print(f"\nvLLM (CPU) vs the merged LoRA model, max |log-prob gap| per push: {', '.join(f'{g:.1e}' for g in gaps)}; "
              f"push check gap: {', '.join(f'{g:.1e}' for g in push_gaps)}")
    assert max(gaps) < LOGPROB_TOLERANCE and max(push_gaps) < 1e-3


# --- rlkit run, end to end ------------------------------------------------------------------------------


def _run(document, tmp_path, name) -> list[dict]:
    from rlkit_core.testing import recipe_toml

    document = copy.deepcopy(document)
    document["run"]["output_dir"] = str(tmp_path / name)
    recipe = tmp_path / f"{name}.toml"
    recipe.write_text(recipe_toml(document))
    rlkit = str(Path(sys.executable).parent / "rlkit")
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([rlkit, "run", str(recipe)], capture_output=True, text=True, timeout=600, env=environment)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    return [row for row in rows if "score/mean" in row]  # the training iterations


@pytest.fixture(scope="module")
def byte_model(tmp_path_factory):
    return write_byte_model(tmp_path_factory.mktemp("byte-gpt2"))


def write_byte_model(path: Path) -> Path:
    """The conftest model with 32-wide heads (vLLM's CPU attention has no 16-wide kernel)."""
    from transformers import ByT5Tokenizer, GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(vocab_size=384, n_positions=128, n_embd=64, n_layer=2, n_head=2, bos_token_id=1, eos_token_id=1,
                               pad_token_id=0)).save_pretrained(path)
    ByT5Tokenizer().save_pretrained(path)
    return path


def test_rlkit_run_trains_with_the_vllm_generator_like_with_hf(recipe_document, byte_model, tmp_path, capsys):
    """The conftest recipe (rewarded for lowercase letters) for a few iterations with each
    generator on one seed: the reward rises with both, by about as much."""
    recipe_document["policy"]["model"] = str(byte_model)
    recipe_document["run"].update(steps=10, device="cpu")
    recipe_document["ppo"].update(batch_size=32, minibatch_size=16)
    recipe_document["optim"]["learning_rate"] = 1e-2
    recipe_document["kl"] = {"type": "fixed", "beta": 0.0}
    hf = _run(recipe_document, tmp_path, "hf")
    recipe_document["generator"] = {"type": "vllm", "max_new_tokens": 8, "gpu_memory_fraction": 0.02}
    ours = _run(recipe_document, tmp_path, "vllm")

    def reward(rows, at):
        return sum(row["score/mean"] for row in rows[at]) / len(rows[at])

    early, late = slice(0, 3), slice(-3, None)
    gains = {name: reward(rows, late) - reward(rows, early) for name, rows in [("hf", hf), ("vllm", ours)]}
    with capsys.disabled():
        print(f"\nrlkit run, reward gain over 10 iterations: hf {gains['hf']:+.3f}, vllm {gains['vllm']:+.3f}; "
              f"vllm check/logprob_gap max {max(row['check/logprob_gap'] for row in ours):.1e}, check/push_gap max "
              f"{max(row['check/push_gap'] for row in ours):.1e}, push check "
              f"{sum(row['time/push_check'] for row in ours) / sum(row['time/iteration'] for row in ours):.2%} of the iterations' time")
    assert gains["hf"] > 0.2 and gains["vllm"] > 0.2
    assert abs(gains["vllm"] - gains["hf"]) < 0.5 * gains["hf"]
    assert max(row["check/logprob_gap"] for row in ours) < LOGPROB_TOLERANCE
    assert all(row["check/push_gap"] < 1e-3 for row in ours)  # every push verified
    assert all(row["time/weight_sync"] > 0 for row in ours)


def test_two_processes_under_torchrun_each_run_an_engine_of_their_own(recipe_document, byte_model, tmp_path):
    """vLLM's external launcher: each gloo rank starts its own engine (data parallel, no weights
    shared), pushes its own copy of the weights and samples its own prompts."""
    from test_scaling import rlkit_script, torchrun

    recipe_document["policy"]["model"] = str(byte_model)
    recipe_document["run"].update(device="cpu", output_dir=str(tmp_path / "run"))
    recipe_document["generator"] = {"type": "vllm", "max_new_tokens": 8, "gpu_memory_fraction": 0.02}
    recipe = tmp_path / "recipe.toml"
    from rlkit_core.testing import recipe_toml

    recipe.write_text(recipe_toml(recipe_document))
    torchrun(rlkit_script(), "run", str(recipe), "--quiet", environment={"OMP_NUM_THREADS": "1"})
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    rows = [row for row in rows if "score/mean" in row]
    assert len(rows) == 2 and all(row["check/logprob_gap"] < LOGPROB_TOLERANCE and row["time/weight_sync"] > 0 for row in rows)


@pytest.mark.parametrize("barrier", [True, False], ids=["turn-barrier", "as-ready"])
def test_episodes_run_on_vllm_with_one_push_per_rollout(recipe_document, byte_model, tmp_path, barrier):
    """A multi-turn rollout with the vllm generator: every turn continues each episode's stream, the
    weights are pushed (and the prefix cache reset) once before the first turn, not at every turn,
    and the sampler's log-probs are the learner's at every sampled token. Without the barrier the
    turns are requests to `serve` (vLLM: a generate call per group of turns ready together)."""
    import shutil

    from rlkit_core.recipe.plugins import load_registry
    from tests.test_episodes import ends_turns_early, episode_document
    from tests.test_trainer import compare_with, make_trainer, rollout_with

    ending = ends_turns_early(shutil.copytree(byte_model, tmp_path / "ending"))  # heads of 32: vLLM's CPU attention has no 16
    document = episode_document(recipe_document, ending, turn_barrier=barrier)
    document["run"]["device"] = "cpu"
    document["generator"] = {"type": "vllm", "max_new_tokens": 6, "gpu_memory_fraction": 0.02}
    trainer = make_trainer(document, load_registry(environ={"RLKIT_PLUGINS": "none"}))
    engine = trainer.components.generator.engine
    resets, reset = [], engine.reset_prefix_cache
    engine.reset_prefix_cache = lambda: resets.append(1) or reset()
    batch, metrics = rollout_with(trainer, trainer.stream.batch(0))
    assert metrics["env/turns"] > 2 and len(resets) == 1
    compared = compare_with(trainer, batch)
    sampled = batch.response_mask.bool() & ~torch.isnan(batch.sampled_logprobs)
    assert float((compared.old_logprobs - batch.sampled_logprobs)[sampled].abs().max()) < LOGPROB_TOLERANCE
    rollout_with(trainer, trainer.stream.batch(1))
    assert len(resets) == 2  # the next rollout pushes again


@pytest.mark.parametrize("workers", ["threads", "processes"])
def test_batches_made_one_step_off_on_an_engine_of_their_own(recipe_document, byte_model, tmp_path, workers):
    """`[scheduler] max_staleness = 1` with vllm: the producer's generator is a second engine (in
    the trainer's process, or in the worker's), pushed the weights at each batch (its prefix cache
    reset then), while the trainer's engine serves the evaluation; every batch is at most one
    version old and trains its own prompts."""
    from rlkit_core.recipe.plugins import load_registry
    from tests.test_trainer import make_trainer

    recipe_document["policy"]["model"] = str(byte_model)
    recipe_document["run"]["device"] = "cpu"
    recipe_document["generator"] = {"type": "vllm", "max_new_tokens": 8, "gpu_memory_fraction": 0.02}
    trainer = make_trainer(recipe_document, load_registry(environ={"RLKIT_PLUGINS": "none"}), scheduler__max_staleness=1,
                           scheduler__workers=workers, loss__tis_cap=2.0)
    try:
        rows = [trainer.iterate() for _ in range(3)]
        assert isinstance(trainer.source, Producer)
        worker = trainer.source.workers[0]
        if workers == "processes":
            assert worker.remote is not None
        else:  # an engine of its own, sampling apart from the trainer's
            seeds = [generator.engine.llm.llm_engine.vllm_config.model_config.seed for generator in (worker.components.generator,
                                                                                                   trainer.components.generator)]
            assert worker.components.generator is not trainer.components.generator and seeds[0] != seeds[1]
    finally:
        trainer.close()
    for iteration, row in enumerate(rows):
        assert row.metrics["async/staleness"] <= 1 and row.metrics["time/weight_sync"] > 0
        assert row.batch.prompts[::trainer.recipe.ppo.samples_per_prompt] == [r["prompt"] for r in trainer.stream_records(iteration)]
    # the first batch was sampled by the starting weights, which are the learner's: no gap but the kernels'
    assert rows[0].metrics["check/logprob_gap"] < LOGPROB_TOLERANCE


def test_a_plugins_batch_source_samples_with_the_vllm_generator(recipe_document, byte_model):
    """`[batch_source]` from a third party's module (examples/batch_sources/rollout_log.py) on the
    vllm generator: the weights are pushed before every batch it takes, the sampler's log-probs are
    the learner's, and every row is written where the plugin says."""
    from tests.test_batch_sources import rollout_log_registry
    from tests.test_trainer import make_trainer

    recipe_document["policy"]["model"] = str(byte_model)
    recipe_document["run"]["device"] = "cpu"
    recipe_document["generator"] = {"type": "vllm", "max_new_tokens": 8, "gpu_memory_fraction": 0.02}
    recipe_document["batch_source"] = {"type": "rollout-log", "path": "log/rows.jsonl"}
    trainer = make_trainer(recipe_document, rollout_log_registry())
    try:
        rows = [trainer.step() for _ in range(2)]
    finally:
        trainer.close()
    assert all(row["time/weight_sync"] > 0 and row["check/logprob_gap"] < LOGPROB_TOLERANCE for row in rows)
    logged = [json.loads(line) for line in (Path(recipe_document["run"]["output_dir"]) / "log" / "rows.jsonl").read_text().splitlines()]
    assert [row["iteration"] for row in logged] == [i for i in (1, 2) for _ in range(16)]


def test_an_agent_plays_its_episodes_through_the_endpoint_on_vllm(recipe_document, byte_model, tmp_path, capsys):
    """The `agent` environment on the vllm generator, run by the rlkit command: an agent written
    against the openai package (tests/agent_harnesses.py's talk_and_tell) plays every episode, three
    turns through the endpoint, each answered from its own session; the run trains on them, its rows
    the conversations the agent was answered with the ids vLLM sampled as the ids trained, and the
    sampler's log-probs the learner's."""
    import shutil
    import time

    from transformers import AutoTokenizer

    from rlkit_core.testing import recipe_toml
    from tests import test_agent_processes as agents
    from tests.test_episodes import ends_turns_early

    pytest.importorskip("openai")
    ending = ends_turns_early(shutil.copytree(byte_model, tmp_path / "ending"), agents.END_LOGIT)  # heads of 32: vLLM's CPU attention has no 16
    document = agents.agent_recipe(recipe_document, ending, {"harness": "tests.agent_harnesses:talk_and_tell"})
    document["run"].update(device="cpu", output_dir=str(tmp_path / "run"))
    document["generator"] = {"type": "vllm", "max_new_tokens": 32, "gpu_memory_fraction": 0.02}
    recipe = tmp_path / "recipe.toml"
    recipe.write_text(recipe_toml(document))
    started = time.monotonic()
    done = agents.recorded_run(str(recipe), tmp_path / "told", tmp_path / "rolled", OMP_NUM_THREADS="1")
    took = time.monotonic() - started
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    rows = [row for row in rows if "score/mean" in row]
    assert len(rows) == 2
    for row in rows:
        assert (row["env/status_ok"], row["env/agent_requests"], row["env/own_answers"], row["env/splits"]) == (1.0, agents.TURNS, 1.0, 0.0)
        assert row["check/logprob_gap"] < LOGPROB_TOLERANCE and row["time/weight_sync"] > 0 and row["train/steps_taken"] > 0
    episodes = agents.read_lines((tmp_path / "told").glob("*.jsonl"))
    samples = agents.read_lines([tmp_path / "rolled" / "rollouts-0.jsonl"])
    assert len(samples) > 32  # 16 episodes an iteration, and the before/after report's
    agents.assert_trained_on_what_the_agents_were_answered(episodes, samples, AutoTokenizer.from_pretrained(ending))
    with capsys.disabled():
        print(f"\nrlkit run, an agent through the endpoint on vLLM (CPU): 2 iterations of 16 episodes in {took:.0f} s; "
              f"check/logprob_gap max {max(row['check/logprob_gap'] for row in rows):.1e}")
