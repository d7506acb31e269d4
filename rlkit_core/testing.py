"""Contract tests for plugin authors: one pytest base class per component kind.

A plugin's test suite subclasses the base of its kind and names the component; pytest then runs
every check of the interface contract against it, built exactly as a recipe would build it (the
table structured into the config class, then the factory called through the registry):

    from rlkit_core.testing import KLControllerContract

    class TestPID(KLControllerContract):
        component = "pid"              # the registered name
        config = {"target": 4.0}       # the recipe table, without `type`

When the table needs a path or another fixture, override the `component_config` fixture instead
of `config`. Classes that need a policy (policy, value head, generator) build a two-layer GPT-2
with the byte-level ByT5 tokenizer offline. `context.recipe` is None here: a component should
read its own config, not other tables of the recipe. Needs pytest (a test dependency only).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, ClassVar

import attrs
import pytest
import torch

from rlkit_core.batch import RolloutBatch
from rlkit_core.config import fields_help
from rlkit_core.context import BuildContext
from rlkit_core.errors import RecipeError
from rlkit_core.functional import logprobs_from_logits
from rlkit_core.interfaces import KINDS, Generation, LossInputs, PolicyOutput
from rlkit_core.plugins import load_registry
from rlkit_core.recipe import structure_table

__all__ = [
    "AdvantageEstimatorContract", "ComponentContract", "GeneratorContract", "KLControllerContract", "LossContract",
    "PolicyContract", "PromptSourceContract", "RewardContract", "TrackerContract", "ValueHeadContract",
    "rollout_batch", "write_tiny_causal_lm",
]


class ComponentContract:
    """What every component owes: registered under its name, a frozen attrs config class that
    documents every field, and a factory that builds the kind's interface from a recipe table."""

    kind: ClassVar[str]  # set by the kind's base class
    component: ClassVar[str]  # set by your subclass: the name recipes use in `type = "..."`
    config: ClassVar[dict[str, Any]] = {}  # the recipe table without `type`

    @pytest.fixture
    def component_config(self) -> dict[str, Any]:
        return dict(self.config)

    @pytest.fixture
    def context(self, tmp_path) -> BuildContext:
        return BuildContext(recipe=None, device=torch.device("cpu"), output_dir=str(tmp_path), seed=0)

    @pytest.fixture
    def registered(self):
        try:
            return load_registry().get(self.kind, self.component, f"{type(self).__name__}.component")
        except RecipeError as exc:
            problem = exc.problems[0]
        pytest.fail(f"{problem}\nthe contract tests use installed plugins: `pip install -e .` the package, "
                    "check its `rlkit` entry point, and leave RLKIT_PLUGINS unset", pytrace=False)

    @pytest.fixture
    def structured_config(self, registered, component_config):
        """The config instance a recipe with this table would hold."""
        config, problems = structure_table(component_config, registered.config_class, f"{type(self).__name__}.config")
        assert not problems, "the test's config does not fit the config class:\n" + "\n".join(problems)
        return config

    @pytest.fixture
    def make(self, registered, structured_config, context):
        """Builds a fresh component each call, as `rlkit run` would."""
        return lambda: registered.factory(structured_config, context)

    @pytest.fixture
    def instance(self, make):
        return make()

    def test_config_class_documents_every_field(self, registered):
        rows = fields_help(registered.config_class)
        undocumented = [name for name, _, _, _, help_text in rows if not help_text.strip()]
        assert not undocumented, (f"{registered.config_class.__name__}: fields without help: {', '.join(undocumented)}; "
                                  "declare them with rlkit_core.config.setting(..., help='one line')")
        multiline = [name for name, _, _, _, help_text in rows if "\n" in help_text]
        assert not multiline, f"{registered.config_class.__name__}: help must be one line (`rlkit plugins` prints it so): {', '.join(multiline)}"

    def test_config_class_is_frozen(self, structured_config):
        with pytest.raises(attrs.exceptions.FrozenInstanceError):
            structured_config.rlkit_contract_probe = 1  # recipes are immutable; decorate the class with @attrs.frozen

    def test_builds_the_interface(self, instance):
        interface = KINDS[self.kind]
        assert isinstance(instance, interface), f"{self.component!r} built a {type(instance).__name__}, not a {interface.__name__}"


# --- scalar kinds ------------------------------------------------------------------------------


class KLControllerContract(ComponentContract):
    """β is a finite, non-negative float whatever KL arrives, and `state_dict` carries everything
    that later updates depend on (a resumed run must continue exactly)."""

    kind = "kl_controller"
    # Negative: the k1 estimator's batch mean can dip below 0. Huge: a policy that ran away.
    observed_kls: ClassVar[list[float]] = [0.0, 1e-4, 3.0, 6.0, 60.0, 1e4, -2.0]

    def test_beta_is_a_finite_non_negative_float(self, instance):
        assert isinstance(instance.beta, float) and math.isfinite(instance.beta) and instance.beta >= 0

    def test_beta_stays_finite_and_non_negative_under_updates(self, instance):
        for round_ in range(30):
            for kl in self.observed_kls:
                instance.update(kl, 512 if round_ % 2 else 1)  # positional, as the loop calls it
                assert math.isfinite(instance.beta) and instance.beta >= 0, f"β = {instance.beta} after update(kl={kl})"

    def test_state_round_trips_and_resumes_identically(self, make):
        trained = make()
        for kl in [8.0, 2.0, 7.0, 30.0]:
            trained.update(kl, 64)
        state = json.loads(json.dumps(trained.state_dict()))  # checkpoints store plain numbers
        resumed = make()
        resumed.load_state_dict(state)
        assert resumed.beta == trained.beta
        for kl in [9.0, 1.0, 6.0]:
            trained.update(kl, 64)
            resumed.update(kl, 64)
            assert resumed.beta == trained.beta, "state_dict misses something that update() depends on"


class RewardContract(ComponentContract):
    """One finite float per response, including the empty response of an immediate EOS, and any
    extra data column is accepted (the loop passes every column of the prompt data)."""

    kind = "reward"
    prompts: ClassVar[list[str]] = ["The cat", "Summarise: the meeting moved to Friday.", "x"]
    responses: ClassVar[list[str]] = [" sat on the mat.", " Meeting on Friday.", ""]
    columns: ClassVar[dict[str, list[Any]]] = {}  # columns your reward reads, one value per response

    def test_one_finite_float_per_response(self, instance):
        scores = instance.score(list(self.prompts), list(self.responses), **self.columns)
        assert len(scores) == len(self.responses)
        assert all(isinstance(s, float) and math.isfinite(s) for s in scores), scores

    def test_accepts_extra_columns(self, instance):
        extra = {"rlkit_contract_extra": [{"unused": True}] * len(self.responses)}
        scores = instance.score(list(self.prompts), list(self.responses), **self.columns, **extra)
        assert len(scores) == len(self.responses)


class PromptSourceContract(ComponentContract):
    """Records with a string `prompt` and the same other columns in each (the loop takes the
    column names from the first record)."""

    kind = "prompt_source"

    def test_records_have_a_prompt_and_the_same_columns(self, instance):
        records = instance.load()
        assert records and all(isinstance(r, dict) for r in records)
        assert all(isinstance(r.get("prompt"), str) for r in records), "every record needs a string 'prompt'"
        keys = set(records[0])
        assert all(set(r) == keys for r in records), "records differ in their columns"


class TrackerContract(ComponentContract):
    """A run opens, takes metrics, samples and artifacts, closes, and reopens by the id it returned."""

    kind = "tracker"

    def test_run_lifecycle_and_resume(self, make, tmp_path):
        tracker = make()
        run_id = tracker.start(run_name="contract", params={"kl.target": 6.0, "policy.model": "x" * 10_000},
                               tags={"rlkit.version": "test"}, resume_id=None)
        assert run_id is None or isinstance(run_id, str)
        tracker.log_metrics({"score/mean": 0.5, "kl/beta": 0.05}, step=1)
        tracker.log_samples([{"prompt": "p", "response": "r", "score": 1.0}], step=1)
        artifact = tmp_path / "artifact.txt"
        artifact.write_text("kept with the run")
        tracker.log_artifact(str(artifact))
        tracker.finish("KILLED")
        if run_id is not None:
            resumed = make()
            assert resumed.start(run_name="contract", params={}, tags={}, resume_id=run_id) == run_id
            resumed.log_metrics({"score/mean": 0.6}, step=2)
            resumed.finish("FINISHED")


# --- batch kinds -------------------------------------------------------------------------------

RESPONSE_MASK = [[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]


def rollout_batch(with_values: bool = True, seed: int = 0) -> RolloutBatch:
    """A scored batch as the loop hands it to the advantage estimator: 6 rollouts in 3 groups of 2,
    5 response positions, responses of 1 to 5 tokens. Padding holds NaN, as garbage may: a
    component must select counted positions (see `rlkit_core.functional`), not multiply by the mask."""
    generator = torch.Generator().manual_seed(seed)
    mask = torch.tensor(RESPONSE_MASK)
    batch_size, width = mask.shape

    def per_token(scale=1.0, shift=0.0):
        values = torch.randn(batch_size, width, generator=generator) * scale + shift
        return torch.where(mask.bool(), values, torch.full_like(values, float("nan")))

    return RolloutBatch(
        prompts=[f"prompt {i // 2}" for i in range(batch_size)],
        columns={"reference": [f"ref {i // 2}" for i in range(batch_size)]},
        group_ids=torch.arange(batch_size) // 2,
        prompt_ids=torch.randint(3, 100, (batch_size, 3), generator=generator),
        prompt_mask=torch.ones(batch_size, 3, dtype=torch.long),
        response_ids=torch.randint(3, 100, (batch_size, width), generator=generator),
        response_mask=mask,
        sampled_logprobs=per_token(0.5, -2.0),
        responses=[f"response {i}" for i in range(batch_size)],
        ended=torch.tensor([False, True, True, True, True, False]),
        scores=torch.randn(batch_size, generator=generator),
        old_logprobs=per_token(0.5, -2.0),
        ref_logprobs=per_token(0.5, -2.0),
        values=per_token() if with_values else None,
        kl=per_token(0.1),
        rewards=per_token(),
        advantages=per_token(),
        returns=per_token(),
    )


class AdvantageEstimatorContract(ComponentContract):
    """(advantages, returns) of shape [B, R], finite on counted tokens, zero on padding, and the
    batch it read left as it was."""

    kind = "advantage_estimator"

    def test_shapes_zero_padding_and_finite(self, instance):
        batch = rollout_batch(with_values=instance.needs_values)
        batch = batch.with_(advantages=None, returns=None)  # what the estimator is there to make
        advantages, returns = instance.estimate(batch)
        counted = batch.response_mask.bool()
        for name, tensor in (("advantages", advantages), ("returns", returns)):
            assert tensor.shape == counted.shape and tensor.is_floating_point(), f"{name}: {tuple(tensor.shape)}"
            assert torch.isfinite(tensor[counted]).all(), f"{name} is not finite on counted tokens"
            assert (tensor[~counted] == 0).all(), f"{name} must be 0 on padding"

    def test_leaves_the_batch_unchanged(self, instance):
        batch = rollout_batch(with_values=instance.needs_values)
        before = {name: value.clone() for name, value in attrs.asdict(batch, recurse=False).items() if isinstance(value, torch.Tensor)}
        instance.estimate(batch)
        for name, value in before.items():
            unchanged = torch.allclose(value, getattr(batch, name), rtol=0, atol=0, equal_nan=True)
            assert unchanged, f"estimate() wrote into batch.{name}; return new tensors instead"


class LossContract(ComponentContract):
    """Named scalar terms; `loss_*` terms are finite, backprop into the current log-probs (never
    into padding), scale with 1/token_count, and work without a critic."""

    kind = "loss"

    @staticmethod
    def current(batch: RolloutBatch, with_values: bool) -> LossInputs:
        """What the current parameters say: close to the rollout, with gradient, NaN on padding."""
        noise = torch.randn(batch.old_logprobs.shape, generator=torch.Generator().manual_seed(1)) * 0.1
        logprobs = (batch.old_logprobs + noise).requires_grad_()
        values = (batch.values + noise).requires_grad_() if with_values else None
        entropy = torch.rand(batch.old_logprobs.shape, generator=torch.Generator().manual_seed(2)).requires_grad_()
        return LossInputs(logprobs=logprobs, values=values, entropy=entropy)

    def terms(self, instance, with_values=True, token_count=None):
        batch = rollout_batch(with_values=with_values)
        current = self.current(batch, with_values)
        count = float(batch.response_mask.sum()) if token_count is None else token_count
        return instance(batch, current, count), current, batch

    @pytest.mark.parametrize("with_values", [True, False], ids=["critic", "critic-free"])
    def test_terms_are_finite_scalars_and_loss_terms_backprop(self, instance, with_values):
        terms, current, batch = self.terms(instance, with_values)
        losses = {k: v for k, v in terms.items() if k.startswith("loss_")}
        assert losses, f"no loss_* term among {sorted(terms)}"
        for name, value in terms.items():
            assert isinstance(value, torch.Tensor) and value.ndim == 0, f"{name} must be a scalar tensor"
            assert torch.isfinite(value), f"{name} = {value}"
        assert all(v.requires_grad for v in losses.values()), "every loss_* term must carry gradient"
        sum(losses.values()).backward()
        counted = batch.response_mask.bool()
        grad = current.logprobs.grad
        assert grad is not None and torch.isfinite(grad).all(), "the loss must reach the current log-probs"
        assert (grad[~counted] == 0).all(), "padding must get no gradient"
        assert grad[counted].abs().sum() > 0

    def test_loss_terms_average_over_token_count(self, instance):
        once, _, batch = self.terms(instance)
        count = float(batch.response_mask.sum())
        twice, _, _ = self.terms(instance, token_count=2 * count)
        for name in once:
            if name.startswith("loss_"):
                assert torch.allclose(twice[name], once[name] / 2, rtol=1e-5, atol=1e-7), (
                    f"{name} does not scale with 1/token_count; results would depend on how the batch is split")


# --- model kinds -------------------------------------------------------------------------------


def write_tiny_causal_lm(path: Path) -> Path:
    """A two-layer, 32-wide GPT-2 with the byte-level ByT5 tokenizer: real transformers classes,
    built offline in a moment, so contract tests need no hub."""
    from transformers import ByT5Tokenizer, GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=384, n_positions=128, n_embd=32, n_layer=2, n_head=2, bos_token_id=1, eos_token_id=1, pad_token_id=0)
    GPT2LMHeadModel(config).save_pretrained(path)
    ByT5Tokenizer().save_pretrained(path)
    return path


def policy_inputs(tokenizer, prompts=("ab", "abcdef")):
    """(input_ids, attention_mask, position_ids) of left-padded prompts, as the loop feeds them."""
    from rlkit_core.prompts import encode_prompts

    input_ids, attention_mask = encode_prompts(tokenizer, [{"prompt": p} for p in prompts], "cpu")
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    return input_ids, attention_mask, position_ids


class _OnTinyModel(ComponentContract):
    """Builds the policy that value heads and generators read from on the tiny model; override
    the `policy` fixture to test against another policy."""

    @pytest.fixture(scope="class")
    @classmethod
    def tiny_model(cls, tmp_path_factory) -> Path:
        return write_tiny_causal_lm(tmp_path_factory.mktemp("tiny-causal-lm"))

    @pytest.fixture
    def policy(self, tiny_model, tmp_path):
        registered = load_registry().get("policy", "hf", "the contract test's policy")
        config, problems = structure_table({"model": str(tiny_model)}, registered.config_class, "policy")
        assert not problems, problems
        return registered.factory(config, BuildContext(recipe=None, device=torch.device("cpu"), output_dir=str(tmp_path), seed=0))

    @pytest.fixture
    def context(self, tmp_path, policy) -> BuildContext:
        return BuildContext(recipe=None, device=torch.device("cpu"), output_dir=str(tmp_path), seed=0, policy=policy)


class PolicyContract(_OnTinyModel):
    """Logits with gradient, a frozen reference equal to the starting policy, trainable state
    that round-trips, and a plain transformers directory on save. The `tiny_model` fixture
    gives a model directory for `component_config`."""

    kind = "policy"

    @pytest.fixture
    def context(self, tmp_path) -> BuildContext:
        return BuildContext(recipe=None, device=torch.device("cpu"), output_dir=str(tmp_path), seed=0)

    def test_tokenizer_pads_with_a_token_that_ends_nothing(self, instance):
        tokenizer = instance.tokenizer
        assert tokenizer.eos_token_id is not None and tokenizer.pad_token_id is not None
        assert instance.eos_token_ids and instance.eos_token_ids[0] == tokenizer.eos_token_id, "eos_token_ids must start with the tokenizer's EOS"
        assert tokenizer.pad_token_id not in instance.eos_token_ids, "a PAD that is also an end id would hide where responses end"

    def test_forward_and_reference_agree_at_the_start(self, instance):
        inputs = policy_inputs(instance.tokenizer)
        out = instance.forward(*inputs)
        assert isinstance(out, PolicyOutput) and out.logits.shape[:2] == inputs[0].shape
        assert out.logits.requires_grad
        reference = instance.reference_logits(*inputs)
        assert reference.shape == out.logits.shape and not reference.requires_grad
        counted = inputs[1].bool()
        assert torch.allclose(reference[counted], out.logits[counted].detach(), atol=1e-5), "the reference must start as the policy"

    def test_gradient_reaches_the_trainable_parameters(self, instance):
        parameters = list(instance.parameters())
        assert parameters and all(p.requires_grad for p in parameters)
        instance.forward(*policy_inputs(instance.tokenizer)).logits.logsumexp(-1).sum().backward()
        assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in parameters)

    def test_state_dict_round_trips(self, instance):
        inputs = policy_inputs(instance.tokenizer)
        state = {k: v.clone() for k, v in instance.state_dict().items()}
        with torch.no_grad():
            before = instance.forward(*inputs).logits
            for p in instance.parameters():
                p.add_(0.1)
        instance.load_state_dict(state)
        with torch.no_grad():
            assert torch.allclose(instance.forward(*inputs).logits, before)

    def test_save_pretrained_writes_a_transformers_directory(self, instance, tmp_path):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        instance.save_pretrained(str(tmp_path / "saved"))
        AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
        AutoTokenizer.from_pretrained(tmp_path / "saved")


class ValueHeadContract(_OnTinyModel):
    """[B, L] values with gradient into the head's parameters, and state that round-trips."""

    kind = "value_head"

    def values(self, instance, policy):
        inputs = policy_inputs(policy.tokenizer)
        return instance.values(policy.forward(*inputs), *inputs), inputs

    def test_values_per_position_with_gradient(self, instance, policy):
        values, inputs = self.values(instance, policy)
        assert values.shape == inputs[0].shape and values.is_floating_point()
        assert torch.isfinite(values[inputs[1].bool()]).all()
        parameters = list(instance.parameters())
        assert parameters, "the critic has nothing to train"
        values.sum().backward()
        assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in parameters)

    def test_state_dict_round_trips(self, instance, policy):
        state = {k: v.clone() for k, v in instance.state_dict().items()}
        with torch.no_grad():
            before, _ = self.values(instance, policy)
            for p in instance.parameters():
                p.add_(0.1)
        instance.load_state_dict(state)
        with torch.no_grad():
            after, _ = self.values(instance, policy)
        assert torch.allclose(after, before)


class GeneratorContract(_OnTinyModel):
    """Responses padded after the first EOS, a mask that counts up to and including it, and
    sampled log-probs that match the policy at the sampler's temperature (PPO's ratio starts
    at 1 only if they do). Raise `logprob_tolerance` for samplers in lower precision."""

    kind = "generator"
    logprob_tolerance: ClassVar[float] = 1e-4

    @pytest.fixture
    def generation(self, instance, policy):
        torch.manual_seed(0)
        prompt_ids, prompt_mask, _ = policy_inputs(policy.tokenizer, ["ab", "abcdef", "x", "hello"])
        instance.sync_weights(policy)
        return instance.generate(prompt_ids, prompt_mask), prompt_ids, prompt_mask

    def test_temperature_is_positive(self, instance):
        assert isinstance(instance.temperature, float) and instance.temperature > 0

    def test_masks_stop_at_the_first_eos(self, generation, policy):
        out, prompt_ids, _ = generation
        assert isinstance(out, Generation)
        ids, mask = out.response_ids, out.response_mask
        assert ids.shape == mask.shape == out.logprobs.shape and ids.shape[0] == prompt_ids.shape[0]
        ends, pad = set(policy.eos_token_ids), policy.tokenizer.pad_token_id
        for row_ids, row_mask in zip(ids.tolist(), mask.tolist()):
            length = next((i + 1 for i, token in enumerate(row_ids) if token in ends), len(row_ids))
            assert row_mask == [1] * length + [0] * (len(row_ids) - length), "mask must count up to and including the first EOS"
            assert all(token == pad for token in row_ids[length:]), "tokens after the first EOS must be PAD"

    def test_sampled_logprobs_match_the_policy(self, instance, generation, policy):
        out, prompt_ids, prompt_mask = generation
        input_ids = torch.cat([prompt_ids, out.response_ids], dim=1)
        attention_mask = torch.cat([prompt_mask, out.response_mask], dim=1)
        position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
        with torch.no_grad():
            logits = policy.forward(input_ids, attention_mask, position_ids).logits[:, prompt_ids.shape[1] - 1:-1]
        recomputed = logprobs_from_logits(logits, out.response_ids, instance.temperature, policy.suppressed_token_ids)
        counted = out.response_mask.bool()
        gap = (recomputed - out.logprobs)[counted].abs().max()
        assert gap <= self.logprob_tolerance, f"sampled log-probs differ from π/T by up to {gap:.2e}"
