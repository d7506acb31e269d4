"""The vllm generator on vLLM servers (`engine = "server"`, plugins/vllm_server.py): how a recipe
becomes `vllm serve` flags and a pushed checkpoint (no vLLM needed), then real servers of vLLM's
CPU build, one started as a user would and the ones `rlkit run` starts (marked vllm: .ci/run runs
them in .venv-vllm)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from rlkit_plugins.vllm_generator import VLLMGenerator, VLLMGeneratorConfig, installed_vllm, recipe_problems, vllm_weights
from rlkit_plugins.vllm_server import CHECKPOINT, DEV_MODE, STARTED_BY, server_arguments, write_checkpoint

from tests.test_vllm_cpu import (
    ENGINE,
    LOGPROB_TOLERANCE,
    TEXTS,
    TwoWaves,
    _context,
    _generating_stage,
    _max_gap,
    _prompts,
    lora_push_gaps,
    moved_lora_policy,
    pad_leaning_policy,
    write_byte_model,
)

FOUND = installed_vllm()
LORA_TOLERANCE = 5e-4
SERVER_MODULE = "vllm.entrypoints.openai.api_server"


# --- the recipe, the flags and the checkpoint (no vLLM) -------------------------------------------------


def test_server_flags_are_the_in_process_engines_settings_on_loopback():
    settings = {"model": "/w", "skip_tokenizer_init": True, "load_format": "dummy", "dtype": "float32", "seed": 3,
                "enable_sleep_mode": False, "logprobs_mode": "processed_logprobs", "kv_cache_memory_bytes": 1000}
    assert server_arguments(settings, 8123) == [
        "--model", "/w", "--skip-tokenizer-init", "--dtype", "float32", "--seed", "3", "--logprobs-mode", "processed_logprobs",
        "--kv-cache-memory-bytes", "1000", "--enable-scale-out", "--host", "127.0.0.1", "--port", "8123"]


def test_the_pushed_checkpoint_names_a_tied_head_and_says_untied(tmp_path):
    from safetensors.torch import load_file
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=8, n_layer=1, n_head=2))
    assert model.config.tie_word_embeddings
    write_checkpoint(vllm_weights(model, untied=True), model.config, tmp_path)
    saved = load_file(str(tmp_path / CHECKPOINT))
    assert torch.equal(saved["lm_head.weight"], model.transformer.wte.weight) and "transformer.wte.weight" in saved
    assert json.loads((tmp_path / "config.json").read_text())["tie_word_embeddings"] is False
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", CHECKPOINT]  # no partial file left
    assert "lm_head.weight" not in dict(vllm_weights(model))  # the in-process engine's push names it once


def test_a_weights_dir_that_holds_another_checkpoint_is_refused(tmp_path):
    """A server reloads every safetensors file of the directory: a model's own shards there would be read with each push."""
    from rlkit_core.errors import RunError

    (tmp_path / "model-00001-of-00002.safetensors").write_bytes(b"")
    with pytest.raises(RunError, match="holds other safetensors files \\(model-00001-of-00002.safetensors\\)"):
        write_checkpoint(iter([]), None, tmp_path)


@pytest.mark.parametrize(("options", "processes", "words"), [
    ({"server_urls": ["http://h:8000"]}, 1, 'generator.server_urls is for engine = "server"'),
    ({"weights_dir": "/shared"}, 1, 'generator.weights_dir is for engine = "server"'),
    ({"engine": "server", "server_urls": ["http://h:8000"]}, 1, "generator.weights_dir: servers at server_urls reload"),
    ({"engine": "server"}, 2, 'generator.engine = "server" under 2 trainer processes'),
])
def test_server_settings_that_cannot_work_are_refused_at_their_place(options, processes, words):
    [problem] = recipe_problems(VLLMGeneratorConfig(**options), "generator", processes)
    assert words in problem


def test_check_names_the_servers_and_asks_nothing_of_this_machine(recipe_document, write_recipe, capsys):
    """With servers at URLs vLLM need not be installed where the trainer runs."""
    from rlkit_core.runtime.cli import main

    recipe_document["generator"] = {"type": "vllm", "engine": "server", "server_urls": ["http://gen-1:8000"], "weights_dir": "/shared/w"}
    assert main(["check", write_recipe(recipe_document)]) == 0
    notes = capsys.readouterr().out.split("not checked:")[1]
    assert "  generator: samples on the vllm serve processes at http://gen-1:8000, each push written to /shared/w" in notes
    assert "cannot run" not in notes and "vLLM found" not in notes


def test_a_server_url_that_is_not_one_is_refused_at_its_place(recipe_document, write_recipe, capsys):
    from rlkit_core.runtime.cli import main

    recipe_document["generator"] = {"type": "vllm", "engine": "server", "server_urls": ["gen-1:8000"], "weights_dir": "/w"}
    assert main(["check", write_recipe(recipe_document)]) == 2
    assert "$.generator.server_urls: each must be a server's base URL, such as http://gen-1:8000; got 'gen-1:8000'" in capsys.readouterr().err


def test_check_refuses_servers_at_urls_without_a_shared_directory(recipe_document, write_recipe, capsys):
    from rlkit_core.runtime.cli import main

    recipe_document["generator"] = {"type": "vllm", "engine": "server", "server_urls": ["http://gen-1:8000"]}
    assert main(["check", write_recipe(recipe_document)]) == 2
    assert "$.generator.weights_dir: servers at server_urls reload each push" in capsys.readouterr().err


def test_servers_at_urls_are_refused_with_batches_made_ahead(recipe_document, write_recipe, capsys):
    from rlkit_core.runtime.cli import main

    recipe_document["generator"] = {"type": "vllm", "engine": "server", "server_urls": ["http://gen-1:8000"], "weights_dir": "/w"}
    recipe_document["scheduler"] = {"max_staleness": 1}
    recipe_document["loss"] = {"type": "ppo-clip", "tis_cap": 2.0}
    assert main(["check", write_recipe(recipe_document)]) == 2
    assert "$.generator.server_urls with [scheduler] max_staleness = 1: the batches made ahead" in capsys.readouterr().err


def test_a_server_that_does_not_answer_is_a_located_error(tiny_model, tmp_path):
    """Servers at URLs need no vLLM here; one that is not there ends the run with where and why."""
    from rlkit_plugins.hf_policy import HFPolicy, HFPolicyConfig

    from rlkit_core.errors import RunError
    from rlkit_core.recipe.document import structure_table

    config, _ = structure_table({"model": str(tiny_model)}, HFPolicyConfig, "policy")
    tiny = HFPolicy(config, _context(tmp_path))
    url = f"http://127.0.0.1:{_free_port()}"
    generator = VLLMGenerator(VLLMGeneratorConfig(engine="server", server_urls=[url], weights_dir=str(tmp_path / "w"), server_timeout=5),
                              _context(tmp_path, tiny))
    with pytest.raises(RunError, match=f"the vLLM server at {url} could not be reached or did not answer POST /collective_rpc") as caught:
        generator.sync_weights(tiny)
    assert "VLLM_SERVER_DEV_MODE=1 and --enable-scale-out" in str(caught.value)


def test_a_started_server_that_exits_before_it_is_ready_is_a_located_error(tmp_path):
    """Here vLLM's module may be missing or the model directory is empty: either way the server
    exits, and the error quotes its log."""
    from rlkit_plugins.vllm_server import StartedServer

    from rlkit_core.errors import RunError

    server = StartedServer({"model": str(tmp_path / "no-model"), "skip_tokenizer_init": True}, tmp_path / "server.log")
    with pytest.raises(RunError, match=r"the vLLM server rlkit started exited with code \d+ before it was ready \(its log, .*server\.log, ends: "):
        server.wait_ready(timeout=300)


def _free_port() -> int:
    from rlkit_plugins.vllm_server import free_port

    return free_port()


# --- a server started as a user would, at a URL -----------------------------------------------------------


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    return pad_leaning_policy(tmp_path_factory.mktemp("gpt2-style"))


@pytest.fixture(scope="module")
def byte_model(tmp_path_factory):
    return write_byte_model(tmp_path_factory.mktemp("byte-gpt2"))


@pytest.fixture(scope="module")
def running_server(policy, tmp_path_factory):
    """`vllm serve` with the flags docs/generators.md gives, from the policy's checkpoint (untied, as
    vLLM's CPU build needs), and the directory the pushes go to."""
    if FOUND is None or not FOUND.cpu:
        pytest.skip("needs vLLM's CPU build")
    start = tmp_path_factory.mktemp("served-model")
    write_checkpoint(vllm_weights(policy.model, untied=True), policy.model.config, start)
    port = _free_port()
    log = start / "server.log"
    command = [sys.executable, "-m", SERVER_MODULE, "--model", str(start), "--enable-scale-out", "--skip-tokenizer-init",
               "--logprobs-mode", "processed_logprobs", "--generation-config", "vllm", "--enable-prefix-caching",
               "--dtype", "float32", "--max-model-len", "128", "--enforce-eager", "--kv-cache-memory-bytes", str(200 << 20),
               "--host", "127.0.0.1", "--port", str(port)]
    with open(log, "w") as out:
        server = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, DEV_MODE: "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            assert server.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            try:
                urllib.request.urlopen(url + "/health", timeout=1)
                break
            except OSError:
                time.sleep(0.5)
        yield url, tmp_path_factory.mktemp("pushes")
    finally:
        server.terminate()
        server.wait(timeout=60)


@pytest.fixture()
def served(policy, running_server, tmp_path):
    url, pushes = running_server
    config = VLLMGeneratorConfig(**ENGINE, engine="server", server_urls=[url], weights_dir=str(pushes))
    generator = VLLMGenerator(config, _context(tmp_path, policy))
    yield generator
    generator.engine.close()


@pytest.mark.vllm
def test_a_running_server_samples_what_transformers_would_before_and_after_pushes(policy, served):
    """Sampled ids and log-probs from the server equal transformers' at the recipe's temperature, the
    suppressed PAD (the likeliest token) never drawn, each response ending at either end id; after
    the policy moves and is pushed (a checkpoint reloaded from the shared directory), again."""
    prompt_ids, prompt_mask = _prompts(policy, TEXTS)
    gaps = []
    for step in range(2):
        if step:
            torch.manual_seed(4)
            with torch.no_grad():
                for parameter in policy.model.parameters():
                    parameter.add_(torch.randn_like(parameter) * 0.05)
        served.sync_weights(policy)
        out = served.generate(prompt_ids, prompt_mask)
        assert not (out.response_ids[out.response_mask.bool()] == policy.tokenizer.pad_token_id).any()
        ended = out.response_mask.sum(1) < out.response_ids.shape[1]
        last = out.response_ids.gather(1, (out.response_mask.sum(1, keepdim=True) - 1).clamp(min=0))[:, 0]
        assert all(int(token) in policy.eos_token_ids for token in last[ended])
        gaps.append(_max_gap(policy, prompt_ids, prompt_mask, out))
    assert max(gaps) < LOGPROB_TOLERANCE
    assert served.pop_metrics()["time/weight_sync"] > 0


@pytest.mark.vllm
def test_turns_served_one_by_one_answer_as_a_batch_would(policy, served):
    """`serve` sends each arrival at once beside the ones in flight; greedy, every request is
    answered once with generate's ids and log-probs."""
    first, then = ["the quick", "summarise the document:"], ["hello world", "abc", "x"]
    waves = TwoWaves(policy, first, then)
    served.sync_weights(policy)
    served.serve(waves, greedy=True)
    assert sorted(waves.answers) == sorted(first + then)
    prompt_ids, prompt_mask = _prompts(policy, first + then)
    for text, expected in zip(first + then, served.generate(prompt_ids, prompt_mask, greedy=True).completions()):
        assert waves.answers[text].ids == expected.ids
        assert waves.answers[text].logprobs == pytest.approx(expected.logprobs, abs=LOGPROB_TOLERANCE)


@pytest.mark.vllm
def test_the_push_check_catches_a_server_that_ignores_the_update(policy, running_server, tmp_path, monkeypatch):
    """The checkpoint is written but the server is never told to reload (a server that ignores the
    update): the first push after the policy moves stops the run (a 1e-3 step moves this sharp
    model past the tolerance, so the first rule names it). With `min_new_tokens`, which the probe's
    one-token scoring request must not inherit (vLLM refuses a minimum above the maximum)."""
    from rlkit_plugins import vllm_server

    from rlkit_core.runtime import rollout
    from rlkit_core.runtime.push_check import WeightPushFailed

    url, pushes = running_server
    config = VLLMGeneratorConfig(**ENGINE, min_new_tokens=2, engine="server", server_urls=[url], weights_dir=str(pushes))
    served = VLLMGenerator(config, _context(tmp_path, policy))
    prompts = [_prompts(policy, TEXTS)]
    engine, components = _generating_stage(policy, served)
    rollout.generate(engine, components, prompts, greedy=False)
    engine_of_server = served.engine
    monkeypatch.setattr(engine_of_server, "load_weights",
                        lambda weights: vllm_server.write_checkpoint(weights, engine_of_server.model_config, engine_of_server.weights_dir))
    with torch.no_grad():
        for parameter in policy.model.parameters():
            parameter.add_(torch.randn_like(parameter) * 1e-3)
    with pytest.raises(WeightPushFailed, match="failed the check: its log-probs of the probe differ"):
        rollout.generate(engine, components, prompts, greedy=False)


@pytest.mark.vllm
def test_a_second_generator_pushing_to_the_same_server_is_caught(policy, running_server, tmp_path):
    """Two runs (or a run's two generators) on one server race each other's weights: each push
    labels the server's weights, the label comes back on every sampled token, and the generator
    whose weights were replaced stops at its next request instead of training on the other's samples."""
    from rlkit_core.errors import RunError

    url, _ = running_server
    ours, theirs = (VLLMGenerator(VLLMGeneratorConfig(**ENGINE, engine="server", server_urls=[url], weights_dir=str(tmp_path / name)),
                                  _context(tmp_path, policy)) for name in ("ours", "theirs"))
    prompt_ids, prompt_mask = _prompts(policy, TEXTS)
    ours.sync_weights(policy)
    ours.generate(prompt_ids, prompt_mask)
    theirs.sync_weights(policy)
    with pytest.raises(RunError, match=f"the vLLM server at {url} sampled tokens 0 to .* with weights labelled 'rlkit-.*-1', not this "
                                       r"run's last push \('rlkit-.*-1'\): another run"):
        ours.generate(prompt_ids, prompt_mask)
    theirs.generate(prompt_ids, prompt_mask)


# --- servers rlkit starts ---------------------------------------------------------------------


@pytest.mark.vllm
@pytest.mark.skipif(FOUND is None or not FOUND.cpu, reason="needs vLLM's CPU build")
def test_a_lora_policy_reaches_a_server_merged_at_its_start_and_at_every_push(tmp_path, capsys):
    """The server starts from the merged model rlkit writes, and each push after the adapters move
    reaches it: its log-probs are the merged model's, and the push check agrees."""
    policy = moved_lora_policy(tmp_path / "lora-model")
    generator = VLLMGenerator(VLLMGeneratorConfig(**ENGINE, engine="server"), _context(tmp_path, policy))
    try:
        gaps, push_gaps = lora_push_gaps(policy, generator)
    finally:
        generator.engine.close()
    with capsys.disabled():
        print(f"\nvLLM server (CPU) vs the merged LoRA model, max |log-prob gap| per push: {', '.join(f'{g:.1e}' for g in gaps)}; "
              f"push check gap: {', '.join(f'{g:.1e}' for g in push_gaps)}")
    # the merged model's logits are sharp (adapters moved by 0.3): float32 on both sides, different kernels, measured up to
    # 1.2e-4 at a sampled token here (the in-process engine's up to 6e-5); the push check's mean gap stays near 1e-6
    assert max(gaps) < LORA_TOLERANCE and max(push_gaps) < 1e-3


def _started_by(pid: int) -> list[int]:
    """Pids of the processes of the vLLM servers that the run with this pid started, found by the
    environment they were given (vLLM retitles its processes, so their command lines do not say)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and f"{STARTED_BY}={pid}".encode() in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return found


def _server_recipe(recipe_document, byte_model, tmp_path, steps):
    from rlkit_core.testing import recipe_toml

    recipe_document["policy"]["model"] = str(byte_model)
    recipe_document["run"].update(device="cpu", steps=steps, output_dir=str(tmp_path / "run"))
    recipe_document["generator"] = {"type": "vllm", "max_new_tokens": 8, "gpu_memory_fraction": 0.02, "engine": "server", "servers": 2}
    recipe = tmp_path / "recipe.toml"
    recipe.write_text(recipe_toml(recipe_document))
    return [str(Path(sys.executable).parent / "rlkit"), "run", str(recipe), "--quiet"]


@pytest.mark.vllm
@pytest.mark.skipif(FOUND is None or not FOUND.cpu, reason="needs vLLM's CPU build")
def test_rlkit_run_trains_on_two_servers_it_starts_and_stops_them(recipe_document, byte_model, tmp_path, capsys):
    """Every push lands on both servers (the push check passes each iteration, the sampler's log-probs
    are the learner's) and no server outlives the run."""
    started = time.monotonic()
    run = subprocess.Popen(_server_recipe(recipe_document, byte_model, tmp_path, steps=3), stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    _, errors = run.communicate(timeout=900)
    assert run.returncode == 0, errors[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    rows = [row for row in rows if "score/mean" in row]
    assert len(rows) == 3
    assert all(row["check/logprob_gap"] < LOGPROB_TOLERANCE and row["check/push_gap"] < 1e-3 and row["time/weight_sync"] > 0 for row in rows)
    _assert_all_end(run.pid, within=30)
    with capsys.disabled():
        print(f"\nrlkit run on 2 vLLM servers (CPU): 3 iterations in {time.monotonic() - started:.0f} s with the servers' start; "
              f"weight push {sum(row['time/weight_sync'] for row in rows) / 3:.3f} s an iteration, check/logprob_gap max "
              f"{max(row['check/logprob_gap'] for row in rows):.1e}")


@pytest.mark.vllm
@pytest.mark.skipif(FOUND is None or not FOUND.cpu, reason="needs vLLM's CPU build")
def test_a_run_killed_takes_its_servers_with_it(recipe_document, byte_model, tmp_path):
    """SIGKILL to the trainer, which runs no cleanup: the servers end with it (they were started to
    receive SIGTERM when their parent dies)."""
    run = subprocess.Popen(_server_recipe(recipe_document, byte_model, tmp_path, steps=200), stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, env={**os.environ, "OMP_NUM_THREADS": "1"})
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.monotonic() + 600
    while not (metrics.exists() and "score/mean" in metrics.read_text()):
        assert run.poll() is None and time.monotonic() < deadline
        time.sleep(1)
    assert len(_started_by(run.pid)) >= 2  # the two servers and their engines' processes
    os.kill(run.pid, signal.SIGKILL)
    run.wait()
    _assert_all_end(run.pid, within=60)


def _assert_all_end(pid: int, within: float) -> None:
    deadline = time.monotonic() + within
    while left := _started_by(pid):
        assert time.monotonic() < deadline, f"processes of the servers outlived their run: {left}"
        time.sleep(0.5)


@pytest.mark.vllm
@pytest.mark.skipif(FOUND is None or not FOUND.cpu, reason="needs vLLM's CPU build")
def test_batches_made_ahead_sample_on_servers_of_their_own(recipe_document, byte_model):
    """`max_staleness = 1` with `engine = "server"`: the producer's generator starts a server of its
    own, pushed the producer's copy of the weights at each batch, while the trainer's serves the
    evaluation; every batch is at most one version old and its sampler's log-probs are the copy's."""
    from rlkit_core.recipe.plugins import load_registry
    from rlkit_core.runtime.scheduling import Producer
    from tests.test_trainer import make_trainer

    recipe_document["policy"]["model"] = str(byte_model)
    recipe_document["run"]["device"] = "cpu"
    recipe_document["generator"] = {"type": "vllm", "max_new_tokens": 8, "gpu_memory_fraction": 0.02, "engine": "server"}
    trainer = make_trainer(recipe_document, load_registry(environ={"RLKIT_PLUGINS": "none"}), scheduler__max_staleness=1,
                           loss__tis_cap=2.0)
    try:
        rows = [trainer.iterate() for _ in range(3)]
        assert isinstance(trainer.source, Producer)
        workers_engine, trainers_engine = trainer.source.workers[0].components.generator.engine, trainer.components.generator.engine
        assert set(workers_engine.urls).isdisjoint(trainers_engine.urls)
    finally:
        trainer.close()
    for row in rows:
        assert row.metrics["async/staleness"] <= 1 and row.metrics["time/weight_sync"] > 0
        assert row.metrics["check/push_gap"] < 1e-3
    assert rows[0].metrics["check/logprob_gap"] < LOGPROB_TOLERANCE


@pytest.mark.vllm
@pytest.mark.skipif(FOUND is None or not FOUND.cpu, reason="needs vLLM's CPU build")
def test_killed_with_batches_made_ahead_on_servers_and_resumed_it_trains_every_prompt_once(recipe_document, write_recipe, byte_model,
                                                                                              tmp_path):
    """`max_staleness = 1` on servers (the trainer's and the producer's each their own), SIGKILLed
    twice with a batch in flight: the servers die with each run, the resumed runs start new ones,
    and every iteration's prompts are trained once, in order, as in an uninterrupted run."""
    from tests.test_scheduling import SLOW_REWARD, prompts_trained_whole_and_killed

    reward = tmp_path / "slow.py"
    reward.write_text(SLOW_REWARD.format(most=0.2, counter=tmp_path / "unused"))
    recipe_document["reward"] = {"type": "python", "function": f"{reward}:jittery"}
    recipe_document["policy"]["model"] = str(byte_model)
    recipe_document["run"]["device"] = "cpu"
    recipe_document["generator"] = {"type": "vllm", "max_new_tokens": 8, "gpu_memory_fraction": 0.02, "engine": "server"}
    recipe_document["scheduler"] = {"max_staleness": 1}
    expected, trained = prompts_trained_whole_and_killed(recipe_document, write_recipe, tmp_path, steps=5, wait_s=600)
    assert trained == expected
