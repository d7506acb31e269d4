"""What a component factory is given besides its own config."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import attrs
import torch

from rlkit_core.errors import Problem, RecipeError
from rlkit_core.interfaces import KINDS

if TYPE_CHECKING:
    from rlkit_core.interfaces import Policy
    from rlkit_core.recipe import ComponentChoice, Recipe
    from rlkit_core.registry import Registry


@attrs.define
class BuildContext:
    """Everything a factory `factory(config, context)` may rely on, in `rlkit run` and in the
    contract tests (`rlkit_core.contracts`) alike:

    - `recipe`: the whole checked recipe the run trains. Read other tables for facts about the run
      (`recipe.run.steps` is its length in iterations, `recipe.ppo.batch_size` the rollouts per
      iteration); a component's own settings belong in its own config class.
    - `registry`: every installed component (`recipe.registry`); `build(choice)` builds a nested
      component table, the `ComponentChoice` a `nested_component` setting holds.
    - `device`: where tensors go; `output_dir`: the run's folder (it may not exist yet); `seed`: `run.seed`.
    - `policy` and `tokenizer`: None while the policy itself is built, then set for every other kind
      (components are built in the order policy, advantage, value head, generator, reward, KL,
      loss, data, tracker).
    """

    recipe: Recipe
    device: torch.device
    output_dir: str
    seed: int
    policy: Policy | None = None  # set once the policy is built; the value head and generator need it

    @property
    def registry(self) -> Registry:
        return self.recipe.registry

    @property
    def tokenizer(self) -> Any:
        return None if self.policy is None else self.policy.tokenizer

    def build(self, choice: ComponentChoice) -> Any:
        """The component a checked table describes, built by its factory and checked to implement its kind."""
        instance = choice.component.factory(choice.config, self)
        interface = KINDS[choice.component.kind]
        if not isinstance(instance, interface):
            raise RecipeError([Problem(f"$.{choice.table}.type", f"{choice.component.name!r} from plugin {choice.component.plugin!r} "
                                       f"built a {type(instance).__name__}, which is not a {interface.__name__}; the plugin is broken")])
        return instance
