"""Value heads: `shared` (a scalar head on the policy's trunk), `separate` (a model of its own) and
`none` (no critic, for the critic-free advantage estimators)."""

from __future__ import annotations

import attrs
import torch

from rlkit_core import ModelSettings, RecipeError, ValueHead, building_at, hookimpl, one_of, setting, switch_off_dropout
from rlkit_core.hf import LOAD_ERRORS, PAD_TOKEN, check_model, load_problem, vocabulary_mismatch


@attrs.frozen
class SharedValueConfig:
    pass


@attrs.frozen
class SeparateValueConfig:
    model: str = setting(help="model directory or hub name for the critic (often the reward model)")
    head_init: str = setting("zero", help="'zero': start every value at 0; 'checkpoint': keep the model's own score head",
                             validator=one_of("zero", "checkpoint"))


class SharedValueHead(ValueHead):
    """A zero-initialised linear map from the policy's last hidden state, so values start at 0
    and the critic adds one vector of parameters, not a second model."""

    packs_sequences = True  # reads the policy's hidden states, wherever they lie

    def __init__(self, config: SharedValueConfig, context):
        hidden = context.policy.model.config.get_text_config().hidden_size
        self.head = torch.nn.Linear(hidden, 1).to(context.device)
        torch.nn.init.zeros_(self.head.weight)
        torch.nn.init.zeros_(self.head.bias)

    def values(self, policy_output, input_ids, attention_mask, position_ids):
        assert policy_output.hidden is not None  # a policy gives its hidden states for a head on its trunk
        return self.head(policy_output.hidden.float()).squeeze(-1)

    def parameters(self):
        return list(self.head.parameters())

    def module(self):
        return self.head

    def state_dict(self):
        return self.head.state_dict()

    def load_state_dict(self, state) -> None:
        self.head.load_state_dict(state)


def critic_vocabulary_problem(model: str, policy_tokenizer, critic_tokenizer, critic_rows: int, where: str) -> str | None:
    """The located reason a separate critic cannot read the policy's token ids, or None. rlkit's
    PAD does not count (the critic never sees it); a critic without tokenizer files is checked by
    size alone."""
    reason = None
    if critic_tokenizer is not None:
        mismatch = vocabulary_mismatch(policy_tokenizer, critic_tokenizer, ignore=(PAD_TOKEN,))
        reason = mismatch and f"its vocabulary is not the policy's ({mismatch})"
    needed = len(policy_tokenizer) - (PAD_TOKEN in policy_tokenizer.get_vocab())
    if not reason and critic_rows < needed:
        reason = f"its embedding table has {critic_rows} rows but the policy's tokenizer has {needed} tokens"
    if not reason:
        return None
    return (f"{where}.model: {model!r}: {reason}; start the critic from a model with the policy's tokenizer, "
            "or use value_head.type = 'shared'")


class SeparateValueHead(ValueHead):
    """A sequence-classification model read at every position instead of only the last. It reads
    the policy's token ids, so it must share the policy's vocabulary (checked when built and by
    `rlkit check`); a PAD that rlkit added to the policy never reaches it (padding is masked, and
    its ids are replaced before the critic's embedding)."""

    packs_sequences = True  # a transformers trunk, as the `hf` policy's

    def __init__(self, config: SeparateValueConfig, context):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        where = building_at(context, "value_head")
        try:
            self.model = AutoModelForSequenceClassification.from_pretrained(config.model, num_labels=1)
        except LOAD_ERRORS as exc:
            raise RecipeError([load_problem(config.model, f"{where}.model", "a sequence classifier", exc)]) from None
        try:
            critic_tokenizer = AutoTokenizer.from_pretrained(config.model)
        except (OSError, ValueError):
            critic_tokenizer = None
        rows = self.model.get_input_embeddings().num_embeddings
        problem = critic_vocabulary_problem(config.model, context.policy.tokenizer, critic_tokenizer, rows, where)
        if problem:
            raise RecipeError([problem])
        score = getattr(self.model, "score", None)
        if not isinstance(score, torch.nn.Linear):
            raise RecipeError([f"{where}.model: {config.model!r} has no linear `score` head to read per token; "
                               "use a decoder-style model (GPT-2, Llama, ...) or value_head.type = 'shared'"])
        self.score = score
        if config.head_init == "zero":
            torch.nn.init.zeros_(self.score.weight)
            if self.score.bias is not None:
                torch.nn.init.zeros_(self.score.bias)
        switch_off_dropout(self.model)
        self.model.to(context.device)

    @staticmethod
    def check(config: SeparateValueConfig, recipe, where: str) -> tuple[list[str], list[str]]:
        """(problems, notes) of `rlkit check`: the critic's tokenizer against the policy's."""
        problems, notes = [], []
        policy = recipe["policy"].config
        if not isinstance(policy, ModelSettings) or not (policy.tokenizer or policy.model):  # a policy that builds its own
            return problems, notes
        policy_tokenizer = check_model(policy.model, policy.tokenizer, "$.policy", problems, notes)
        critic_tokenizer = check_model(config.model, "", where, problems, notes)
        if policy_tokenizer is not None and critic_tokenizer is not None:
            problem = critic_vocabulary_problem(config.model, policy_tokenizer, critic_tokenizer, len(critic_tokenizer), where)
            if problem:
                problems.append(problem)
        return problems, notes

    def values(self, policy_output, input_ids, attention_mask, position_ids):
        trunk = getattr(self.model, self.model.base_model_prefix)
        if attention_mask is not None:  # packed rows hold no PAD (their filler is a real token)
            input_ids = input_ids.masked_fill(attention_mask == 0, 0)  # padding is masked; an added PAD id may lie past this table
        # no cache: transformers reads packed rows from the position ids only when there is none
        hidden = trunk(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False).last_hidden_state
        return self.score(hidden).float().squeeze(-1)

    def parameters(self):
        return list(self.model.parameters())

    def module(self):
        return self.model

    def state_dict(self):
        return self.model.state_dict()

    def load_state_dict(self, state) -> None:
        self.model.load_state_dict(state)


@hookimpl
def register_value_heads(register):
    register("shared", SharedValueHead, SharedValueConfig)
    register("separate", SeparateValueHead, SeparateValueConfig)
