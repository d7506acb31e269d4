"""The settings of other plugins that rlkit itself reads, declared as fields of bases their config classes inherit.

rlkit checks a recipe across tables: a prompt and the longest response must fit the policy's
context, the memory estimate needs the response length and whether activations are checkpointed,
fp16 and FSDP refuse low-precision weights. It reads those settings by their field names, which
these bases declare (keyword-only, with defaults), so a third-party config gets every such check
by inheriting its kind's base. A config may declare a field again, to change its default, help or
validator; a setting it does not name keeps the base's default:

    @attrs.frozen
    class MyGeneratorConfig(SamplingSettings):
        max_new_tokens: int = setting(128, help="longest response in tokens", validator=greater_than(0))

An environment's base is `rlkit_core.episode_limits.StandardEpisode`.
"""

from __future__ import annotations

import attrs

from rlkit_core.config import at_least, greater_than, one_of, setting
from rlkit_core.hf import DTYPES
from rlkit_core.prompts import PromptLengthLimit

__all__ = ["ModelSettings", "PolicySettings", "PromptLengthLimit", "SamplingSettings"]


@attrs.frozen
class SamplingSettings:
    """A generator's settings that rlkit reads. The prompt-fits-the-context check, the memory
    estimate, DAPO's overlong buffer and Dr. GRPO's default norm count with `max_new_tokens`; the
    memory estimate with `batch_size`."""

    max_new_tokens: int = setting(64, help="longest response in tokens", validator=greater_than(0), kw_only=True)
    batch_size: int = setting(0, help="prompts per generate call, so a large rollout batch fits in memory (0: all at once)",
                              validator=at_least(0), kw_only=True)


@attrs.frozen(slots=False)  # no slots: a policy's config inherits it beside PolicySettings
class ModelSettings:
    """A component that loads a transformers model, and its tokenizer, by name. A separate critic
    is checked against the policy's tokenizer, and `rlkit check` audits its chat template, when the
    policy's config inherits this."""

    model: str = setting(help="a local model directory, or a hub name when the machine has network", kw_only=True)
    tokenizer: str = setting("", help="tokenizer directory or hub name (empty: the model's)", kw_only=True)
    trust_remote_code: bool = setting(False, help="allow model code from the checkpoint (only for checkpoints you trust)", kw_only=True)


@attrs.frozen
class PolicySettings:
    """A policy's settings that rlkit reads: fp16 mixed precision and FSDP refuse low-precision
    weights, and the memory estimate counts checkpointed activations. A policy that loads its model
    by name inherits `ModelSettings` as well."""

    dtype: str = setting("float32", help="weights dtype: float32, bfloat16 or float16", validator=one_of(*DTYPES), kw_only=True)
    gradient_checkpointing: bool = setting(False, help="trade compute for memory in the training forward pass", kw_only=True)
