"""Generator `hf`: batched sampling with transformers' `generate` on the policy's own weights.

Sampling is exactly π/T unless the recipe asks otherwise: rlkit builds the whole generation config
itself (temperature, lengths, its end ids, PAD, the suppressed ids) and swaps it in for the call, so
a hub model's `generation_config.json` (repetition_penalty, no_repeat_ngram_size, top_k, ...) never
changes what is sampled. The sampled log-probs come from the scores after every logits processor,
so `check/logprob_gap` (learner vs sampler) shows any processing that makes the sampler differ from π.
"""

from __future__ import annotations

import contextlib

import attrs
import torch

from rlkit_core import hookimpl
from rlkit_core.config import at_least, between, greater_than, setting
from rlkit_core.functional import response_mask
from rlkit_core.interfaces import Generation, Generator
from rlkit_core.settings import SamplingSettings


@attrs.frozen
class SamplingConfig(SamplingSettings):
    """The sampling settings both built-in generators take (`vllm`'s config adds its engine's)."""

    renamed = {"batch_size": None}  # prompts go to the sampler all at once
    max_new_tokens: int = setting(64, help="longest response in tokens", validator=greater_than(0))
    min_new_tokens: int = setting(0, help="EOS is forbidden before this many tokens (the sampler then differs from π; keep 0 for exact PPO)", validator=at_least(0))
    temperature: float = setting(1.0, help="sampling temperature, also applied when log-probs are recomputed", validator=greater_than(0))
    top_k: int = setting(0, help="sample from the k likeliest tokens only (0: off). Biases PPO: the sampler is no longer π, see README", validator=at_least(0))
    top_p: float = setting(1.0, help="nucleus sampling mass (1.0: off). Biases PPO like top_k", validator=between(0.0, 1.0))


@attrs.frozen
class HFGeneratorConfig(SamplingConfig):
    """The `hf` generator's settings: the sampling settings and how many prompts go into one
    `generate` call."""

    renamed = {}

    batch_size: int = setting(0, help="prompts per generate call, so a large rollout batch fits in memory (0: all at once)", validator=at_least(0))


@contextlib.contextmanager
def generation_config_swapped(model, config):
    """`model.generate` with `config` as the model's own generation config: transformers fills every
    unset field of a passed config from the model's, so passing ours is not enough to shut out the
    checkpoint's sampling defaults."""
    target = model.get_base_model() if hasattr(model, "get_base_model") else model  # peft wraps the transformers model
    saved = target.generation_config
    target.generation_config = config
    try:
        yield
    finally:
        target.generation_config = saved


def without_padding_columns(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompts without the leading columns that no prompt reaches: positions count real
    tokens only, so generation continues each prompt as it would with them."""
    start = int(prompt_mask.any(dim=0).long().argmax())
    return prompt_ids[:, start:], prompt_mask[:, start:]


class HFGenerator(Generator):
    """Pure temperature sampling by default (no top-k/top-p), so that the sampler is exactly π/T
    and the KL to the reference cannot go negative through truncation."""

    runs_under_fsdp = True  # samples with the policy module, inside the engine

    def __init__(self, config: HFGeneratorConfig, context):
        self.config = config
        self.temperature = config.temperature
        self.policy = context.policy

    def generation_config(self, greedy: bool = False):
        """The whole config, every sampling field set here (see the module docstring)."""
        from transformers import GenerationConfig

        tokenizer = self.policy.tokenizer
        common = dict(
            max_new_tokens=self.config.max_new_tokens, min_new_tokens=self.config.min_new_tokens or None,
            eos_token_id=list(self.policy.eos_token_ids), pad_token_id=tokenizer.pad_token_id,
            bos_token_id=tokenizer.bos_token_id, suppress_tokens=list(self.policy.suppressed_token_ids) or None,
            return_dict_in_generate=True, output_scores=True,
        )
        if greedy:
            return GenerationConfig(do_sample=False, **common)
        # top_k 0 is off; left unset, transformers would fill in its default of 50
        return GenerationConfig(do_sample=True, temperature=self.temperature, top_k=self.config.top_k, top_p=self.config.top_p, **common)

    @torch.no_grad()
    def generate(self, prompt_ids, prompt_mask, greedy: bool = False) -> Generation:
        size = self.config.generate_batch or len(prompt_ids)  # 0 (or sampling settings alone): all at once
        if size >= len(prompt_ids):
            return self._generate(*without_padding_columns(prompt_ids, prompt_mask), greedy)
        # Chunks of prompts of similar length, longest first, each without the columns that are
        # padding in all its rows. Rows are sampled independently, so the order changes only which
        # random draws a row gets (greedy responses are the same); the results come back in order.
        order = prompt_mask.sum(dim=1).argsort(descending=True, stable=True)
        chunks = [self._generate(*without_padding_columns(prompt_ids[rows], prompt_mask[rows]), greedy) for rows in order.split(size)]
        width, original = max(chunk.response_ids.shape[1] for chunk in chunks), order.argsort()

        def joined(field, pad):
            return torch.cat([torch.nn.functional.pad(getattr(c, field), (0, width - getattr(c, field).shape[1]), value=pad)
                              for c in chunks])[original]

        return Generation(response_ids=joined("response_ids", self.policy.tokenizer.pad_token_id),
                          response_mask=joined("response_mask", 0), logprobs=joined("logprobs", 0.0))

    def _generate(self, prompt_ids, prompt_mask, greedy: bool) -> Generation:
        model = self.policy.model
        pad = self.policy.tokenizer.pad_token_id
        was_training = model.training
        model.eval()
        with generation_config_swapped(model, self.generation_config(greedy)):
            out = model.generate(input_ids=prompt_ids, attention_mask=prompt_mask)
        model.train(was_training)
        response_ids = out.sequences[:, prompt_ids.shape[1]:]
        scores = torch.stack(out.scores, dim=1)  # [B, R, V] after temperature and every other processor
        mask = response_mask(response_ids, self.policy.eos_token_ids)
        logprobs = torch.log_softmax(scores.float(), dim=-1).gather(-1, response_ids.unsqueeze(-1)).squeeze(-1)
        logprobs = torch.where(mask.bool(), logprobs, 0.0)  # after the end the sampled PAD scores -inf
        return Generation(response_ids=response_ids * mask + pad * (1 - mask), response_mask=mask, logprobs=logprobs)


@hookimpl
def register_generators(register):
    register("hf", HFGenerator, HFGeneratorConfig)
