"""What a component factory is given besides its own config."""

from __future__ import annotations

from typing import Any

import attrs
import torch

from rlkit_core.errors import Problem, RecipeError
from rlkit_core.interfaces import KINDS, Policy
from rlkit_core.launch import ONE_PROCESS, Launch
from rlkit_core.records import ComponentChoice, ComponentLookup, Recipe


@attrs.define
class BuildContext:
    """Everything a factory `factory(config, context)` may rely on, in `rlkit run` and in the
    contract tests (`rlkit_core.testing.contracts`) alike:

    - `recipe`: the whole checked recipe the run trains. Read other tables for facts about the run
      (`recipe.run.steps` is its length in iterations, `recipe.ppo.batch_size` the rollouts per
      iteration); a component's own settings belong in its own config class.
    - `registry`: every installed component (`recipe.registry`, a `ComponentLookup`: `find`, `names`); `build(choice)` builds a nested
      component table, the `ComponentChoice` a `nested_component` setting holds.
    - `device`: where tensors go; `output_dir`: the run's folder (it may not exist yet); `seed`: `run.seed`,
      or for the components of a worker that makes batches ahead, a seed of that worker's own (an engine
      seeded from it samples apart from the trainer's and the other workers').
    - `launch`: how the run is started (`rlkit_core.Launch`): `launch.processes` is the
      number of processes, each of which builds its own copy of every component.
    - `policy` and `tokenizer`: None while the policy itself is built, then set for every other kind
      (components are built in the order policy, advantage, value head, generator, reward, KL,
      loss, data, tracker).
    - `where`: the place of the table being built (`$.reward`, or `$.reward.parts[1]` for a nested
      one), set by `build(choice)` while that factory runs (empty when a factory is called directly).
      Locate the errors your factory raises under `building_at(context, "reward")`, which is
      `where` or else the kind's top-level table, so a nested part names its own place.
    """

    recipe: Recipe
    device: torch.device
    output_dir: str
    seed: int
    policy: Policy | None = None  # set once the policy is built; the value head and generator need it
    where: str = ""  # the table `build` is building, restored when it returns (a nested build sets its own)
    launch: Launch = ONE_PROCESS  # how the run is started; the trainer gives its own

    @property
    def registry(self) -> ComponentLookup | None:
        return self.recipe.registry

    @property
    def tokenizer(self) -> Any:
        return None if self.policy is None else self.policy.tokenizer

    def build(self, choice: ComponentChoice) -> Any:
        """The component a checked table describes, built by its factory and checked to implement its kind."""
        outer, self.where = self.where, f"$.{choice.table}"
        try:
            instance = choice.component.factory(choice.config, self)
        finally:
            self.where = outer
        interface = KINDS[choice.component.kind]
        if not isinstance(instance, interface):
            raise RecipeError([Problem(f"$.{choice.table}.type", f"{choice.component.name!r} from plugin {choice.component.plugin!r} "
                                       f"built a {type(instance).__name__}, which is not a {interface.__name__}; the plugin is broken")])
        return instance


def building_at(context: BuildContext | None, table: str) -> str:
    """Where the component being built sits: `context.where`, or its top-level `$.<table>` when a
    factory is called other than through `BuildContext.build` (a script, a unit test)."""
    where = context.where if isinstance(context, BuildContext) else ""
    return where or f"$.{table}"
