"""The sampling settings of a generator that samples π/T with the usual knobs: the words both
built-in generators take in a recipe, for a third generator to take the same ones."""

import attrs

from rlkit_core.config import at_least, between, greater_than, setting
from rlkit_core.settings import SamplingSettings


@attrs.frozen
class StandardSampling(SamplingSettings):
    """Temperature, top-k and top-p besides the settings rlkit reads (the response length, the
    prompts per generate call). A generator's config inherits it and adds its own settings."""

    min_new_tokens: int = setting(0, help="EOS is forbidden before this many tokens (the sampler then differs from π; keep 0 for exact PPO)",
                                  validator=at_least(0))
    temperature: float = setting(1.0, help="sampling temperature, also applied when log-probs are recomputed", validator=greater_than(0))
    top_k: int = setting(0, help="sample from the k likeliest tokens only (0: off). Biases PPO: the sampler is no longer π", validator=at_least(0))
    top_p: float = setting(1.0, help="nucleus sampling mass (1.0: off). Biases PPO like top_k", validator=between(0.0, 1.0))
