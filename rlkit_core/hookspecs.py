"""The hooks a plugin implements: one per component kind, in the order of
`rlkit_core.interfaces.KIND_TABLE`, then one per function kind (`FUNCTION_KINDS`) and one per
nested class kind (`NESTED_KINDS`), written out for readers and pluggy; a test holds them to the tables.

Each hook receives a `register(name, factory, config_class)` callable. The factory is called as
`factory(config, context)` with an instance of `config_class` (a frozen attrs class) and a
`rlkit_core.context.BuildContext`; it is a class deriving from the kind's interface, and the
registry refuses one that breaks the contract (`rlkit_core.recipe.registry.contract_problems`).
A function kind's `register(name, function, config_class)` takes a function over the kind's
signature instead, which the component holding its table calls with an instance of `config_class`.
A nested class kind's factory is a class of the kind's interface that the core builds as `factory(config)`.
"""

import pluggy

PROJECT = "rlkit"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def register_policies(register):
    """Register trainable causal language models (`rlkit_core.interfaces.Policy`)."""


@hookspec
def register_value_heads(register):
    """Register critics (`rlkit_core.interfaces.ValueHead`)."""


@hookspec
def register_generators(register):
    """Register response generators (`rlkit_core.interfaces.Generator`)."""


@hookspec
def register_rewards(register):
    """Register reward sources (`rlkit_core.interfaces.RewardSource`)."""


@hookspec
def register_kl_controllers(register):
    """Register KL coefficient controllers (`rlkit_core.interfaces.KLController`)."""


@hookspec
def register_advantage_estimators(register):
    """Register advantage estimators (`rlkit_core.interfaces.AdvantageEstimator`)."""


@hookspec
def register_losses(register):
    """Register optimisation objectives (`rlkit_core.interfaces.Loss`)."""


@hookspec
def register_environments(register):
    """Register multi-turn environments (`rlkit_core.interfaces.Environment`)."""


@hookspec
def register_prompt_sources(register):
    """Register prompt sources (`rlkit_core.interfaces.PromptSource`)."""


@hookspec
def register_trackers(register):
    """Register metric trackers (`rlkit_core.interfaces.Tracker`)."""


@hookspec
def register_batch_sources(register):
    """Register batch sources (`rlkit_core.interfaces.BatchSource`): where each iteration's batch comes from."""


@hookspec
def register_surrogates(register):
    """Register policy-gradient surrogates (`rlkit_core.interfaces.Surrogate`), functions chosen in `[loss.surrogate]`."""


@hookspec
def register_tool_call_formats(register):
    """Register tool-call formats (`rlkit_core.interfaces.ToolCallFormat`), chosen by `tool_call_format` in `[environment]`."""


@hookspec
def register_chat_formats(register):
    """Register chat formats (`rlkit_core.interfaces.ChatFormat`), chosen by `chat_format` in `[environment]`."""
