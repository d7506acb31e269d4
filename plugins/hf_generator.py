"""Generator `hf`: batched sampling with transformers' `generate` on the policy's own weights."""

from __future__ import annotations

import attrs
import torch

from rlkit_core import hookimpl
from rlkit_core.config import at_least, greater_than, setting
from rlkit_core.functional import logprobs_from_logits, response_mask
from rlkit_core.interfaces import Generation, Generator


@attrs.frozen
class HFGeneratorConfig:
    max_new_tokens: int = setting(64, help="longest response in tokens", validator=greater_than(0))
    min_new_tokens: int = setting(0, help="EOS is forbidden before this many tokens (the sampler then differs from π; keep 0 for exact PPO)", validator=at_least(0))
    temperature: float = setting(1.0, help="sampling temperature, also applied when log-probs are recomputed", validator=greater_than(0))
    batch_size: int = setting(0, help="prompts per generate call, so a large rollout batch fits in memory (0: all at once)", validator=at_least(0))


class HFGenerator(Generator):
    """Pure temperature sampling (no top-k/top-p), so that the sampler is exactly π/T and the
    KL to the reference cannot go negative through truncation."""

    def __init__(self, config: HFGeneratorConfig, context):
        self.config = config
        self.temperature = config.temperature
        self.policy = context.policy

    @torch.no_grad()
    def generate(self, prompt_ids, prompt_mask) -> Generation:
        size = self.config.batch_size or len(prompt_ids)
        if size >= len(prompt_ids):
            return self._generate(prompt_ids, prompt_mask)
        chunks = [self._generate(ids, mask) for ids, mask in zip(prompt_ids.split(size), prompt_mask.split(size))]
        width = max(chunk.response_ids.shape[1] for chunk in chunks)

        def joined(field, pad):
            return torch.cat([torch.nn.functional.pad(getattr(c, field), (0, width - getattr(c, field).shape[1]), value=pad) for c in chunks])

        return Generation(response_ids=joined("response_ids", self.policy.tokenizer.pad_token_id),
                          response_mask=joined("response_mask", 0), logprobs=joined("logprobs", 0.0))

    def _generate(self, prompt_ids, prompt_mask) -> Generation:
        model = self.policy.model
        tokenizer = self.policy.tokenizer
        was_training = model.training
        model.eval()
        out = model.generate(
            input_ids=prompt_ids, attention_mask=prompt_mask, do_sample=True, temperature=self.temperature,
            top_k=0, top_p=1.0, max_new_tokens=self.config.max_new_tokens, min_new_tokens=self.config.min_new_tokens,
            eos_token_id=list(self.policy.eos_token_ids), pad_token_id=tokenizer.pad_token_id,
            return_dict_in_generate=True, output_logits=True,
        )
        model.train(was_training)
        response_ids = out.sequences[:, prompt_ids.shape[1]:]
        logits = torch.stack(out.logits, dim=1)  # [B, R, V], raw: temperature applied below
        mask = response_mask(response_ids, self.policy.eos_token_ids)
        logprobs = logprobs_from_logits(logits, response_ids, self.temperature) * mask
        return Generation(response_ids=response_ids * mask + tokenizer.pad_token_id * (1 - mask), response_mask=mask, logprobs=logprobs)


@hookimpl
def register_generators(register):
    register("hf", HFGenerator, HFGeneratorConfig)
