"""Contract tests for plugin authors: one pytest base class per component kind.

A plugin's test suite subclasses the base of its kind and names the component; pytest then runs
every check of the interface contract against it, built exactly as `rlkit run` builds it: the
component's table sits in a whole recipe that is checked with the installed plugins, and the
factory gets a `BuildContext` holding that recipe, the registry and the recipe's policy:

    from rlkit_core.testing.contracts import KLControllerContract

    class TestPID(KLControllerContract):
        component = "pid"              # the registered name
        config = {"target": 4.0}       # the recipe table, without `type`

When the table needs a path or another fixture, override the `component_config` fixture instead
of `config`; to put the component next to other parts or batch sizes, override `recipe_document`.
The recipe's other parts are the kit's own stand-ins (`rlkit_core.testing.stand_ins`), so that the
tests depend on no task's plugins; its policy is a two-layer GPT-2 with the byte-level ByT5
tokenizer, written offline. An environment (`EnvironmentContract`) is played without a model: its
episodes are opened on the class's `records` and answered with fixed replies, read as the core
reads a model's turn. A tool-call format (`ToolCallFormatContract`) is built from its table
alone, as the core builds it, and checked on calls written, read back and moved into a message.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any, ClassVar

import attrs
import pytest
import torch

from rlkit_core.batch import RolloutBatch, sequence_inputs
from rlkit_core.config import fields_help
from rlkit_core.context import BuildContext
from rlkit_core.errors import RecipeError
from rlkit_core.functional import logprobs_from_logits
from rlkit_core.interfaces import KIND_TABLE, KINDS, Completion, Generation, LossInputs, LossTerms, PolicyOutput
from rlkit_core.messages import Reply, Reset, Step, ToolCall
from rlkit_core.recipe.document import parse_recipe, structure_table
from rlkit_core.recipe.plugins import load_registry
from rlkit_core.records import Recipe
from rlkit_core.testing import EPISODE_LOSS_MASK, policy_inputs, rollout_batch, stand_ins, write_tiny_causal_lm
from rlkit_core.tool_call_formats import parse_tool_calls

__all__ = [
    "AdvantageEstimatorContract", "ComponentContract", "EnvironmentContract", "GeneratorContract", "KLControllerContract",
    "LossContract", "PolicyContract", "PromptSourceContract", "RewardContract", "ToolCallFormatContract", "TrackerContract", "ValueHeadContract",
    "read_reply",
]

TABLE_OF_KIND = {kind.name: kind.table for kind in KIND_TABLE}


class ComponentContract:
    """What every component owes: registered under its name, a frozen attrs config class that
    documents every field, and a factory that builds the kind's interface from a recipe table."""

    kind: ClassVar[str]  # set by the kind's base class
    component: ClassVar[str]  # set by your subclass: the name recipes use in `type = "..."`
    config: ClassVar[dict[str, Any]] = {}  # the recipe table without `type`

    @pytest.fixture
    def component_config(self) -> dict[str, Any]:
        return dict(self.config)

    @pytest.fixture(scope="class")
    @classmethod
    def tiny_model(cls, tmp_path_factory) -> Path:
        """A model directory for the recipe's policy, or for `component_config`."""
        return write_tiny_causal_lm(tmp_path_factory.mktemp("tiny-causal-lm"))

    @pytest.fixture(scope="class")
    @classmethod
    def registry(cls):
        return load_registry()

    @pytest.fixture
    def registered(self, registry):
        stand_ins.add_to(registry)  # the recipe's other tables (`recipe_document`)
        try:
            return registry.get(self.kind, self.component, f"{type(self).__name__}.component")
        except RecipeError as exc:
            problem = exc.problems[0]
        pytest.fail(f"{problem}\nthe contract tests use installed plugins: `pip install -e .` the package, "
                    "check its `rlkit` entry point, and leave RLKIT_PLUGINS unset", pytrace=False)

    @pytest.fixture
    def recipe_document(self, registered, component_config, tiny_model, tmp_path) -> dict[str, Any]:
        """The recipe a run of this component reads: its table, and the kit's stand-ins (the policy
        on the tiny model) in the other tables a recipe must have (two samples per prompt for an
        estimator that compares them)."""
        document = {
            "run": {"steps": 10, "output_dir": str(tmp_path / "run")},
            "ppo": {"samples_per_prompt": 2 if self.kind == "advantage_estimator" and registered.factory.needs_groups else 1},
            "policy": {"type": stand_ins.POLICY, "model": str(tiny_model)},
            "reward": {"type": stand_ins.REWARD},
            "data": {"type": stand_ins.PROMPTS, "size": 16},
            "tracker": {"type": stand_ins.TRACKER},
        }
        document[TABLE_OF_KIND[self.kind]] = {"type": self.component, **component_config}
        return document

    @pytest.fixture
    def recipe(self, recipe_document, registry) -> Recipe:
        try:
            return parse_recipe(recipe_document, registry, source=f"{type(self).__name__}.recipe_document")
        except RecipeError as exc:
            pytest.fail(f"the test's recipe does not check: {exc}", pytrace=False)

    @pytest.fixture
    def structured_config(self, recipe):
        """The config instance the recipe holds for the component."""
        return recipe[TABLE_OF_KIND[self.kind]].config

    @pytest.fixture
    def policy(self, recipe):
        """The recipe's policy, built first, as in a run."""
        return BuildContext(recipe, torch.device("cpu"), recipe.run.output_dir, recipe.run.seed).build(recipe["policy"])

    @pytest.fixture
    def context(self, recipe, policy) -> BuildContext:
        return BuildContext(recipe, torch.device("cpu"), recipe.run.output_dir, recipe.run.seed, policy=policy)

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
        beta = instance.beta
        assert isinstance(beta, float) and math.isfinite(beta) and beta >= 0, f"β must be a finite float >= 0, got {beta!r}"

    def test_beta_stays_finite_and_non_negative_under_updates(self, instance):
        for round_ in range(30):
            for kl in self.observed_kls:
                instance.update(kl, 512 if round_ % 2 else 1)  # positional, as the loop calls it
                assert math.isfinite(instance.beta) and instance.beta >= 0, f"β = {instance.beta} after update(kl={kl})"

    def test_target_is_the_configs(self, instance, structured_config):
        """The `kl_over_target` health check compares the run's KL with `instance.target`: a
        controller whose config has a `target` setting must set it."""
        if "target" in attrs.fields_dict(type(structured_config)):
            assert instance.target == structured_config.target, (f"the config's target is {structured_config.target!r}, the "
                                                                 f"controller's {instance.target!r}: set self.target in __init__")
        else:
            assert instance.target is None or math.isfinite(instance.target), f"target must be None or a finite float, got {instance.target!r}"

    def test_state_round_trips_and_resumes_identically(self, make):
        trained = make()
        for kl in [8.0, 2.0, 7.0, 30.0]:
            trained.update(kl, 64)
        state = json.loads(json.dumps(trained.state_dict()))  # checkpoints store plain numbers
        resumed = make()
        resumed.load_state_dict(state)
        assert resumed.beta == trained.beta, f"β after load_state_dict is {resumed.beta}, the saved controller's is {trained.beta}"
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
        assert len(scores) == len(self.responses), f"{len(scores)} scores for {len(self.responses)} responses: {scores!r}"
        assert all(isinstance(s, float) and math.isfinite(s) for s in scores), f"every score must be a finite float: {scores!r}"

    def test_accepts_extra_columns(self, instance):
        extra = {"rlkit_contract_extra": [{"unused": True}] * len(self.responses)}
        scores = instance.score(list(self.prompts), list(self.responses), **self.columns, **extra)
        assert len(scores) == len(self.responses), f"{len(scores)} scores for {len(self.responses)} responses with an extra column"


class PromptSourceContract(ComponentContract):
    """Records with a string `prompt` and the same other columns in each (the loop takes the
    column names from the first record)."""

    kind = "prompt_source"

    def test_records_have_a_prompt_and_the_same_columns(self, instance):
        records = instance.load()
        assert records, "load() returned no records"
        assert all(isinstance(r, dict) for r in records), "every record must be a dict"
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
        assert run_id is None or isinstance(run_id, str), f"start() must return a run id string or None, got {run_id!r}"
        tracker.log_metrics({"score/mean": 0.5, "kl/beta": 0.05}, step=1)
        tracker.log_samples([{"prompt": "p", "response": "r", "score": 1.0}], step=1)
        artifact = tmp_path / "artifact.txt"
        artifact.write_text("kept with the run")
        tracker.log_artifact(str(artifact))
        tracker.finish("KILLED")
        if run_id is not None:
            resumed = make()
            reopened = resumed.start(run_name="contract", params={}, tags={}, resume_id=run_id)
            assert reopened == run_id, f"resuming run {run_id!r} opened {reopened!r}"
            resumed.log_metrics({"score/mean": 0.6}, step=2)
            resumed.finish("FINISHED")



class BatchSourceContract(ComponentContract):
    """Three iterations taken in order, each a batch the update can train on (rows; trained tokens
    within the responses, each with the sampler's log-prob) and finite metrics, from the kit's
    stand-in view (`stand_ins.SamplingStandIn`: `records(j)`, `rollout(j)`, one process); then
    `close`. The staleness its class declares is a whole number of versions, at least 0. A test of
    a whole run with the source is yours to write: the kit runs no trainer."""

    kind = "batch_source"

    def test_takes_a_trainable_batch_for_each_iteration(self, instance, recipe, context):
        view = stand_ins.SamplingStandIn(recipe, context)
        for iteration in range(3):
            batch, metrics = instance.take(iteration, view)
            assert isinstance(batch, RolloutBatch) and len(batch), f"take({iteration}) gave no rows"
            counted = batch.loss_mask.bool()
            assert (counted <= batch.response_mask.bool()).all(), f"take({iteration}): trained tokens outside the responses"
            assert torch.isfinite(batch.sampled_logprobs[counted]).all(), f"take({iteration}): a trained token has no sampler log-prob"
            bad = {name: value for name, value in metrics.items() if not (isinstance(value, float) and math.isfinite(value))}
            assert not bad, f"take({iteration}): metrics that are not finite floats: {bad}"
        instance.close()

    def test_it_declares_a_staleness(self, registered):
        stale = registered.factory.max_staleness
        assert isinstance(stale, int) and stale >= 0, f"max_staleness must be a whole number of versions, at least 0, not {stale!r}"


class AdvantageEstimatorContract(ComponentContract):
    """(advantages, returns) of shape [B, R], finite on counted tokens, zero on padding, and the
    batch it read left as it was."""

    kind = "advantage_estimator"

    def test_shapes_zero_padding_and_finite(self, instance):
        batch = rollout_batch(with_values=type(instance).needs_values)
        batch = batch.with_(advantages=None, returns=None)  # what the estimator is there to make
        advantages, returns = instance.estimate(batch)
        counted = batch.loss_mask.bool()
        for name, tensor in (("advantages", advantages), ("returns", returns)):
            assert tensor.shape == counted.shape and tensor.is_floating_point(), f"{name}: {tuple(tensor.shape)}"
            assert torch.isfinite(tensor[counted]).all(), f"{name} is not finite on counted tokens"
            assert (tensor[~counted] == 0).all(), f"{name} must be 0 on padding"

    def test_zero_where_the_loss_mask_has_holes(self, instance):
        """Tokens an episode's environment put into a response are not the policy's: they get no
        advantage and no return, and what they hold (NaN here) reaches no counted token."""
        batch = rollout_batch(with_values=type(instance).needs_values, loss_mask=torch.tensor(EPISODE_LOSS_MASK))
        advantages, returns = instance.estimate(batch.with_(advantages=None, returns=None))
        counted = batch.loss_mask.bool()
        for name, tensor in (("advantages", advantages), ("returns", returns)):
            assert torch.isfinite(tensor[counted]).all(), f"{name} is not finite on counted tokens"
            assert (tensor[~counted] == 0).all(), f"{name} must be 0 where batch.loss_mask is 0; read it, not batch.response_mask"

    def test_the_order_of_the_rollouts_does_not_matter(self, instance):
        """Groups are found by `group_ids`, not by position: the loop may gather rollouts in any order."""
        batch = rollout_batch(with_values=type(instance).needs_values)
        order = torch.tensor([3, 0, 5, 1, 4, 2])
        advantages, returns = instance.estimate(batch)
        shuffled_advantages, shuffled_returns = instance.estimate(batch.select(order))
        assert torch.allclose(shuffled_advantages, advantages[order], atol=1e-6), "advantages depend on the rollouts' order"
        assert torch.allclose(shuffled_returns, returns[order], atol=1e-6), "returns depend on the rollouts' order"

    def test_leaves_the_batch_unchanged(self, instance):
        batch = rollout_batch(with_values=type(instance).needs_values)
        before = {name: value.clone() for name, value in attrs.asdict(batch, recurse=False).items() if isinstance(value, torch.Tensor)}
        instance.estimate(batch)
        for name, value in before.items():
            unchanged = torch.allclose(value, getattr(batch, name), rtol=0, atol=0, equal_nan=True)
            assert unchanged, f"estimate() wrote into batch.{name}; return new tensors instead"


class LossContract(ComponentContract):
    """A `LossTerms` of scalar terms whose names the loop can log; `losses` are finite, backprop into
    the current log-probs (never into padding), add up over any split of the step, and work
    without a critic; the forward-pass needs an instance declares are its class's."""

    kind = "loss"

    @staticmethod
    def current(batch: RolloutBatch, with_values: bool, kl_coef: float = 0.0, with_logits: bool = False) -> LossInputs:
        """What the current parameters say: close to the rollout, with gradient, NaN on padding."""
        old = batch.old_logprobs
        assert old is not None and (batch.values is not None or not with_values), "rollout_batch fills them"
        noise = torch.randn(old.shape, generator=torch.Generator().manual_seed(1)) * 0.1
        logprobs = (old + noise).requires_grad_()
        values = (batch.values + noise).requires_grad_() if batch.values is not None and with_values else None
        entropy = torch.rand(old.shape, generator=torch.Generator().manual_seed(2)).requires_grad_()
        logits = torch.randn(*old.shape, 11, generator=torch.Generator().manual_seed(3)).requires_grad_() if with_logits else None
        return LossInputs(logprobs=logprobs, values=values, entropy=entropy, kl_coef=kl_coef, logits=logits)

    def terms(self, instance, with_values=True, token_count=None):
        batch = rollout_batch(with_values=with_values)
        current = self.current(batch, with_values, with_logits=instance.needs_logits)
        count = float(batch.loss_mask.sum()) if token_count is None else token_count
        return instance(batch, current, count), current, batch

    @pytest.mark.parametrize("with_values", [True, False], ids=["critic", "critic-free"])
    def test_terms_are_finite_scalars_and_loss_terms_backprop(self, instance, with_values):
        terms, current, batch = self.terms(instance, with_values)
        assert isinstance(terms, LossTerms), f"a loss returns rlkit_core.LossTerms, not {type(terms).__name__}"
        assert terms.losses, "no term in losses: nothing to optimise"
        named = {**{f"losses[{k!r}]": v for k, v in terms.losses.items()}, **{f"diagnostics[{k!r}]": v for k, v in terms.diagnostics.items()},
                 **{f"maxima[{k!r}]": v for k, v in terms.maxima.items()}, "skip": terms.skip}
        for name, value in named.items():
            assert isinstance(value, torch.Tensor) and value.ndim == 0, f"{name} must be a scalar tensor"
            assert torch.isfinite(value), f"{name} = {value}"
        assert float(terms.skip) in (0.0, 1.0), f"skip must be 0 or 1, got {float(terms.skip)}"
        assert all(v.requires_grad for v in terms.losses.values()), "every term in losses must carry gradient"
        terms.total().backward()
        counted = batch.loss_mask.bool()
        grad = current.logprobs.grad
        assert grad is not None and torch.isfinite(grad).all(), "the loss must reach the current log-probs"
        assert (grad[~counted] == 0).all(), "padding must get no gradient"
        assert grad[counted].abs().sum() > 0, "the loss must depend on the counted tokens' log-probs"

    def test_positions_outside_the_loss_mask_get_no_gradient(self, instance):
        """An episode's environment tokens lie inside the response but are not the policy's: NaN there
        (`rollout_batch`) must reach neither a term nor the gradient."""
        batch = rollout_batch(loss_mask=torch.tensor(EPISODE_LOSS_MASK))
        current = self.current(batch, with_values=True, with_logits=instance.needs_logits)
        terms = instance(batch, current, float(batch.loss_mask.sum()))
        assert all(torch.isfinite(value) for value in terms.losses.values()), "a loss term is not finite"
        terms.total().backward()
        grad, counted = current.logprobs.grad, batch.loss_mask.bool()
        assert grad is not None and (grad[~counted] == 0).all(), "positions outside batch.loss_mask must get no gradient"

    def test_the_loop_can_log_every_term_under_its_name(self, instance):
        terms, _, _ = self.terms(instance)
        assert not terms.naming_problems(), "; ".join(terms.naming_problems())

    def test_loss_terms_add_up_over_any_split(self, instance):
        """The loop runs a minibatch as micro-batches in several processes and adds their `losses`,
        all given the step's global token count: the sum must be the whole minibatch's term."""
        batch = rollout_batch()
        current = self.current(batch, with_values=True, kl_coef=0.1 if type(instance).takes_kl_penalty else 0.0,
                               with_logits=instance.needs_logits)
        count = float(batch.loss_mask.sum())
        whole = instance(batch, current, count)
        parts = [torch.tensor([0, 4]), torch.tensor([1, 2, 5]), torch.tensor([3])]
        tensors = {name: value for name, value in attrs.asdict(current, recurse=False).items() if isinstance(value, torch.Tensor)}
        split = [instance(batch.select(rows), attrs.evolve(current, **{name: value[rows] for name, value in tensors.items()}), count)
                 for rows in parts]
        for name, value in whole.losses.items():
            added = torch.stack([part.losses[name] for part in split]).sum()
            assert torch.allclose(added, value, rtol=1e-5, atol=1e-7), (
                f"losses[{name!r}]: the parts add up to {float(added)}, the whole minibatch gives {float(value)}; divide sums "
                "by the token_count given (or another count of the whole step), not by the minibatch's own size")

    def test_the_kl_penalty_is_a_loss_term_when_declared(self, instance):
        """`takes_kl_penalty`: β·KL of the current log-probs against the reference is the `kl` loss,
        present only when `kl_coef` is nonzero; a loss that does not declare it is refused with
        `ppo.kl_penalty = "loss"` by the recipe check instead."""
        if not type(instance).takes_kl_penalty:
            pytest.skip("this loss does not take the KL penalty (ppo.kl_penalty = 'loss' refuses it)")
        batch = rollout_batch()
        count = float(batch.loss_mask.sum())
        with_kl = instance(batch, self.current(batch, with_values=True, kl_coef=0.5, with_logits=instance.needs_logits), count)
        without = instance(batch, self.current(batch, with_values=True, with_logits=instance.needs_logits), count)
        assert "kl" in with_kl.losses and with_kl.losses["kl"].requires_grad and torch.isfinite(with_kl.losses["kl"])
        assert float(without.losses.get("kl", torch.tensor(0.0))) == 0.0, "kl_coef 0 means no KL term"

    def test_an_instance_needs_no_more_than_its_class_declares(self, instance):
        """The recipe check reads the class's flags; an instance may drop a need for its config, never add one."""
        for flag in ("needs_entropy_grad", "needs_logits"):
            assert getattr(type(instance), flag) or not getattr(instance, flag), (
                f"the instance sets {flag} but {type(instance).__name__}.{flag} is False; declare it on the class")


# --- model kinds -------------------------------------------------------------------------------


class PolicyContract(ComponentContract):
    """Logits with gradient, a frozen reference equal to the starting policy, trainable state
    that round-trips, and a plain transformers directory on save. The `tiny_model` fixture
    gives a model directory for `component_config`."""

    kind = "policy"

    @pytest.fixture
    def context(self, recipe) -> BuildContext:
        """The policy is the first component a run builds: nothing else exists yet."""
        return BuildContext(recipe, torch.device("cpu"), recipe.run.output_dir, recipe.run.seed)

    def test_tokenizer_pads_with_a_token_that_ends_nothing(self, instance):
        tokenizer = instance.tokenizer
        assert tokenizer.eos_token_id is not None and tokenizer.pad_token_id is not None, "the tokenizer needs EOS and PAD ids"
        assert instance.eos_token_ids and instance.eos_token_ids[0] == tokenizer.eos_token_id, "eos_token_ids must start with the tokenizer's EOS"
        assert tokenizer.pad_token_id not in instance.eos_token_ids, "a PAD that is also an end id would hide where responses end"

    def test_forward_and_reference_agree_at_the_start(self, instance):
        inputs = policy_inputs(instance.tokenizer)
        out = instance.forward(*inputs)
        assert isinstance(out, PolicyOutput), f"forward() must return a PolicyOutput, got {type(out).__name__}"
        assert out.logits.shape[:2] == inputs[0].shape, f"logits {tuple(out.logits.shape)} for inputs {tuple(inputs[0].shape)}"
        assert out.logits.requires_grad, "the policy's logits must carry gradient"
        reference = instance.reference_logits(*inputs)
        assert reference.shape == out.logits.shape, f"reference logits {tuple(reference.shape)}, policy logits {tuple(out.logits.shape)}"
        assert not reference.requires_grad, "the reference is frozen: its logits must carry no gradient"
        counted = inputs[1].bool()
        assert torch.allclose(reference[counted], out.logits[counted].detach(), atol=1e-5), "the reference must start as the policy"

    def test_logits_from_start_are_the_tail_of_every_position(self, instance):
        inputs = policy_inputs(instance.tokenizer)
        start = inputs[0].shape[1] - 2
        with torch.no_grad():
            full, reference = instance.forward(*inputs).logits, instance.reference_logits(*inputs)
            tail = instance.forward(*inputs, start=start).logits
            reference_tail = instance.reference_logits(*inputs, start=start)
        assert tail.shape[:2] == (inputs[0].shape[0], 2), (
            f"forward(start={start}) gave logits {tuple(tail.shape)} for inputs {tuple(inputs[0].shape)}")
        assert torch.allclose(tail, full[:, start:], atol=1e-5), "forward(start=s) must give the logits of positions s.. of forward()"
        assert torch.allclose(reference_tail, reference[:, start:], atol=1e-5), "reference_logits(start=s) must give positions s.. of reference_logits()"

    def test_gradient_reaches_the_trainable_parameters(self, instance):
        parameters = list(instance.parameters())
        assert parameters, "the policy has no trainable parameters"
        assert all(p.requires_grad for p in parameters), "parameters() must yield only trainable parameters"
        instance.forward(*policy_inputs(instance.tokenizer)).logits.logsumexp(-1).sum().backward()
        assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in parameters), "no gradient reached the parameters"

    def test_state_dict_round_trips(self, instance):
        inputs = policy_inputs(instance.tokenizer)
        state = {k: v.clone() for k, v in instance.state_dict().items()}
        with torch.no_grad():
            before = instance.forward(*inputs).logits
            for p in instance.parameters():
                p.add_(0.1)
        instance.load_state_dict(state)
        with torch.no_grad():
            assert torch.allclose(instance.forward(*inputs).logits, before), "load_state_dict did not restore the logits"

    def test_save_pretrained_writes_a_transformers_directory(self, instance, tmp_path):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        instance.save_pretrained(str(tmp_path / "saved"))
        AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
        AutoTokenizer.from_pretrained(tmp_path / "saved")


class ValueHeadContract(ComponentContract):
    """[B, L] values with gradient into the head's parameters, and state that round-trips."""

    kind = "value_head"

    def values(self, instance, policy):
        inputs = policy_inputs(policy.tokenizer)
        return instance.values(policy.forward(*inputs), *inputs), inputs

    def test_values_per_position_with_gradient(self, instance, policy):
        values, inputs = self.values(instance, policy)
        assert values.shape == inputs[0].shape, f"values {tuple(values.shape)} for inputs {tuple(inputs[0].shape)}: one per position"
        assert values.is_floating_point(), f"values must be floating point, got {values.dtype}"
        assert torch.isfinite(values[inputs[1].bool()]).all(), "values must be finite on real tokens"
        parameters = list(instance.parameters())
        assert parameters, "the critic has nothing to train"
        values.sum().backward()
        assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in parameters), "no gradient reached the critic's parameters"

    def test_state_dict_round_trips(self, instance, policy):
        state = {k: v.clone() for k, v in instance.state_dict().items()}
        with torch.no_grad():
            before, _ = self.values(instance, policy)
            for p in instance.parameters():
                p.add_(0.1)
        instance.load_state_dict(state)
        with torch.no_grad():
            after, _ = self.values(instance, policy)
        assert torch.allclose(after, before), "load_state_dict did not restore the values"

    def test_module_holds_the_parameters(self, instance):
        """A head that names its module (`ValueHead.module`, needed under FSDP) trains exactly that
        module's parameters."""
        module = instance.module()
        if module is None:
            pytest.skip("no module: the head runs with one process and under DDP only")
        assert {id(p) for p in module.parameters() if p.requires_grad} == {id(p) for p in instance.parameters()}, \
            "module() must hold exactly the parameters that parameters() trains"


class GeneratorContract(ComponentContract):
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
        temperature = instance.temperature
        assert isinstance(temperature, float) and temperature > 0, f"temperature must be a float > 0, got {temperature!r}"

    def test_masks_stop_at_the_first_eos(self, generation, policy):
        out, prompt_ids, _ = generation
        assert isinstance(out, Generation), f"generate() must return a Generation, got {type(out).__name__}"
        ids, mask = out.response_ids, out.response_mask
        shapes = f"ids {tuple(ids.shape)}, mask {tuple(mask.shape)}, logprobs {tuple(out.logprobs.shape)}"
        assert ids.shape == mask.shape == out.logprobs.shape, f"response tensors differ in shape: {shapes}"
        assert ids.shape[0] == prompt_ids.shape[0], f"{ids.shape[0]} responses for {prompt_ids.shape[0]} prompts"
        ends, pad = set(policy.eos_token_ids), policy.tokenizer.pad_token_id
        for row_ids, row_mask in zip(ids.tolist(), mask.tolist()):
            length = next((i + 1 for i, token in enumerate(row_ids) if token in ends), len(row_ids))
            assert row_mask == [1] * length + [0] * (len(row_ids) - length), "mask must count up to and including the first EOS"
            assert all(token == pad for token in row_ids[length:]), "tokens after the first EOS must be PAD"

    def test_sampled_logprobs_match_the_policy(self, instance, generation, policy):
        out, prompt_ids, prompt_mask = generation
        sequence = sequence_inputs(prompt_ids, prompt_mask, out.response_ids, out.response_mask)
        with torch.no_grad():
            logits = policy.forward(*sequence).logits[:, prompt_ids.shape[1] - 1:-1]
        recomputed = logprobs_from_logits(logits, out.response_ids, instance.temperature, policy.suppressed_token_ids)
        counted = out.response_mask.bool()
        gap = (recomputed - out.logprobs)[counted].abs().max()
        assert gap <= self.logprob_tolerance, f"sampled log-probs differ from π/T by up to {gap:.2e}"

    def test_serve_answers_every_request_once_as_the_policy_samples(self, instance, policy):
        """`serve` (episodes' turns as they come): requests that arrive in two waves, the second
        after the first answer, are each answered once, ending at the first EOS, with log-probs
        that match the policy at the sampler's temperature."""
        prompt_ids, prompt_mask, _ = policy_inputs(policy.tokenizer, ["ab", "abcdef", "x", "hello"])
        prompts = [ids[mask.bool()].tolist() for ids, mask in zip(prompt_ids, prompt_mask)]
        waves = _Waves(prompts, policy.tokenizer.pad_token_id, prompt_ids.device)
        instance.sync_weights(policy)
        torch.manual_seed(0)
        instance.serve(waves)
        assert sorted(waves.answers) == list(range(len(prompts))), f"answered {sorted(waves.answers)} of requests 0-{len(prompts) - 1}"
        ends = set(policy.eos_token_ids)
        for key, answer in waves.answers.items():
            assert answer.ids and len(answer.ids) == len(answer.logprobs), f"request {key}: {len(answer.ids)} ids, {len(answer.logprobs)} log-probs"
            assert not ends & set(answer.ids[:-1]), f"request {key} was answered past its first EOS: {answer.ids}"
            tokens = torch.tensor([prompts[key] + answer.ids])
            with torch.no_grad():
                logits = policy.forward(tokens, torch.ones_like(tokens), torch.arange(tokens.shape[1]).unsqueeze(0)).logits
            response = torch.tensor([answer.ids])
            expected = logprobs_from_logits(logits[:, len(prompts[key]) - 1:-1], response, instance.temperature, policy.suppressed_token_ids)[0]
            gap = (expected - torch.tensor(answer.logprobs)).abs().max()
            assert gap <= self.logprob_tolerance, f"request {key}: served log-probs differ from π/T by up to {gap:.2e}"

    def test_scores_match_the_policy_after_a_push(self, instance, policy):
        """A generator with weights of its own scores what the loop's push check compares
        (`Generator.score`): the policy's log-probs at temperature 1, one per token after the first."""
        ids = policy.tokenizer("hello world, the quick brown fox")["input_ids"]
        instance.sync_weights(policy)
        scores = instance.score(ids)
        if scores is None:
            pytest.skip("samples with the policy's own module: nothing pushed to check")
        assert len(scores) == len(ids) - 1, f"score() gave {len(scores)} log-probs for {len(ids) - 1} tokens after the first"
        tokens = torch.tensor([ids])
        with torch.no_grad():
            logits = policy.forward(tokens, torch.ones_like(tokens), torch.arange(len(ids)).unsqueeze(0)).logits
        expected = logprobs_from_logits(logits[:, :-1], tokens[:, 1:])[0]
        gap = (expected - torch.tensor(scores)).abs().max()
        assert gap <= self.logprob_tolerance, f"score() differs from the policy's log-probs by up to {gap:.2e}"


class _Waves:
    """Requests for `Generator.serve`: the first half of `prompts` at once, the rest once the first
    answer is given (as an episode's next turn arrives while others decode)."""

    def __init__(self, prompts: list[list[int]], pad_id: int, device: torch.device):
        half = len(prompts) // 2
        self.waiting = [list(enumerate(prompts))[:half], list(enumerate(prompts))[half:]]
        self.pad_id, self.device = pad_id, device
        self.answers: dict[int, Completion] = {}

    def arrived(self, wait: bool) -> list[tuple[Any, list[int]]]:
        if self.waiting and (len(self.waiting) == 2 or self.answers or wait):
            return self.waiting.pop(0)
        return []

    def completed(self, key: Any, completion: Completion) -> None:
        assert key not in self.answers, f"request {key} was answered twice"
        self.answers[key] = completion


# --- episode kinds -----------------------------------------------------------------------------

ROLES = ("system", "user", "assistant", "tool")


def read_reply(text: str, turn: int = 1) -> Reply:
    """`text` as the core reads a model's turn: its tool calls parsed, or why they could not be."""
    calls, error = parse_tool_calls(text)
    return Reply(text=text, turn=turn, tool_calls=calls, parse_error=error)


def message_problems(messages: Any, what: str) -> list[str]:
    """Why `messages` are not what the core renders: a list of dicts, each with a role and str content."""
    if not isinstance(messages, list):
        return [f"{what}: messages must be a list, got {type(messages).__name__}"]
    problems = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            problems.append(f"{what}: messages[{index}] is a {type(message).__name__}, not a dict")
        elif not isinstance(message.get("content"), str):
            problems.append(f"{what}: messages[{index}] has no str 'content' ({message!r})")
        elif message.get("role") not in ROLES:
            problems.append(f"{what}: messages[{index}] has role {message.get('role')!r}, not one of {', '.join(ROLES)}")
    return problems


def step_problems(step: Any, what: str) -> list[str]:
    """Why `step` breaks what the episode runner relies on, or [] (the runner ends an episode that
    breaks it with status "error", and reads `info` into `env/<name>` means when it ends)."""
    if not isinstance(step, Step):
        return [f"{what} returned {type(step).__name__}, not a rlkit_core.Step"]
    problems = message_problems(step.messages, what)
    if step.status not in ("ok", "error"):
        problems.append(f"{what}: status {step.status!r}; an environment says 'ok' or 'error' (the runner sets the others)")
    if not isinstance(step.done, bool):
        problems.append(f"{what}: done must be a bool, got {step.done!r}")
    if step.reward is not None:
        try:
            finite = math.isfinite(float(step.reward))
        except (TypeError, ValueError):
            finite = False
        if not finite or isinstance(step.reward, bool):
            problems.append(f"{what}: reward must be a finite number or None, got {step.reward!r}")
    return problems + info_problems(step.info, what)


def info_problems(info: Any, what: str) -> list[str]:
    """Why `info` (a step's, or the figures a close returns) breaks the runner's rule, or []: str
    names to finite numbers, a bool as 1 or 0; the runner ends an episode that breaks it as an error."""
    if not isinstance(info, dict):
        return [f"{what}: info must be a dict of names to numbers, got {type(info).__name__}"]
    return [f"{what}: info[{name!r}] = {value!r}; info maps str names to finite numbers (averaged into env/<name>)"
            for name, value in info.items()
            if not isinstance(name, str) or not isinstance(value, (int, float)) or not math.isfinite(value)]


def snapshots(states: dict[str, Any]) -> dict[str, Any]:
    """Copies of the episodes' states that compare equal to them; a state that cannot be copied, or
    has no equality of its own, is left out (the interleaving check then compares its steps alone)."""
    kept = {}
    for name, state in states.items():
        try:
            copied = copy.deepcopy(state)
            if bool(copied == state):
                kept[name] = copied
        except Exception:  # an uncopyable or incomparable state is checked by its steps
            continue
    return kept


def assert_unchanged(states: dict[str, Any], before: dict[str, Any], what: str) -> None:
    for name, snapshot in before.items():
        assert states[name] == snapshot, (f"{what} changed episode {name}'s state; keep each episode's state in what reset "
                                          "returns, nothing of it on self or shared between episodes")


class EnvironmentContract(ComponentContract):
    """Tools as JSON schemas of functions; `reset` opens every record with messages, alike for the
    same seed, and leaves the record as it was; `step` answers any reply (plain text, an unreadable
    tool call, a call of a tool that does not exist) with a valid `Step` and never raises, turn
    after turn up to `max_turns`; one instance plays interleaved episodes, each on its own state;
    and `close` takes an episode at any point.

    `records` are the prompt records the checks open episodes with: give ones with the columns
    your environment reads (or override the `environment_records` fixture). Set `deterministic`
    False for an environment whose answers vary for the same seed (a sampled user simulator): the
    interleaving check then compares states only, not the steps an episode gets alone."""

    kind = "environment"
    records: ClassVar[list[dict[str, Any]]] = [{"prompt": f"Item {index}:", "reference": f"item {index}"} for index in range(3)]
    # the model's turns the checks reply with, by name: raw text, read as the core reads it (`read_reply`)
    replies: ClassVar[dict[str, str]] = {
        "plain": "7",
        "empty": "",
        "unreadable tool call": '<tool_call>{"name": "add", "arguments": {"amount": 1}',
        "unknown tool": '<tool_call>{"name": "rlkit_contract_no_such_tool", "arguments": {}}</tool_call>',
    }
    # the replies, turn by turn, of the two interleaved episodes: calls first, which keep a tool environment going
    interleaved: ClassVar[tuple[str, ...]] = ("unknown tool", "unreadable tool call", "plain")
    deterministic: ClassVar[bool] = True

    @pytest.fixture
    def environment_records(self) -> list[dict[str, Any]]:
        return copy.deepcopy(list(self.records))

    def reset(self, instance, record: dict[str, Any], seed: int) -> Reset:
        try:
            opening = instance.reset(record, seed)
        except Exception as exc:
            raise AssertionError(f"reset({record!r}, seed={seed}) raised {type(exc).__name__}: {exc}; give the contract "
                                 "`records` with the columns your environment reads") from exc
        problems = ([f"reset() returned {type(opening).__name__}, not a rlkit_core.Reset"] if not isinstance(opening, Reset)
                    else message_problems(opening.messages, "reset()"))
        assert not problems, "; ".join(problems)
        assert opening.messages, f"reset({record!r}) returned no opening messages: the model needs something to answer"
        return opening

    def step(self, instance, state: Any, name: str, turn: int = 1) -> Step:
        reply = read_reply(self.replies[name], turn)
        what = f"step() on the {name!r} reply {reply.text!r} in turn {turn}"
        try:
            answer = instance.step(state, reply)
        except Exception as exc:
            raise AssertionError(f"{what} raised {type(exc).__name__}: {exc}; answer a reply the environment cannot use with a "
                                 "message saying so (or status 'error'), never an exception") from exc
        problems = step_problems(answer, what)
        assert not problems, "; ".join(problems)
        return answer

    def test_tools_are_function_schemas(self, instance):
        tools = instance.tools()
        assert isinstance(tools, list), f"tools() must return a list, got {type(tools).__name__}"
        names = []
        for index, schema in enumerate(tools):
            function = schema.get("function") if isinstance(schema, dict) else None
            assert isinstance(schema, dict) and schema.get("type") == "function" and isinstance(function, dict), (
                f"tools()[{index}] must be {{'type': 'function', 'function': {{...}}}}, got {schema!r}")
            assert isinstance(function.get("name"), str) and function["name"], f"tools()[{index}] has no function name: {schema!r}"
            assert isinstance(function.get("description", ""), str), f"tool {function['name']!r}: description must be a str"
            parameters = function.get("parameters", {"type": "object"})
            assert isinstance(parameters, dict) and parameters.get("type") == "object", (
                f"tool {function['name']!r}: parameters must be a JSON schema of type 'object', got {parameters!r}")
            names.append(function["name"])
        assert len(set(names)) == len(names), f"tools() names a tool twice: {names}"
        assert json.loads(json.dumps(tools)) == tools, "tools() must be plain JSON (chat templates render it)"
        assert instance.tools() == tools, "tools() differs between two calls; the runner reads it once per rollout"

    def test_reset_opens_every_record_and_leaves_it_as_it_was(self, instance, environment_records):
        assert environment_records, "the contract needs at least one record"
        for seed, record in enumerate(environment_records):
            before = copy.deepcopy(record)
            self.reset(instance, record, seed)
            assert record == before, f"reset() changed its record ({before!r} became {record!r}); the loop reads its columns later"

    def test_the_same_seed_opens_alike(self, instance, make, environment_records):
        record = environment_records[0]
        first = self.reset(instance, copy.deepcopy(record), 1234).messages
        again = self.reset(instance, copy.deepcopy(record), 1234).messages
        fresh = self.reset(make(), copy.deepcopy(record), 1234).messages
        assert again == first, f"two resets with seed 1234 opened differently: {first!r}, then {again!r}; draw from the seed given"
        assert fresh == first, f"a new instance opened the same record and seed differently: {first!r}, then {fresh!r}"

    def test_every_reply_gets_a_valid_step(self, instance, environment_records):
        for name in self.replies:
            for seed, record in enumerate(environment_records):
                self.step(instance, self.reset(instance, record, seed).state, name)

    def test_a_fixed_reply_for_max_turns_ends_or_stays_valid(self, instance, structured_config, environment_records):
        """The runner steps an episode until it is done, fails or reaches its turn limit."""
        for name in self.replies:
            state = self.reset(instance, environment_records[0], 0).state
            for turn in range(1, structured_config.max_turns + 1):
                answer = self.step(instance, state, name, turn)
                if answer.done or answer.status == "error":
                    break

    def test_close_takes_an_episode_however_far_it_went(self, instance, environment_records):
        """The runner closes every episode whose reset returned, once, after its last step: one just
        opened (its first turn was cut off) as well as one that was answered. It returns None, or
        figures known only at the end, under the rule of a step's info."""
        opened = self.reset(instance, environment_records[0], 0).state
        answered = self.reset(instance, environment_records[0], 1).state
        self.step(instance, answered, next(iter(self.replies)))
        for state in (opened, answered):
            figures = instance.close(state)
            problems = [] if figures is None else info_problems(figures, "close()")
            assert not problems, "close() returns None or the episode's figures: " + "; ".join(problems)

    def play(self, instance, episodes: dict[str, tuple[dict[str, Any], int]], order: list[str]) -> dict[str, list[Step]]:
        """Episodes reset in turn, then stepped in `order` (names, each as often as it takes
        turns) with the `interleaved` replies, until each is done; checks after each reset and
        step that the other episodes' states are as they were. Returns each episode's steps."""
        states: dict[str, Any] = {}
        steps: dict[str, list[Step]] = {name: [] for name in episodes}
        for name, (record, seed) in episodes.items():
            before = snapshots(states)
            states[name] = self.reset(instance, copy.deepcopy(record), seed).state
            assert_unchanged(states, before, f"resetting episode {name}")
        for name in order:
            taken = steps[name]
            if len(taken) == len(self.interleaved) or (taken and (taken[-1].done or taken[-1].status == "error")):
                continue
            before = snapshots({other: state for other, state in states.items() if other != name})
            taken.append(self.step(instance, states[name], self.interleaved[len(taken)], len(taken) + 1))
            assert_unchanged(states, before, f"stepping episode {name}")
        return steps

    def test_one_instance_serves_interleaved_episodes(self, instance, make, environment_records):
        a, b = environment_records[0], environment_records[1 % len(environment_records)]
        turns = len(self.interleaved)
        together = self.play(instance, {"A": (a, 11), "B": (b, 12)}, ["A", "B"] * turns)
        if not self.deterministic:
            return
        for name, (record, seed) in {"A": (a, 11), "B": (b, 12)}.items():
            alone = self.play(make(), {name: (record, seed)}, [name] * turns)[name]
            assert together[name] == alone, (f"episode {name} got other steps beside another episode than alone:\n{together[name]!r}\n"
                                             f"alone:\n{alone!r}\nkeep each episode's state in what reset returns, nothing of it on self")


# --- tool-call formats -------------------------------------------------------------------------

LOOKUP_TOOL = {"type": "function", "function": {"name": "lookup", "description": "looks a word up", "parameters": {
    "type": "object", "properties": {"word": {"type": "string"}, "count": {"type": "integer"}, "exact": {"type": "boolean"}},
    "required": ["word"]}}}


class NestedFormatContract:
    """The fixtures of a format's contract (a nested class kind, chosen in `[environment]`): the
    installed registry, the component it names, and the test's `config` checked as a recipe's."""

    kind: ClassVar[str]
    component: ClassVar[str]
    config: ClassVar[dict[str, Any]] = {}

    @pytest.fixture(scope="class")
    @classmethod
    def registry(cls):
        return load_registry()

    @pytest.fixture
    def registered(self, registry):
        component = registry.find(self.kind, self.component)
        if component is None:
            pytest.fail(f"no {self.kind} {self.component!r} is registered (registered: {', '.join(registry.names(self.kind))}); "
                        "`pip install -e .` the package, check its `rlkit` entry point, and leave RLKIT_PLUGINS unset", pytrace=False)
        return component

    @pytest.fixture
    def structured_config(self, registered, registry):
        config, problems = structure_table(dict(self.config), registered.config_class, f"$.environment.{self.kind}", registry)
        if problems:
            pytest.fail(f"the test's config does not check: {'; '.join(map(str, problems))}", pytrace=False)
        return config

    def test_config_class_documents_every_field(self, registered):
        rows = fields_help(registered.config_class)
        undocumented = [name for name, _, _, _, help_text in rows if not help_text.strip() or "\n" in help_text]
        assert not undocumented, f"{registered.config_class.__name__}: fields without a one-line help: {', '.join(undocumented)}"


class ToolCallFormatContract(NestedFormatContract):
    """What a tool-call format owes (`rlkit_core.ToolCallFormat`): calls it writes read back as they
    were, typed by `tools`; a turn without markup has no calls and no error; a malformed turn gives
    no call and a reason (all or none); the message it leaves carries the calls and none of their
    markup. A subclass names the format and may give `config` (its table, without `type`), `calls`
    (what it round-trips: one call where the format writes one a turn), `malformed` (turns it must
    refuse) and `template` (a chat template's source it recognises):

        class TestMyFormat(ToolCallFormatContract):
            component = "my-format"
            malformed = ["<call>lookup(word=</call>"]
    """

    kind: ClassVar[str] = "tool_call_format"
    tools: ClassVar[list[dict[str, Any]]] = [LOOKUP_TOOL]
    calls: ClassVar[list[ToolCall]] = [ToolCall("lookup", {"word": "fox", "count": 2, "exact": True}), ToolCall("lookup", {"word": "wolf"})]
    malformed: ClassVar[list[str]] = []
    template: ClassVar[str | None] = None
    prose: ClassVar[str] = "The answer is 42, no tool needed."

    @pytest.fixture
    def instance(self, registered, structured_config):
        return registered.factory(structured_config)

    def test_config_class_is_frozen(self, structured_config):
        with pytest.raises(attrs.exceptions.FrozenInstanceError):
            structured_config.rlkit_contract_probe = 1  # decorate the class with @attrs.frozen

    def test_written_calls_read_back_as_they_were(self, instance):
        written = instance.write(self.calls)
        assert instance.read(written, self.tools) == (tuple(self.calls), None), f"{written!r} does not read back as {self.calls}"

    def test_a_turn_without_markup_has_no_calls_and_no_error(self, instance):
        assert instance.read(self.prose, self.tools) == ((), None)
        assert instance.read("", self.tools) == ((), None)

    def test_a_malformed_turn_gives_no_call_and_a_reason(self, instance):
        for text in self.malformed:
            calls, error = instance.read(text, self.tools)
            assert calls == () and isinstance(error, str) and error, f"{text!r}: read {calls}, error {error!r}; all or none, with a reason"

    def test_the_message_carries_the_calls_without_their_markup(self, instance):
        written = instance.write(self.calls)
        calls, _ = instance.read(written, self.tools)
        message = instance.assistant_message(Reply(text=written, turn=1, tool_calls=calls))
        assert message["role"] == "assistant" and isinstance(message["content"], str)
        assert not any(c.name in message["content"] for c in self.calls), f"the content keeps the markup: {message['content']!r}"
        assert message["tool_calls"] == [{"type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in self.calls]

    def test_a_turn_it_cannot_read_keeps_its_text(self, instance):
        for text in [*self.malformed, self.prose]:
            assert instance.assistant_message(Reply(text=text, turn=1, parse_error="x")) == {"role": "assistant", "content": text}

    def test_recognises_its_template_and_not_an_empty_one(self, registered):
        assert registered.factory.recognises("") is False, "recognises('') must be False: a template without calls names no format"
        if self.template is not None:
            assert registered.factory.recognises(self.template) is True, f"{self.component!r} does not recognise the class's template"


CHAT_OPENING = [{"role": "system", "content": "answer briefly"}, {"role": "user", "content": "what is a fox?"}]


class ChatFormatContract(NestedFormatContract):
    """What a chat format owes (`rlkit_core.ChatFormat`): an opening that is the ids of the
    conversation it renders, generation prompt included; a sampled turn read with its end token
    dropped and its calls read in the tool-call format; after that turn, a bridge of ids that
    carries the next message and a generation prompt, or None where the stream is not what the
    format renders (the runner then starts a new sample). A subclass names the format and may give
    `config` (its table, without `type`) and override the `tokenizer` fixture (ByT5's byte-level
    one by default, which needs no files):

        class TestMyFormat(ChatFormatContract):
            component = "my-format"
    """

    kind: ClassVar[str] = "chat_format"

    @pytest.fixture
    def tokenizer(self):
        from transformers import ByT5Tokenizer

        return ByT5Tokenizer()

    @pytest.fixture
    def instance(self, registry, structured_config, tokenizer):
        from rlkit_core.chat_format import chat_format_for

        return chat_format_for(self.component, tokenizer, (tokenizer.eos_token_id,), registry=registry, config=structured_config)

    def test_the_opening_is_the_rendered_conversation(self, instance):
        text = instance.render(CHAT_OPENING, [LOOKUP_TOOL], True)
        assert isinstance(text, str) and "what is a fox?" in text, f"render() lost the user's message: {text!r}"
        assert instance.opening(CHAT_OPENING, [LOOKUP_TOOL]) == instance.encode(text)

    def test_a_sampled_turn_is_read_without_its_end_and_with_its_calls(self, instance):
        end = instance.eos_token_ids[0]
        reply = instance.read([*instance.encode("a small wild dog"), end], 1)
        assert reply.text == "a small wild dog" and reply.tool_calls == () and reply.parse_error is None
        call = ToolCall("lookup", {"word": "fox"})
        reply = instance.read([*instance.encode(instance.tool_calls.write([call])), end], 2, [LOOKUP_TOOL])
        assert reply.tool_calls == (call,), f"a call written in the format's tool-call markup was read as {reply.tool_calls}"

    def test_the_bridge_carries_the_next_message_and_a_generation_prompt(self, instance):
        stream = [*instance.opening(CHAT_OPENING, []), *instance.encode("a small wild dog"), instance.eos_token_ids[0]]
        history = [*CHAT_OPENING, {"role": "assistant", "content": "a small wild dog"}]
        new = [{"role": "user", "content": "and a wolf?"}]
        bridge = instance.bridge(stream, history, new, [])
        if bridge is None:
            return  # the stream is not what the format renders: a new sample starts, from `opening`
        assert isinstance(bridge, list) and all(isinstance(i, int) for i in bridge), f"bridge() must give a list of ids, got {bridge!r}"
        assert "and a wolf?" in instance.decode(bridge), f"the bridge lost the next message: {instance.decode(bridge)!r}"
