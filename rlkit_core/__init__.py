"""rlkit: PPO fine-tuning of language models against a reward, every part a plugin.

What a plugin author needs is importable from here: the interface of each kind (and `ComponentBase`, the
hooks every component class may declare), the settings bases whose settings rlkit reads, `setting`
and its validators for config classes, nested component tables, `hookimpl`, the errors a plugin
raises and `building_at` for their places, what a policy-gradient surrogate takes and returns
(`Surrogate`, `RatioClip`, `SurrogateTerms`; registered by a `register_surrogates` hook), what a
tool-call format implements (`ToolCallFormat`, with `typed_arguments` and `parse_tool_calls`;
registered by a `register_tool_call_formats` hook),
and the records a factory reads through its `BuildContext` (the `Recipe` and its tables). An
environment speaks the messages of `Reply`, `Reset` and `Step`; `ToolEnvironment` and `tool` make
typed methods its tools; an environment whose episodes an outside agent plays subclasses
`HarnessEnvironment` (built on `agent_endpoint()`: a `Session` per episode, opened with the run's
`Limits`; its `Turn`s and `HarnessEnded`; `HarnessSettings` bound a command's start). A process a component starts calls `end_with_parent`
first, so that it ends with the run.

Besides this module a plugin may import three helper modules, as the built-in plugins do (and
nothing else of `rlkit_core`; `tests/test_layout.py` holds the built-ins to it):
`rlkit_core.functional` (the tensor math of advantages, rewards and losses), `rlkit_core.hf`
(rules for transformers models and tokenizers) and `rlkit_core.testing` (the contract kit).
"""

from importlib.metadata import PackageNotFoundError, version

from rlkit_core.chat_format import ChatFormat, chat_format_for
from rlkit_core.child_processes import end_with_parent
from rlkit_core.config import at_least, between, greater_than, nested_component, nested_components, one_of, setting
from rlkit_core.context import BuildContext, building_at
from rlkit_core.endpoint import HarnessEnded, Limits, Session, Turn, agent_endpoint
from rlkit_core.episode_limits import StandardEpisode
from rlkit_core.errors import Problem, RecipeError, RunError
from rlkit_core.harness import HarnessEnvironment, HarnessSettings
from rlkit_core.hookspecs import hookimpl
from rlkit_core.imports import load_module
from rlkit_core.interfaces import (
    AdvantageEstimator,
    BatchSource,
    Completion,
    ComponentBase,
    Environment,
    Generation,
    Generator,
    KLController,
    Loss,
    LossInputs,
    LossTerms,
    NullTracker,
    Policy,
    PolicyOutput,
    PromptSource,
    Requests,
    RewardSource,
    Tracker,
    ValueHead,
)
from rlkit_core.launch import Launch
from rlkit_core.memory import ModelShape
from rlkit_core.messages import Reply, Reset, Step, ToolCall
from rlkit_core.progress import Progress
from rlkit_core.randomness import sampling_seed, switch_off_dropout
from rlkit_core.records import (
    Component,
    ComponentChoice,
    ComponentLookup,
    EvalConfig,
    HealthConfig,
    OptimConfig,
    PPOConfig,
    Recipe,
    RunConfig,
)
from rlkit_core.sampling import StandardSampling
from rlkit_core.settings import ModelSettings, PolicySettings, PromptLengthLimit, SamplingSettings
from rlkit_core.surrogates import RatioClip, Surrogate, SurrogateTerms
from rlkit_core.tool_call_formats import JSONInTags, ToolCallFormat, parse_tool_calls, read_call_blocks, typed_arguments, without_call_blocks
from rlkit_core.tools import ToolEnvironment, tool, tool_schema

try:
    __version__ = version("rlkit")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0+unknown"

__all__ = [
    "AdvantageEstimator", "BatchSource", "BuildContext", "ChatFormat", "Component", "ComponentBase", "ComponentChoice", "ComponentLookup", "Completion",
    "Environment", "EvalConfig", "Generation", "Generator", "HarnessEnded", "HarnessEnvironment", "HarnessSettings", "HealthConfig",
    "JSONInTags", "KLController", "Launch",
    "Limits", "Loss", "LossInputs", "LossTerms", "ModelSettings", "ModelShape", "NullTracker", "OptimConfig", "PPOConfig", "Policy",
    "PolicyOutput", "PolicySettings", "Problem", "Progress", "PromptLengthLimit", "PromptSource", "RatioClip", "Recipe", "RecipeError", "Requests",
    "Reply", "Reset", "RewardSource", "RunConfig", "RunError", "SamplingSettings", "Session", "StandardEpisode", "StandardSampling",
    "Step", "Surrogate", "SurrogateTerms", "ToolCall", "ToolCallFormat", "ToolEnvironment", "Tracker", "Turn", "ValueHead",
    "agent_endpoint", "at_least", "between", "building_at", "chat_format_for", "end_with_parent", "greater_than", "hookimpl", "load_module", "nested_component",
    "nested_components", "one_of", "parse_tool_calls", "read_call_blocks", "sampling_seed", "setting", "switch_off_dropout", "tool",
    "tool_schema", "typed_arguments", "without_call_blocks", "__version__",
]


def __getattr__(name: str):
    if name == "Part":  # the earlier name of ComponentBase, kept for plugins that import it
        from rlkit_core import interfaces

        return interfaces.__getattr__(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
