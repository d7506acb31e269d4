"""What a component factory is given besides its own config."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import attrs
import torch

if TYPE_CHECKING:
    from rlkit_core.interfaces import Policy
    from rlkit_core.recipe import Recipe


@attrs.define
class BuildContext:
    recipe: Recipe
    device: torch.device
    output_dir: str
    seed: int
    policy: Policy | None = None  # set once the policy is built; the value head and generator need it

    @property
    def tokenizer(self) -> Any:
        return None if self.policy is None else self.policy.tokenizer
