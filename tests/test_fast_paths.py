"""The shortcuts the `hf` policy takes for speed give the numbers of the plain way: logits only at
the positions the loop reads, the trunk's last hidden state without every layer's, and torch's
one-kernel tanh GELU in place of GPT-2's elementwise `gelu_new`."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from plugins.hf_policy import HFPolicy, HFPolicyConfig
from rlkit_core.functional import logprobs_from_logits
from rlkit_core.recipe.document import parse_recipe
from rlkit_core.runtime.forward import response_view, rows_of
from rlkit_core.runtime.trainer import Trainer
from rlkit_core.testing import policy_inputs
from tests.test_trainer import advantages_with, rollout_with


@pytest.fixture
def policy(tiny_model):
    torch.manual_seed(0)
    return HFPolicy(HFPolicyConfig(model=str(tiny_model)))


@pytest.fixture
def inputs(policy):
    return policy_inputs(policy.tokenizer, ["ab", "abcdef", "x"])


def test_the_policy_computes_what_the_plain_checkpoint_computes(policy, inputs, tiny_model):
    plain = AutoModelForCausalLM.from_pretrained(tiny_model).eval()  # gelu_new, every layer's hidden state
    assert plain.config.activation_function == "gelu_new"
    assert not any(type(m).__name__ == "NewGELUActivation" for m in policy.model.modules())  # fused
    with torch.no_grad():
        expected = plain(input_ids=inputs[0], attention_mask=inputs[1], position_ids=inputs[2], output_hidden_states=True)
        out = policy.forward(*inputs)
    assert torch.allclose(out.logits, expected.logits, atol=1e-5)
    assert torch.allclose(out.hidden, expected.hidden_states[-1], atol=1e-5)


def test_models_without_logits_to_keep_or_a_trunk_give_the_same(policy, inputs):
    with torch.no_grad():
        fast = policy.forward(*inputs, start=4)
        policy._keeps_logits, policy._trunk = False, None  # slice after the head; every layer's hidden states
        plain = policy.forward(*inputs, start=4)
    assert torch.allclose(fast.logits, plain.logits, atol=1e-6)
    assert torch.allclose(fast.hidden, plain.hidden, atol=1e-6)


def test_response_logprobs_equal_the_ones_from_every_position(recipe_document, builtin_registry):
    trainer = Trainer(parse_recipe(recipe_document, builtin_registry))
    batch = advantages_with(trainer, rollout_with(trainer, trainer.stream.batch(0))[0])
    sequence = batch.sequence()
    with torch.no_grad():
        logprobs, values, _, _ = response_view(trainer.components, batch, rows_of(batch, trainer.recipe.ppo.pack_sequences), grad=False)
        every = trainer.components.policy.forward(*sequence)
    response_logits = every.logits[:, batch.prompt_length - 1:-1]
    expected = logprobs_from_logits(response_logits, batch.response_ids, trainer.components.generator.temperature,
                                    trainer.components.policy.suppressed_token_ids)
    counted = batch.response_mask.bool()
    assert torch.allclose(logprobs[counted], expected[counted], atol=1e-6)
    assert torch.allclose(batch.old_logprobs[counted], expected[counted], atol=1e-6)
    assert values.shape == batch.response_ids.shape
