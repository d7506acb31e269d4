"""Generator `vllm`: sampling with an in-process vLLM engine on the training GPU.

The engine starts from the policy's config with placeholder weights; before every rollout the
policy's current weights (LoRA merged) are pushed into it and its prefix cache is reset, so that it
samples from exactly the π that the trainer scores. Sampling mirrors the `hf` generator: pure
temperature sampling unless the recipe sets top-k/top-p, no penalties, the recipe's max/min new
tokens, every EOS id of the policy, the policy's suppressed ids (an added PAD) never drawn, and the
sampled tokens' log-probs after every processor, as the sampler drew them.

Written against vLLM 0.33.0, read from its source (not run here, no GPU): `vllm.LLM` (generate,
apply_model, reset_prefix_cache, sleep/wake_up), `SamplingParams`, `ModelConfig.logprobs_mode`
("processed_logprobs": log-probs after temperature, top-k/top-p and the token masks, like the hf
generator's log-probs of its processed scores), `ModelConfig.generation_config` ("vllm": no
sampling defaults from the model's generation_config.json), and the models' `load_weights`, which
take the names and layouts of a transformers checkpoint (GPT-2 transposes its Conv1D weights
itself; tied embeddings are loaded once).

The engine sits behind `Engine`, so that a server mode (generation on other GPUs, weights pushed
over a collective) can be a second implementation; only `InProcessEngine` exists today.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import tempfile
import time
from collections.abc import Iterator
from typing import Protocol

import attrs
import torch
from packaging.version import InvalidVersion, Version

from rlkit_core import hookimpl
from rlkit_core.config import at_least, between, greater_than, one_of, setting
from rlkit_core.errors import RecipeError, RunError
from rlkit_core.functional import response_mask
from rlkit_core.interfaces import Generation, Generator
from rlkit_plugins.hf_generator import HFGeneratorConfig

DEVICE_PROBLEM = ('$.run.device: the vllm generator runs on a CUDA GPU, so "cpu" cannot work; '
                  'use run.device = "auto" or "cuda", or generator.type = "hf"')
MIN_VLLM = "0.11.0"  # V1 engine only, `logprobs_mode` and `generation_config = "vllm"` present
INSTALL = 'pip install "rlkit[vllm]"'
DTYPES = ("auto", "float32", "bfloat16", "float16")


@attrs.frozen
class VLLMGeneratorConfig(HFGeneratorConfig):
    """The hf generator's sampling settings (the same words in a recipe), then the engine's."""

    tensor_parallel_size: int = setting(1, help="GPUs the engine shards the model over", validator=greater_than(0))
    gpu_memory_fraction: float = setting(0.3, help="share of each GPU's memory vLLM takes for weights and KV cache (the rest is for training)", validator=between(0.01, 1.0))
    sleep_level: int = setting(0, help="free vLLM's GPU memory while training: 0 keeps it, 1 moves weights to CPU and drops the KV cache, 2 drops both", validator=one_of(0, 1, 2))
    dtype: str = setting("auto", help="engine weights dtype: auto (the policy's), float32, bfloat16 or float16", validator=one_of(*DTYPES))
    max_model_len: int = setting(0, help="longest prompt + response the engine plans its KV cache for (0: the model's context length)", validator=at_least(0))


# --- the recipe-to-engine mapping (pure, tested without vLLM) ------------------------------------


def engine_settings(config: VLLMGeneratorConfig, model_dir: str, policy_dtype: torch.dtype, seed: int) -> dict:
    """Keyword arguments for `vllm.LLM`: weights arrive by push, token ids in and out (no tokenizer)."""
    dtype = config.dtype if config.dtype != "auto" else str(policy_dtype).removeprefix("torch.")
    settings = {
        "model": model_dir,
        "skip_tokenizer_init": True,
        "load_format": "dummy",  # placeholder weights; the first push replaces them
        "dtype": dtype,
        "seed": seed,
        "tensor_parallel_size": config.tensor_parallel_size,
        "gpu_memory_utilization": config.gpu_memory_fraction,
        "enable_sleep_mode": config.sleep_level > 0,
        "enable_prefix_caching": True,
        "logprobs_mode": "processed_logprobs",
        "generation_config": "vllm",
    }
    if config.max_model_len:
        settings["max_model_len"] = config.max_model_len
    return settings


def sampling_settings(config: VLLMGeneratorConfig, eos_token_ids: tuple[int, ...], suppressed: tuple[int, ...], vocab_size: int) -> dict:
    """Keyword arguments for `vllm.SamplingParams` (less `n`), every sampling knob spelled out.
    Suppressed ids are left out of `allowed_token_ids`, which vLLM masks to -inf as transformers'
    `suppress_tokens` does (a logit_bias would be clamped to -100 and leave them a sliver)."""
    return {
        "temperature": config.temperature,
        "top_p": config.top_p,
        "top_k": config.top_k,  # 0: the whole vocabulary
        "min_p": 0.0,
        "repetition_penalty": 1.0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "max_tokens": config.max_new_tokens,
        "min_tokens": config.min_new_tokens,
        "stop_token_ids": list(eos_token_ids),
        "ignore_eos": False,
        "logprobs": 0,  # the sampled token's log-prob only
        "detokenize": False,
        "allowed_token_ids": [i for i in range(vocab_size) if i not in suppressed] if suppressed else None,
    }


def version_problem(version: str) -> str | None:
    """Why this vLLM version cannot serve, or None."""
    try:
        too_old = Version(version) < Version(MIN_VLLM)
    except InvalidVersion:
        return None  # a source build ("dev"): trust it
    if too_old:
        return f"vLLM {version} is older than {MIN_VLLM}, the oldest this generator supports; {INSTALL} --upgrade"
    return None


def missing_here(tensor_parallel_size: int = 1) -> list[str]:
    """What this machine lacks for the vllm generator, in words a user can act on."""
    problems = []
    if importlib.util.find_spec("vllm") is None:
        problems.append(f"vLLM is not installed: {INSTALL} (Linux with a CUDA GPU; vLLM brings its own CUDA build of torch)")
    else:
        too_old = version_problem(importlib.metadata.version("vllm"))
        if too_old:
            problems.append(too_old)
    if not torch.cuda.is_available():
        problems.append("torch sees no CUDA GPU: the vllm generator needs one (use generator.type = 'hf' on this machine)")
    elif torch.cuda.device_count() < tensor_parallel_size:
        problems.append(f"generator.tensor_parallel_size = {tensor_parallel_size} but torch sees {torch.cuda.device_count()} GPU(s)")
    return problems


# --- HF weights as vLLM loads them -----------------------------------------------------------------

PEFT_PREFIX = "base_model.model."


def vllm_weights(model: torch.nn.Module, lora_only: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs with the names `save_pretrained` writes, which is what vLLM's
    `load_weights` reads: a peft model's LoRA deltas folded into their base weights
    (`base_model.model.` prefix, `.base_layer.` and the `lora_A`/`lora_B` tensors gone, the
    trained copy of `modules_to_save`), a tied tensor named once, FSDP2 shards gathered.
    `lora_only`: just the tensors LoRA training changes, for an engine that holds the base already."""
    deltas = _lora_deltas(model)
    seen: set[int] = set()
    for key, tensor in model.state_dict().items():
        if ".lora_" in key or ".original_module." in key:
            continue
        if lora_only and key not in deltas and ".modules_to_save." not in key:
            continue
        if key in deltas:
            tensor = tensor + deltas[key].to(tensor.dtype)
        full = getattr(tensor, "full_tensor", None)  # DTensor under FSDP2: gather the shards
        tensor = full() if callable(full) else tensor
        if tensor.data_ptr() in seen:  # a tied copy (lm_head = embeddings): vLLM loads it once
            continue
        seen.add(tensor.data_ptr())
        yield _checkpoint_name(key), tensor


def _lora_deltas(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """state_dict key of each adapted base weight -> peft's own delta for the active adapter."""
    if not is_peft(model):
        return {}
    from peft.tuners.lora import LoraLayer

    deltas = {}
    for name, module in model.named_modules():
        if isinstance(module, LoraLayer) and not module.merged:
            for adapter in module.active_adapters:
                if adapter in module.lora_A:
                    key = f"{name}.base_layer.weight"
                    delta = module.get_delta_weight(adapter)
                    deltas[key] = deltas[key] + delta if key in deltas else delta
    return deltas


def is_peft(model: torch.nn.Module) -> bool:
    return type(model).__module__.startswith("peft.")


def _checkpoint_name(key: str) -> str:
    key = key.removeprefix(PEFT_PREFIX)
    return key.replace(".base_layer.", ".").replace(".modules_to_save.default.", ".")


# --- the engine seam -------------------------------------------------------------------------------


@attrs.frozen
class Sample:
    token_ids: list[int]
    logprobs: list[float]  # the sampler's log-prob of each token, at the recipe's temperature


class Engine(Protocol):
    """What the generator needs from a vLLM engine, wherever it runs."""

    def generate(self, prompts: list[list[int]], counts: list[int], greedy: bool = False) -> list[list[Sample]]:
        """counts[i] samples for prompts[i] (token ids, no padding); `greedy`: the likeliest tokens."""

    def load_weights(self, weights: Iterator[tuple[str, torch.Tensor]]) -> None: ...

    def reset_prefix_cache(self) -> None: ...

    def sleep(self, level: int) -> None: ...

    def wake_up(self) -> None: ...


class InProcessEngine:
    """`vllm.LLM` in this process, on the training GPU(s). With one GPU the engine core runs in
    this process too (VLLM_ENABLE_V1_MULTIPROCESSING=0), so a weight push hands over tensors
    without copying them through another process; with tensor_parallel_size > 1 vLLM's workers
    are processes and `apply_model` pickles the weights to each (slower; not yet run on a GPU)."""

    def __init__(self, settings: dict, sampling: dict):
        self.in_process = settings["tensor_parallel_size"] == 1
        if self.in_process:
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        else:
            os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # apply_model ships a function
        from vllm import LLM, SamplingParams  # after the environment: vLLM reads it on import

        self._params = SamplingParams
        self.sampling = sampling
        self.llm = LLM(**settings)
        self.asleep = False

    def generate(self, prompts, counts, greedy=False):
        sampling = {**self.sampling, "temperature": 0.0} if greedy else self.sampling  # vLLM: temperature 0 is greedy
        by_count = {count: self._params(**sampling, n=count) for count in set(counts)}  # vLLM copies them per request
        params = [by_count[count] for count in counts]
        requests = [{"prompt_token_ids": ids} for ids in prompts]
        outputs = self.llm.generate(requests, params, use_tqdm=False)
        return [[_sample(completion) for completion in output.outputs] for output in outputs]

    def load_weights(self, weights):
        # In this process the iterator is consumed lazily (one gathered tensor at a time);
        # worker processes need the pairs themselves, pickled.
        pairs = weights if self.in_process else list(weights)
        self.llm.apply_model(lambda model: model.load_weights(iter(pairs)))

    def reset_prefix_cache(self):
        if self.llm.reset_prefix_cache() is False:  # older releases return None
            raise RunError("vLLM refused to reset its prefix cache (requests still running); samples would use stale weights")

    def sleep(self, level):
        self.llm.sleep(level=level)
        self.asleep = True

    def wake_up(self):
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False


def _sample(completion) -> Sample:
    """A vLLM CompletionOutput -> Sample; `logprobs[t]` maps token id -> Logprob at position t."""
    ids = list(completion.token_ids)
    return Sample(token_ids=ids, logprobs=[completion.logprobs[t][token].logprob for t, token in enumerate(ids)])


# --- the generator ---------------------------------------------------------------------------------


def repeat_runs(prompts: list[list[int]]) -> tuple[list[list[int]], list[int]]:
    """Consecutive identical prompts (the loop repeats each prompt samples_per_prompt times) become
    one request with n samples, so the engine prefills each prompt once."""
    unique, counts = [], []
    for prompt in prompts:
        if unique and unique[-1] == prompt:
            counts[-1] += 1
        else:
            unique.append(prompt)
            counts.append(1)
    return unique, counts


def to_generation(samples: list[Sample], eos_token_ids: tuple[int, ...], pad_token_id: int, device) -> Generation:
    """Right-padded [B, R] tensors, R the longest sample: counted up to and including the first end
    token, PAD and log-prob 0 after it."""
    width = max(1, max(len(s.token_ids) for s in samples))
    ids = torch.full((len(samples), width), pad_token_id, dtype=torch.long)
    logprobs = torch.zeros((len(samples), width), dtype=torch.float32)
    present = torch.zeros((len(samples), width), dtype=torch.long)
    for row, sample in enumerate(samples):
        length = len(sample.token_ids)
        ids[row, :length] = torch.tensor(sample.token_ids, dtype=torch.long)
        logprobs[row, :length] = torch.tensor(sample.logprobs, dtype=torch.float32)
        present[row, :length] = 1
    mask = response_mask(ids, eos_token_ids) * present
    return Generation(response_ids=(ids * mask + pad_token_id * (1 - mask)).to(device),
                      response_mask=mask.to(device), logprobs=(logprobs * mask).to(device))


class VLLMGenerator(Generator):
    """Builds its engine from the policy; `engine` may be given (a server client, or a test's)."""

    def __init__(self, config: VLLMGeneratorConfig, context, engine: Engine | None = None):
        self.config = config
        self.temperature = config.temperature
        self.policy = context.policy
        self.device = context.device
        self._metrics: dict[str, float] = {}
        self._pushed = False  # the engine holds the policy's weights
        self.engine = engine or self._start_engine(context)

    def _start_engine(self, context) -> Engine:
        problems = missing_here(self.config.tensor_parallel_size)
        if problems:
            raise RunError("the vllm generator cannot start here: " + "; ".join(problems))
        if context.device.type != "cuda":
            raise RecipeError([DEVICE_PROBLEM])
        model = self.policy.model
        base = model.get_base_model() if is_peft(model) else model
        # config files only (the vocabulary as resized for the PAD token), kept while the engine lives
        self._model_dir = tempfile.TemporaryDirectory(prefix="rlkit-vllm-")
        base.config.save_pretrained(self._model_dir.name)
        base.generation_config.save_pretrained(self._model_dir.name)
        settings = engine_settings(self.config, self._model_dir.name, base.dtype, context.seed)
        sampling = sampling_settings(self.config, self.policy.eos_token_ids, self.policy.suppressed_token_ids, base.config.vocab_size)
        return InProcessEngine(settings, sampling)

    def sync_weights(self, policy) -> None:
        started = time.perf_counter()
        self.engine.wake_up()
        lora_only = self._pushed and is_peft(policy.model)  # the frozen base is in the engine already
        with torch.no_grad():
            self.engine.load_weights(vllm_weights(policy.model, lora_only))
        self.engine.reset_prefix_cache()
        self._pushed = True
        self._metrics["time/weight_sync"] = self._metrics.get("time/weight_sync", 0.0) + time.perf_counter() - started

    def generate(self, prompt_ids, prompt_mask, greedy: bool = False) -> Generation:
        if not self._pushed:
            self.sync_weights(self.policy)
        self.engine.wake_up()
        prompts = [ids[mask.bool()].tolist() for ids, mask in zip(prompt_ids.cpu(), prompt_mask.cpu())]
        unique, counts = repeat_runs(prompts)
        samples = [sample for group in self.engine.generate(unique, counts, greedy) for sample in group]
        if self.config.sleep_level:
            self.engine.sleep(self.config.sleep_level)
            self._pushed = self.config.sleep_level == 1  # level 2 drops the weights
        return to_generation(samples, self.policy.eos_token_ids, self.policy.tokenizer.pad_token_id, self.device)

    def metrics(self) -> dict[str, float]:
        reported, self._metrics = self._metrics, {}
        return reported

    @staticmethod
    def check(config: VLLMGeneratorConfig, recipe) -> tuple[list[str], list[str]]:
        """(problems, notes) of `rlkit check`: a CPU run cannot work anywhere; a machine without
        vLLM or a GPU is this machine's lack, noted under the plan (the recipe may be meant for another)."""
        problems = [DEVICE_PROBLEM] if recipe.run.device == "cpu" else []
        notes = [f"generator: the vLLM engine, which this machine cannot run: {lack}" for lack in missing_here(config.tensor_parallel_size)]
        return problems, notes


@hookimpl
def register_generators(register):
    register("vllm", VLLMGenerator, VLLMGeneratorConfig)
