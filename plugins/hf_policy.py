"""Policy `hf`: any transformers causal LM, with optional LoRA through peft.

The reference is a frozen copy of the starting weights, or, with LoRA, the same base with the
adapters disabled, so that one copy of the base weights serves both.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
from typing import Any, cast

import attrs
import torch

from rlkit_core import (
    ModelSettings,
    ModelShape,
    Policy,
    PolicyOutput,
    PolicySettings,
    RecipeError,
    at_least,
    building_at,
    hookimpl,
    setting,
    switch_off_dropout,
)
from rlkit_core.hf import DTYPES, LOAD_ERRORS, check_model, context_length, load_problem, settle_pad, shard_units


@attrs.frozen
class HFPolicyConfig(PolicySettings, ModelSettings):
    """The model, its tokenizer and weights dtype (the settings rlkit reads), then LoRA and the end tokens."""

    lora_r: int = setting(0, help="LoRA rank (0: train all weights)", validator=at_least(0))
    lora_alpha: int = setting(16, help="LoRA scaling α", validator=at_least(1))
    lora_target_modules: list[str] = setting(factory=list, help="module names LoRA adapts (empty: peft's default for the architecture)")
    end_tokens: list[str] = setting(
        factory=list, help="more tokens that end a response, besides the tokenizer's EOS and the model's generation_config eos ids (e.g. '<|im_end|>')")


def load_tokenizer(name: str, trust_remote_code: bool = False, where: str = "$.policy"):
    """A left-padding tokenizer that has an EOS; its PAD is settled by `settle_pad` once the
    model's end ids are known."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(name, trust_remote_code=trust_remote_code)
    tokenizer.padding_side = "left"
    if tokenizer.eos_token_id is None:
        raise RecipeError([f"{where}.tokenizer: tokenizer {name!r} has no EOS token; responses could never end"])
    return tokenizer


def end_token_ids(tokenizer, generation_config, end_tokens=(), where: str = "$.policy") -> tuple[int, ...]:
    """The tokenizer's EOS first, then every other end id the model's generation config names
    (chat models stop on an end-of-turn token as well as on end-of-text), then the recipe's."""
    named = generation_config.eos_token_id
    ids = [tokenizer.eos_token_id, *(named if isinstance(named, (list, tuple)) else [named])]
    for token in end_tokens:
        index = tokenizer.convert_tokens_to_ids(token)
        if index is None or (index == tokenizer.unk_token_id and token != tokenizer.unk_token):
            raise RecipeError([f"{where}.end_tokens: {token!r} is not a token of the policy's tokenizer; "
                               "name it exactly as the tokenizer spells it (see tokenizer.json's added_tokens)"])
        ids.append(index)
    return tuple(dict.fromkeys(i for i in ids if i is not None))


def fuse_gelu(model: torch.nn.Module) -> None:
    """GPT-2's `gelu_new` runs as seven elementwise kernels forward and more backward (13 ms for a
    [1280, 1024] activation on one CPU core); torch's tanh GELU is the same function in one kernel
    (3.6 ms), equal up to float rounding."""
    from transformers.activations import NewGELUActivation

    for module in list(model.modules()):
        for name, child in module.named_children():
            if isinstance(child, NewGELUActivation):
                setattr(module, name, torch.nn.GELU(approximate="tanh"))


class HFPolicy(Policy):
    # transformers builds a block-diagonal causal mask from restarting position ids when no
    # attention mask is passed (its masking utilities, which every built-in architecture uses)
    packs_sequences = True

    def __init__(self, config: HFPolicyConfig, context=None):
        from transformers import AutoModelForCausalLM

        self.config = config
        where = building_at(context, "policy")
        try:
            self.tokenizer = load_tokenizer(config.tokenizer or config.model, config.trust_remote_code, where)
        except (OSError, ValueError) as exc:
            setting = "tokenizer" if config.tokenizer else "model"
            raise RecipeError([load_problem(config.tokenizer or config.model, f"{where}.{setting}", "a tokenizer", exc)]) from None
        try:
            base = AutoModelForCausalLM.from_pretrained(config.model, dtype=DTYPES[config.dtype], trust_remote_code=config.trust_remote_code)
        except LOAD_ERRORS as exc:
            raise RecipeError([load_problem(config.model, f"{where}.model", "a causal language model", exc)]) from None
        self.eos_token_ids = end_token_ids(self.tokenizer, base.generation_config, config.end_tokens, where)
        if settle_pad(self.tokenizer, self.eos_token_ids):
            # The added PAD only fills masked positions; it must never be sampled or take
            # probability from real tokens, so the loop masks it out of every softmax.
            self.suppressed_token_ids = (self.tokenizer.pad_token_id,)
        if len(self.tokenizer) > cast(torch.nn.Embedding, base.get_input_embeddings()).num_embeddings:
            base.resize_token_embeddings(len(self.tokenizer))  # a row for the added PAD (none spare, as in GPT-2)
        self.context_length = context_length(base.config)
        base.config.pad_token_id = self.tokenizer.pad_token_id
        base.generation_config.pad_token_id = self.tokenizer.pad_token_id
        base.generation_config.eos_token_id = list(self.eos_token_ids)
        switch_off_dropout(base)
        fuse_gelu(base)
        # Logits only where the loop reads them, when the model can skip the others (most
        # transformers causal LMs take `logits_to_keep`); the trunk's last hidden state, for the
        # value head, without keeping every layer's.
        self._keeps_logits = "logits_to_keep" in inspect.signature(base.forward).parameters
        self._trunk = getattr(base, base.base_model_prefix, None)
        if config.gradient_checkpointing:  # acts while the loop trains (training mode, dropout off)
            # non-reentrant: with LoRA the frozen base's activations need no grad, and reentrant
            # checkpointing would then drop the adapters' gradients
            base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if context is not None:
            base.to(context.device)

        if config.lora_r:
            from peft import LoraConfig, get_peft_model

            lora = LoraConfig(r=config.lora_r, lora_alpha=config.lora_alpha, lora_dropout=0.0,
                              target_modules=list(config.lora_target_modules) or None, task_type="CAUSAL_LM")
            self._model: Any = get_peft_model(base, lora)  # a peft model, or the transformers one: each has its own methods
            self._reference = None
        else:
            self._model = base
            self._reference = copy.deepcopy(base).eval().requires_grad_(False)

    @property
    def model(self) -> torch.nn.Module:
        return self._model

    def shard_units(self) -> list[type]:
        return shard_units(self._model)

    @staticmethod
    def check(config: HFPolicyConfig, recipe, where: str) -> tuple[list[str], list[str]]:
        """(problems, notes) of `rlkit check`: a local model folder must hold a model, and the tokenizer
        must load (a missing directory is named)."""
        problems, notes = [], []
        check_model(config.model, config.tokenizer, where, problems, notes, config.trust_remote_code)
        return problems, notes

    @staticmethod
    def shape(config: HFPolicyConfig):
        """The model's shape from its config file alone (no weights loaded); None when unreadable."""
        from transformers import AutoConfig, AutoModelForCausalLM

        try:
            model_config = AutoConfig.from_pretrained(config.model, trust_remote_code=config.trust_remote_code)
        except LOAD_ERRORS:  # no config to read here (`check` locates why)
            return None
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(model_config)
            if config.lora_r:
                from peft import LoraConfig, get_peft_model

                skeleton = get_peft_model(skeleton, LoraConfig(r=config.lora_r, lora_alpha=config.lora_alpha,
                                                               target_modules=list(config.lora_target_modules) or None, task_type="CAUSAL_LM"))
        text = model_config.get_text_config()
        return ModelShape(
            parameters=sum(p.numel() for p in skeleton.parameters()),
            trainable=sum(p.numel() for p in skeleton.parameters() if p.requires_grad),
            layers=text.num_hidden_layers, hidden=text.hidden_size, heads=text.num_attention_heads, vocab=text.vocab_size,
            weight_bytes=DTYPES[config.dtype].itemsize, reference_copy=not config.lora_r,
        )

    @staticmethod
    def describe(config: HFPolicyConfig) -> list[str]:
        """Size from the model's config alone (no weights loaded)."""
        shape = HFPolicy.shape(config)
        if shape is None:
            return [f"{config.model}: config not readable here (a hub name without network?); size unknown"]
        note = "base shared by policy and reference; LoRA adapters trained" if config.lora_r else "policy + frozen reference copy"
        return [f"{shape.parameters:,} parameters ({config.dtype}), {shape.trainable:,} trained; {note}"]

    def _logits(self, model, input_ids, attention_mask, position_ids, start: int, **options):
        """(model output, logits at positions `start`..L-1)."""
        keep = {"logits_to_keep": input_ids.shape[1] - start} if self._keeps_logits else {}
        out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False,
                    **keep, **options)
        return out, out.logits if keep else out.logits[:, start:]

    def forward(self, input_ids, attention_mask, position_ids, start: int = 0) -> PolicyOutput:
        if self._trunk is None:  # no separate trunk to listen to: ask for every layer's hidden states
            out, logits = self._logits(self._model, input_ids, attention_mask, position_ids, start, output_hidden_states=True)
            return PolicyOutput(logits=logits, hidden=out.hidden_states[-1])
        hidden = []
        listener = self._trunk.register_forward_hook(lambda module, args, output: hidden.append(output.last_hidden_state))
        try:
            _, logits = self._logits(self._model, input_ids, attention_mask, position_ids, start)
        finally:
            listener.remove()
        return PolicyOutput(logits=logits, hidden=hidden[-1])

    @torch.no_grad()
    def reference_logits(self, input_ids, attention_mask, position_ids, start: int = 0) -> torch.Tensor:
        if self._reference is not None:
            model, adapters_off = self._reference, contextlib.nullcontext()
        else:
            model, adapters_off = self._model, self._model.disable_adapter()
        with adapters_off:
            return self._logits(model, input_ids, attention_mask, position_ids, start)[1]

    def parameters(self):
        return [p for p in self._model.parameters() if p.requires_grad]

    def state_dict(self):
        return {name: p.detach().clone() for name, p in self._model.named_parameters() if p.requires_grad}

    def load_state_dict(self, state) -> None:
        params = dict(self._model.named_parameters())
        missing = [name for name, p in params.items() if p.requires_grad and name not in state]
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} trainable tensors, e.g. {missing[0]!r}")
        with torch.no_grad():
            for name, value in state.items():
                params[name].copy_(value)

    def save_pretrained(self, path: str, merge_adapters: bool = True) -> None:
        model = self._model
        if self.config.lora_r and merge_adapters:
            model = copy.deepcopy(model).merge_and_unload()
        model.save_pretrained(path)
        self.tokenizer.save_pretrained(path)


@hookimpl
def register_policies(register):
    register("hf", HFPolicy, HFPolicyConfig)
