"""The built-in components pass the same contract tests that `rlkit_core.testing.contracts` offers plugin
authors: every component that can be built offline."""

import inspect
import json
import random
import subprocess
import sys
import types

import attrs
import pytest
from rlkit_plugins.environments import counter_tasks, word_problems

from rlkit_core import Environment, Reset, Step, hookimpl
from rlkit_core.config import setting
from rlkit_core.interfaces import KLController
from rlkit_core.recipe.plugins import load_registry
from rlkit_core.testing import stand_ins
from rlkit_core.testing.contracts import (
    AdvantageEstimatorContract,
    EnvironmentContract,
    GeneratorContract,
    KLControllerContract,
    LossContract,
    PolicyContract,
    PromptSourceContract,
    RewardContract,
    TrackerContract,
    ValueHeadContract,
)


class TestFixedKL(KLControllerContract):
    component = "fixed"
    config = {"beta": 0.1}


class TestAdaptiveKL(KLControllerContract):
    component = "adaptive"
    config = {"beta": 0.1, "target": 6.0, "horizon": 10000.0}


class TestGAE(AdvantageEstimatorContract):
    component = "gae"


class TestGAEWithoutWhitening(AdvantageEstimatorContract):
    component = "gae"
    config = {"gamma": 0.99, "lam": 0.9, "whiten": False}


class TestGRPO(AdvantageEstimatorContract):
    component = "grpo"


class TestDrGRPO(AdvantageEstimatorContract):
    component = "grpo"
    config = {"scale_by_std": False}


class TestRLOO(AdvantageEstimatorContract):
    component = "rloo"


class TestReinforcePlusPlus(AdvantageEstimatorContract):
    component = "reinforce++"
    config = {"gamma": 0.9}


class TestReMax(AdvantageEstimatorContract):
    component = "remax"


class TestPPOClip(LossContract):
    component = "ppo-clip"
    config = {"entropy_coef": 0.01}


class TestPPOClipSequenceMean(LossContract):
    component = "ppo-clip"
    config = {"entropy_coef": 0.01, "aggregation": "seq-mean-token-mean", "tis_cap": 2.0}


class TestPPOClipTokenSumNorm(LossContract):
    component = "ppo-clip"
    config = {"entropy_coef": 0.01, "aggregation": "seq-mean-token-sum-norm"}


class TestPPOClipGSPO(LossContract):
    component = "ppo-clip"
    config = {"surrogate": "gspo", "aggregation": "seq-mean-token-mean"}  # a clip wide enough that the test noise is not all clipped


class TestPPOClipCISPO(LossContract):
    component = "ppo-clip"
    config = {"surrogate": "cispo", "clip_high": 0.28, "dual_clip": 3.0}


class TestPythonReward(RewardContract):
    component = "python"
    columns = {"letter": ["e", "e", "e"]}

    @pytest.fixture
    def component_config(self, reward_file):
        return {"function": f"{reward_file}:lowercase_share"}


class TestJsonlPrompts(PromptSourceContract):
    component = "jsonl"

    @pytest.fixture
    def component_config(self, tmp_path):
        path = tmp_path / "prompts.jsonl"
        path.write_text("".join(json.dumps({"text": t, "reference": t.upper()}) + "\n" for t in ["ab", "cd", "ef"]))
        return {"path": str(path), "prompt_field": "text"}


class TestNoTracker(TrackerContract):
    component = "none"


class TestMLflowTracker(TrackerContract):
    component = "mlflow"

    @pytest.fixture(scope="class")
    @classmethod
    def store(cls, tmp_path_factory):
        """One store for the class: creating an MLflow database takes seconds."""
        return tmp_path_factory.mktemp("mlflow")

    @pytest.fixture
    def component_config(self, store, monkeypatch):
        monkeypatch.chdir(store)  # a SQLite store puts artifacts under ./mlruns of the working directory
        return {"uri": f"sqlite:///{store / 'mlflow.db'}", "experiment": "contract"}


class TestHFPolicy(PolicyContract):
    component = "hf"

    @pytest.fixture
    def component_config(self, tiny_model):
        return {"model": str(tiny_model)}


class TestHFGenerator(GeneratorContract):
    component = "hf"
    config = {"max_new_tokens": 6, "temperature": 0.7}


class TestHFGeneratorInChunks(GeneratorContract):
    """Two generate calls of two prompts each, joined with padding to the longer responses."""

    component = "hf"
    config = {"max_new_tokens": 6, "temperature": 0.7, "batch_size": 2}


class TestSharedValueHead(ValueHeadContract):
    component = "shared"


class TestRougeReward(RewardContract):
    component = "rouge"
    columns = {"reference": ["The baker sold bread in Paris."] * 3}


class TestToySummaries(PromptSourceContract):
    component = "toy-summaries"
    config = {"size": 16, "seed": 3}


class TestWarmStartSummarizer(PolicyContract):
    component = "warm-start-summarizer"

    @pytest.fixture(scope="class")
    @classmethod
    def cache(cls, tmp_path_factory):
        return tmp_path_factory.mktemp("warm-start-cache")

    @pytest.fixture
    def component_config(self, cache):
        return {"cache_dir": str(cache), "n_layer": 1, "n_embd": 16, "n_head": 2, "sft_steps": 2, "sft_batch_size": 4}


class TestGuessNumber(EnvironmentContract):
    component = "guess-number"
    records = [{"prompt": "Guess my number, 1-16.", "secret": secret} for secret in (1, 9, 16)]


class TestGuessNumberWithOneTurn(EnvironmentContract):
    component = "guess-number"
    config = {"max_turns": 1, "low": 3, "high": 5, "turn_cost": 0.0}
    records = [{"prompt": "Guess my number, 3-5.", "secret": secret} for secret in (3, 5)]


class TestCounter(EnvironmentContract):
    component = "counter"
    records = counter_tasks(3, seed=0)


class TestCalculator(EnvironmentContract):
    component = "calculator"
    records = word_problems(3, seed=0)


# --- the contract tests build as a run does ------------------------------------------------------


@attrs.frozen
class DecayConfig:
    beta: float = setting(0.1, help="β at the start; it falls linearly to 0 over the run")


class DecayingKL(KLController):
    """Reads the run's length from the recipe, as a schedule over the run naturally would."""

    def __init__(self, config, context):
        self.start, self.steps, self.done = config.beta, context.recipe.run.steps, 0

    @property
    def beta(self) -> float:
        return self.start * max(0.0, 1 - self.done / self.steps)

    def update(self, kl, n_samples):
        self.done += 1

    def state_dict(self):
        return {"done": self.done}

    def load_state_dict(self, state):
        self.done = state["done"]


def register_kl_controllers(register):
    register("decaying", DecayingKL, DecayConfig)


class TestAControllerThatReadsTheRecipe(KLControllerContract):
    component = "decaying"

    @pytest.fixture(scope="class")
    @classmethod
    def registry(cls):
        plugin = types.ModuleType("decaying_kl")
        plugin.register_kl_controllers = hookimpl(register_kl_controllers)
        return load_registry(extra_plugins=[("decaying-kl", plugin, "rlkit-decaying", "0.1")])

    def test_the_context_holds_the_recipe_registry_and_policy(self, context, registry):
        assert context.recipe["kl"].component.name == "decaying" and context.recipe.run.steps == 10
        assert context.registry is registry
        assert context.policy is not None and context.tokenizer is context.policy.tokenizer


def test_the_test_helpers_import_without_pytest():
    """`rlkit_core.testing` is part of the runtime package; pytest is a test dependency only."""
    code = "import sys, rlkit_core.testing; assert 'pytest' not in sys.modules, 'pytest was imported'"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


@attrs.frozen
class TargetedConfig:
    target: float = setting(4.0, help="the KL to steer towards")


class ForgetsItsTarget(KLController):
    """Steers towards `config.target` but never says so: the health check would never fire."""

    def __init__(self, config, context=None):
        self.config = config

    @property
    def beta(self) -> float:
        return 0.1

    def update(self, kl, n_samples):
        pass

    def load_state_dict(self, state):
        pass


def test_the_kl_contract_holds_a_controller_to_its_configs_target():
    contract, config = KLControllerContract(), TargetedConfig()
    with pytest.raises(AssertionError, match="set self.target"):
        contract.test_target_is_the_configs(ForgetsItsTarget(config), config)
    kept = ForgetsItsTarget(config)
    kept.target = config.target
    contract.test_target_is_the_configs(kept, config)


class TestTheKitsStandInPolicy(PolicyContract):
    component = stand_ins.POLICY

    @pytest.fixture
    def component_config(self, tiny_model):
        return {"model": str(tiny_model)}


class TestTheKitsStandInPrompts(PromptSourceContract):
    component = stand_ins.PROMPTS


class TestTheKitsStandInReward(RewardContract):
    component = stand_ins.REWARD


class TestTheKitsStandInTracker(TrackerContract):
    component = stand_ins.TRACKER


# --- the environment contract fails each environment that breaks a promise -----------------------


@attrs.define
class Talk:
    record: dict
    turns: int = 0


class Echo(Environment):
    """Counts the turns back to the model and ends after three: keeps every promise."""

    def __init__(self, config=None, context=None):
        self.config = config

    def reset(self, record, seed):
        return Reset([{"role": "user", "content": record["prompt"]}], Talk(record))

    def step(self, state, reply):
        state.turns += 1
        return Step(messages=[{"role": "user", "content": f"turn {state.turns}"}], reward=0.0, done=state.turns == 3,
                    info={"turns": state.turns})


class BareSchemas(Echo):
    def tools(self):
        return [{"name": "look", "parameters": {"type": "object", "properties": {}}}]


class CountedSchemas(Echo):
    calls = 0

    def tools(self):
        self.calls += 1
        return [{"type": "function", "function": {"name": "look", "description": f"call {self.calls}"}}]


class MarksItsRecord(Echo):
    def reset(self, record, seed):
        record["seen"] = True
        return super().reset(record, seed)


class SaysNothing(Echo):
    def reset(self, record, seed):
        return Reset([], Talk(record))


class IgnoresTheSeed(Echo):
    def reset(self, record, seed):
        return Reset([{"role": "user", "content": f"{record['prompt']} {random.random()}"}], Talk(record))


class RaisesOnBadMarkup(Echo):
    def step(self, state, reply):
        if reply.parse_error:
            raise ValueError(reply.parse_error)
        return super().step(state, reply)


class SaysItIsDone(Echo):
    def step(self, state, reply):
        return Step(status="done", done=True)


class PaysNaN(Echo):
    def step(self, state, reply):
        return Step(reward=float("nan"), done=True)


class ReportsAWord(Echo):
    def step(self, state, reply):
        return Step(done=True, info={"mood": "good"})


class ReportsANumberAsText(Echo):
    def step(self, state, reply):
        return Step(done=True, info={"score": "1.5"})


class ClosesWithFigures(Echo):
    def close(self, state):
        return {"turns": float(state.turns), "solved": False}


class ClosesWithAWord(Echo):
    def close(self, state):
        return {"mood": "good"}


class ClosesWithTrue(Echo):
    def close(self, state):
        return True


class BreaksInTurnThree(Echo):
    def step(self, state, reply):
        if reply.turn == 3:
            raise RuntimeError("lost track")
        return super().step(state, reply)


class CountsOnItself(Echo):
    turns = 0

    def step(self, state, reply):
        self.turns += 1
        return Step(messages=[{"role": "user", "content": f"turn {self.turns}"}], done=self.turns == 3)


class SharesOneState(Echo):
    def __init__(self, config=None, context=None):
        self.talk = Talk({})

    def reset(self, record, seed):
        self.talk.record, self.talk.turns = record, 0
        return Reset([{"role": "user", "content": record["prompt"]}], self.talk)


ECHO_RECORDS = [{"prompt": "one"}, {"prompt": "two"}]


def environment_check(check: str, environment: type) -> None:
    """One check of `EnvironmentContract` on `environment`, given the fixtures it asks for."""
    method = getattr(EnvironmentContract(), check)
    given = {"instance": environment(), "make": environment, "environment_records": [dict(r) for r in ECHO_RECORDS],
             "structured_config": types.SimpleNamespace(max_turns=4)}
    method(**{name: given[name] for name in inspect.signature(method).parameters})


ENVIRONMENT_CHECKS = [name for name in vars(EnvironmentContract) if name.startswith("test_")]


@pytest.mark.parametrize("check", ENVIRONMENT_CHECKS)
def test_the_environment_contract_passes_an_environment_that_keeps_every_promise(check):
    environment_check(check, Echo)


def test_the_environment_contract_passes_a_close_that_returns_figures():
    environment_check("test_close_takes_an_episode_however_far_it_went", ClosesWithFigures)


BROKEN_ENVIRONMENTS = [
    (BareSchemas, "test_tools_are_function_schemas", r"tools\(\)\[0\] must be \{'type': 'function'"),
    (CountedSchemas, "test_tools_are_function_schemas", "differs between two calls"),
    (MarksItsRecord, "test_reset_opens_every_record_and_leaves_it_as_it_was", "reset\\(\\) changed its record"),
    (SaysNothing, "test_reset_opens_every_record_and_leaves_it_as_it_was", "no opening messages"),
    (IgnoresTheSeed, "test_the_same_seed_opens_alike", "two resets with seed 1234 opened differently"),
    (RaisesOnBadMarkup, "test_every_reply_gets_a_valid_step", "'unreadable tool call' reply .* raised ValueError"),
    (SaysItIsDone, "test_every_reply_gets_a_valid_step", "status 'done'; an environment says 'ok' or 'error'"),
    (PaysNaN, "test_every_reply_gets_a_valid_step", "reward must be a finite number or None, got nan"),
    (ReportsAWord, "test_every_reply_gets_a_valid_step", r"info\['mood'\] = 'good'"),
    (ReportsANumberAsText, "test_every_reply_gets_a_valid_step", r"info\['score'\] = '1.5'"),
    (ClosesWithAWord, "test_close_takes_an_episode_however_far_it_went", r"close\(\): info\['mood'\] = 'good'"),
    (ClosesWithTrue, "test_close_takes_an_episode_however_far_it_went", "info must be a dict of names to numbers, got "
                                                                           "bool"),
    (BreaksInTurnThree, "test_a_fixed_reply_for_max_turns_ends_or_stays_valid", "in turn 3 raised RuntimeError: lost track"),
    (CountsOnItself, "test_one_instance_serves_interleaved_episodes", "episode A got other steps beside another episode than alone"),
    (SharesOneState, "test_one_instance_serves_interleaved_episodes", "resetting episode B changed episode A's state"),
]


@pytest.mark.parametrize("environment, check, message", BROKEN_ENVIRONMENTS, ids=[case[0].__name__ for case in BROKEN_ENVIRONMENTS])
def test_the_environment_contract_fails_an_environment_that_breaks_a_promise(environment, check, message):
    with pytest.raises(AssertionError, match=message):
        environment_check(check, environment)
