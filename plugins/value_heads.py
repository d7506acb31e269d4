"""Value heads: `shared` (a scalar head on the policy's trunk) and `separate` (a model of its own)."""

from __future__ import annotations

import attrs
import torch

from rlkit_core import hookimpl
from rlkit_core.config import one_of, setting
from rlkit_core.errors import RecipeError
from rlkit_core.interfaces import ValueHead
from rlkit_core.randomness import switch_off_dropout


@attrs.frozen
class SharedValueConfig:
    pass


@attrs.frozen
class SeparateValueConfig:
    model: str = setting(help="model directory or hub name for the critic (often the reward model)")
    head_init: str = setting("zero", help="'zero': start every value at 0; 'checkpoint': keep the model's own score head", validator=one_of("zero", "checkpoint"))


class SharedValueHead(ValueHead):
    """A zero-initialised linear map from the policy's last hidden state, so values start at 0
    and the critic adds one vector of parameters, not a second model."""

    def __init__(self, config: SharedValueConfig, context):
        hidden = context.policy.model.config.get_text_config().hidden_size
        self.head = torch.nn.Linear(hidden, 1).to(context.device)
        torch.nn.init.zeros_(self.head.weight)
        torch.nn.init.zeros_(self.head.bias)

    def values(self, policy_output, input_ids, attention_mask, position_ids):
        return self.head(policy_output.hidden.float()).squeeze(-1)

    def parameters(self):
        return list(self.head.parameters())

    def state_dict(self):
        return self.head.state_dict()

    def load_state_dict(self, state) -> None:
        self.head.load_state_dict(state)


class SeparateValueHead(ValueHead):
    """A sequence-classification model read at every position instead of only the last."""

    def __init__(self, config: SeparateValueConfig, context):
        from transformers import AutoModelForSequenceClassification

        try:
            self.model = AutoModelForSequenceClassification.from_pretrained(config.model, num_labels=1)
        except OSError as exc:
            raise RecipeError([f"$.value_head.model: cannot load {config.model!r}: {exc}"]) from None
        self.score = getattr(self.model, "score", None)
        if not isinstance(self.score, torch.nn.Linear):
            raise RecipeError([f"$.value_head.model: {config.model!r} has no linear `score` head to read per token; "
                               "use a decoder-style model (GPT-2, Llama, ...) or value_head.type = 'shared'"])
        if config.head_init == "zero":
            torch.nn.init.zeros_(self.score.weight)
            if self.score.bias is not None:
                torch.nn.init.zeros_(self.score.bias)
        switch_off_dropout(self.model)
        self.model.to(context.device)

    def values(self, policy_output, input_ids, attention_mask, position_ids):
        trunk = getattr(self.model, self.model.base_model_prefix)
        hidden = trunk(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).last_hidden_state
        return self.score(hidden).float().squeeze(-1)

    def parameters(self):
        return list(self.model.parameters())

    def state_dict(self):
        return self.model.state_dict()

    def load_state_dict(self, state) -> None:
        self.model.load_state_dict(state)


@hookimpl
def register_value_heads(register):
    register("shared", SharedValueHead, SharedValueConfig)
    register("separate", SeparateValueHead, SeparateValueConfig)
