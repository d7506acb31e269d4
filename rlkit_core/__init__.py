"""rlkit: PPO fine-tuning of language models against a reward, every part a plugin.

What a plugin author needs is importable from here: the interface of each kind (and `ComponentBase`, the
hooks every component class may declare), the settings bases whose settings rlkit reads, `setting`
and its validators for config classes, nested component tables, `hookimpl`, the errors a plugin
raises and `building_at` for their places, and `surrogate` to register a policy-gradient surrogate.
"""

from importlib.metadata import PackageNotFoundError, version

from rlkit_core.config import at_least, between, greater_than, nested_component, nested_components, one_of, setting
from rlkit_core.context import BuildContext, ComponentChoice, building_at
from rlkit_core.errors import Problem, RecipeError, RunError
from rlkit_core.hookspecs import hookimpl
from rlkit_core.interfaces import (
    AdvantageEstimator,
    ComponentBase,
    Generation,
    Generator,
    KLController,
    Loss,
    LossInputs,
    LossTerms,
    Policy,
    PolicyOutput,
    PromptSource,
    RewardSource,
    Tracker,
    ValueHead,
)
from rlkit_core.launch import Launch
from rlkit_core.settings import ModelSettings, PolicySettings, PromptLengthLimit, SamplingSettings
from rlkit_core.surrogates import SurrogateTerms, surrogate

try:
    __version__ = version("rlkit")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0+unknown"

__all__ = [
    "AdvantageEstimator", "BuildContext", "ComponentBase", "ComponentChoice", "Generation", "Generator", "KLController", "Launch",
    "Loss", "LossInputs", "LossTerms", "ModelSettings", "PolicyOutput", "Policy", "PolicySettings", "Problem", "PromptLengthLimit",
    "PromptSource", "RecipeError", "RewardSource", "RunError", "SamplingSettings", "SurrogateTerms", "Tracker", "ValueHead",
    "__version__", "at_least", "between", "building_at", "greater_than", "hookimpl", "nested_component", "nested_components",
    "one_of", "setting", "surrogate",
]


def __getattr__(name: str):
    if name == "Part":  # the earlier name of ComponentBase, kept for plugins that import it
        from rlkit_core import interfaces

        return interfaces.__getattr__(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
