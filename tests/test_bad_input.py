"""The bad-input corpus: the ways a user hands rlkit a wrong recipe, path or `--set`.

Every case must end with exit code 2, a message that names the place and the fix, no traceback,
and the disk exactly as it was: the working directory, the files the recipe points at, the MLflow
store and the caches (HOME, XDG_CACHE_HOME and HF_HOME point into the sandbox). Each case runs
`rlkit check` and `rlkit run` through `rlkit_core.runtime.cli.main` in this process (the command's own
code, without the start-up time); a sample runs the real command in a subprocess as well, which
is also where the cache variables fully apply (libraries imported earlier in this process keep
the values they read then).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import attrs
import pytest

from rlkit_core.runtime.cli import main
from rlkit_core.runtime.run_lock import Holder

REWARD = "def score(prompts, responses, **columns):\n    return [float(len(r)) for r in responses]\n"
BASE = """\
[run]
steps = 1
output_dir = "out"
threads = 1

[ppo]
batch_size = 16
minibatch_size = 8
epochs = 1

[policy]
type = "hf"
model = "model"

[generator]
max_new_tokens = 4

[reward]
type = "python"
function = "reward.py:score"

[kl]
type = "adaptive"
beta = 0.1
target = 6.0

[data]
type = "jsonl"
path = "prompts.jsonl"

[tracker]
type = "mlflow"
uri = "sqlite:///store/mlflow.db"
"""

# an agent's recipe: `rlkit check` reads the policy's tokenizer for its chat-template audit before it builds anything
AGENT = BASE.replace('[reward]\ntype = "python"\nfunction = "reward.py:score"\n',
                     '[environment]\ntype = "agent"\nharness = "agent.py:play"\nmax_turns = 1\n')


@attrs.frozen
class Case:
    name: str
    expect: tuple[str, ...]  # every one must appear in stderr: the place, and words of the fix
    sets: tuple[str, ...] = ()  # --set overrides
    text: str | None = None  # the recipe's text, replacing BASE
    edit: tuple[str, str] | None = None  # (old, new): one replacement in BASE
    commands: tuple[str, ...] = ("check", "run")
    extra: tuple[str, ...] = ()  # more arguments after the recipe (run only)
    recipe: str = "recipe.toml"


def edited(old: str, new: str) -> tuple[str, str]:
    assert old in BASE, old
    return old, new


CASES = [
    # TOML syntax
    Case("unclosed-table-header", ("not valid TOML", "line 1"), text="[run\nsteps = 1\n"),
    Case("missing-value", ("not valid TOML",), edit=edited("steps = 1", "steps =")),
    Case("duplicate-key", ("not valid TOML",), edit=edited("steps = 1", "steps = 1\nsteps = 2")),
    Case("unquoted-string", ("not valid TOML",), edit=edited('output_dir = "out"', "output_dir = out")),
    Case("duplicate-table", ("not valid TOML",), text=BASE + "\n[run]\nseed = 1\n"),
    # unknown tables and keys
    Case("unknown-table", ("$.hyperparameters: unknown table", "known tables: run, ppo"), text=BASE + "\n[hyperparameters]\nx = 1\n"),
    Case("misspelled-table", ("$.polcy: unknown table; did you mean [policy]?",), text=BASE + '\n[polcy]\nmodel = "m"\n'),
    Case("misspelled-run-key", ("$.run.stpes: unknown key; did you mean 'steps'?",), edit=edited("threads = 1", "threads = 1\nstpes = 2")),
    Case("misspelled-component-key", ("$.kl.targt: unknown key; did you mean 'target'?",), edit=edited("target = 6.0", "targt = 6.0")),
    Case("misspelled-policy-key", ("$.policy.modle: unknown key; did you mean 'model'?",), edit=edited('model = "model"', 'model = "model"\nmodle = "x"')),
    # wrong types
    Case("steps-as-text", ("$.run.steps: expected an integer, got 'ten'",), sets=('run.steps="ten"',)),
    Case("batch-as-float", ("$.ppo.batch_size: expected an integer, got 2.5",), sets=("ppo.batch_size=2.5",)),
    Case("lr-as-text", ("$.optim.learning_rate: expected a number",), sets=('optim.learning_rate="fast"',)),
    Case("output-dir-as-number", ("$.run.output_dir: expected a string, got 3",), sets=("run.output_dir=3",)),
    Case("temperature-as-bool", ("$.generator.temperature: expected a number, got True",), sets=("generator.temperature=true",)),
    Case("table-as-number", ("$.ppo: expected a table, got 3",), sets=("ppo=3",)),
    Case("list-as-text", ("$.policy.lora_target_modules",), sets=('policy.lora_target_modules="c_attn"',)),
    Case("type-as-number", ("$.kl.type: expected a string, got 3",), sets=("kl.type=3",)),
    # out of range
    Case("zero-steps", ("$.run.steps: must be > 0, got 0",), sets=("run.steps=0",)),
    Case("negative-epochs", ("$.ppo.epochs: must be > 0, got -1",), sets=("ppo.epochs=-1",)),
    Case("negative-kl-target", ("$.kl.target: must be > 0, got -1.0",), sets=("kl.target=-1",)),
    Case("zero-learning-rate", ("$.optim.learning_rate: must be > 0",), sets=("optim.learning_rate=0",)),
    Case("unknown-precision", ("$.run.mixed_precision: must be one of 'no', 'bf16', 'fp16'",), sets=('run.mixed_precision="fp8"',)),
    Case("unknown-kl-estimator", ("$.ppo.kl_estimator: must be one of",), sets=('ppo.kl_estimator="k4"',)),
    Case("top-p-above-one", ("$.generator.top_p: must be between 0.0 and 1.0",), sets=("generator.top_p=1.5",)),
    Case("gae-lambda-above-one", ("$.advantage.lam: must be between 0.0 and 1.0",), sets=("advantage.lam=2",)),
    Case("unknown-device", ("$.run.device: 'gpu' is not a device; use 'auto', 'cpu'",), sets=('run.device="gpu"',)),
    # batch arithmetic and impossible combinations
    Case("minibatch-not-a-divisor", ("$.ppo.minibatch_size: 5 does not divide batch_size=16; pick a divisor such as 4",), sets=("ppo.minibatch_size=5",)),
    Case("minibatch-above-batch", ("$.ppo.minibatch_size: 32 is larger than batch_size=16; use a divisor of 16",), sets=("ppo.minibatch_size=32",)),
    Case("groups-do-not-split", ("$.ppo.batch_size: 15 rollouts do not split into groups of samples_per_prompt=2",),
         sets=("ppo.batch_size=15", "ppo.minibatch_size=5", "ppo.samples_per_prompt=2")),
    Case("micro-batches-do-not-split", ("$.ppo.gradient_accumulation_steps", "pick a divisor such as 2"), sets=("ppo.gradient_accumulation_steps=3",)),
    Case("full-kl-in-the-loss", ('$.ppo.kl_estimator: "full"', 'use "k3"'), sets=('ppo.kl_penalty="loss"', 'ppo.kl_estimator="full"')),
    Case("warmup-on-constant", ("$.optim.warmup_steps", "constant_with_warmup"), sets=("optim.warmup_steps=10",)),
    # unknown components and missing tables
    Case("misspelled-kl-type", ("$.kl.type: unknown kl_controller 'adaptve'", "did you mean 'adaptive'?"), sets=('kl.type="adaptve"',)),
    Case("misspelled-reward-type", ("$.reward.type: unknown reward 'rogue'", "did you mean 'rouge'?"), sets=('reward.type="rogue"',)),
    Case("required-table-missing", ("$.reward: this table is required; add [reward] with type = one of",),
         text=BASE.replace('[reward]\ntype = "python"\nfunction = "reward.py:score"\n', "")),
    Case("required-key-missing", ("$.policy.model: required key is missing",), edit=edited('model = "model"\n', "")),
    Case("unknown-eval-metric", ("$.eval.metrics[0]: unknown reward 'nope'",), sets=('eval.metrics=["nope"]',)),
    Case("kl-type-switched-by-set", ("$.kl: the type changed from 'adaptive' to 'fixed', but target is a setting of 'adaptive'",
                                     """--set 'kl={type="fixed", beta=0.1}'"""), sets=("kl.type=fixed",)),
    # missing files and models
    Case("no-recipe-file", ("no recipe at", "check the path"), recipe="nope.toml"),
    Case("recipe-is-a-folder", ("cannot read model: Is a directory; give the path of a TOML recipe file",), recipe="model"),
    Case("model-dir-missing", ("$.policy.model: no directory './missing-model'", "give a local model directory"), sets=('policy.model="./missing-model"',)),
    Case("model-path-not-a-hub-name", ("$.policy.model: no directory 'models/a/b'",), sets=('policy.model="models/a/b"',)),
    Case("model-is-a-file", ("$.policy.model: cannot load a tokenizer from 'prompts.jsonl'", "give a transformers model folder"),
         sets=('policy.model="prompts.jsonl"',)),
    Case("tokenizer-dir-missing", ("$.policy.tokenizer: no directory './nope'",), sets=('policy.tokenizer="./nope"',)),
    Case("reward-model-missing", ("$.reward.model: no directory './no-rm'",), sets=('reward={type="reward-model", model="./no-rm"}',)),
    Case("critic-missing", ("$.value_head.model: no directory './no-critic'",), sets=('value_head={type="separate", model="./no-critic"}',)),
    # a model folder not written yet, or still being written (a warm start)
    Case("model-dir-empty", ("$.policy.model: 'unwritten' is an empty folder", "save_pretrained"),
         sets=('policy.model="unwritten"',)),
    Case("model-dir-without-config", ("$.policy.model: 'tokenizer_only' has no config.json", "being written there"),
         sets=('policy.model="tokenizer_only"',)),
    Case("tokenizer-dir-empty", ("$.policy.tokenizer: 'unwritten' is an empty folder",),
         sets=('policy.tokenizer="unwritten"',)),
    Case("reward-model-dir-empty", ("$.reward.model: './unwritten' is an empty folder",),
         sets=('reward={type="reward-model", model="./unwritten"}',)),
    Case("reward-model-without-config", ("$.reward.model: 'tokenizer_only' has no config.json",),
         sets=('reward={type="reward-model", model="tokenizer_only", tokenizer="model"}',)),
    Case("critic-dir-without-config", ("$.value_head.model: 'tokenizer_only' has no config.json",),
         sets=('value_head={type="separate", model="tokenizer_only"}',)),
    Case("agent-model-dir-empty", ("$.policy.model: 'unwritten' is an empty folder",), text=AGENT,
         sets=('policy.model="unwritten"',)),
    Case("agent-model-dir-missing", ("$.policy.model: no directory './missing-model'",), text=AGENT,
         sets=('policy.model="./missing-model"',)),
    # the python reward
    Case("reward-file-missing", ("$.reward.function: no file 'nope.py'",), sets=('reward.function="nope.py:score"',)),
    Case("reward-function-missing", ("$.reward.function: 'reward.py' has no function 'scores' (functions defined there: score)",),
         sets=('reward.function="reward.py:scores"',)),
    Case("reward-wrong-signature", ("$.reward.function: wrong_signature.py:score must accept keyword arguments prompts and responses",
                                    "add **columns"), sets=('reward.function="wrong_signature.py:score"',)),
    Case("reward-spec-without-colon", ("$.reward.function: expected 'module:function' or 'path/to/file.py:function'",),
         sets=('reward.function="score"',)),
    Case("reward-syntax-error", ("$.reward.function: 'broken_syntax.py' line 1", "fix the file"), sets=('reward.function="broken_syntax.py:score"',)),
    Case("reward-module-missing", ("$.reward.function: no module 'nosuchpackage' on the Python path",),
         sets=('reward.function="nosuchpackage.rewards:score"',)),
    # the output folder
    Case("output-dir-is-a-file", ("$.run.output_dir: 'prompts.jsonl' is a file, not a folder", "--set run.output_dir=PATH"),
         sets=('run.output_dir="prompts.jsonl"',)),
    Case("output-dir-under-a-file", ("$.run.output_dir: 'prompts.jsonl/run' cannot be made: 'prompts.jsonl' on its path is a file",),
         sets=('run.output_dir="prompts.jsonl/run"',)),
    Case("output-dir-holds-a-run", ("earlier already holds a run (metrics.jsonl)", "--resume auto", "--overwrite"),
         sets=('run.output_dir="earlier"',), commands=("run",)),
    Case("resume-not-a-checkpoint", ("--resume model: not a complete checkpoint (no meta.json)",), commands=("run",), extra=("--resume", "model")),
    Case("resume-auto-without-checkpoints", ("--resume auto: no complete checkpoint under out/checkpoints",), commands=("run",),
         extra=("--resume", "auto")),
    Case("resume-a-damaged-checkpoint", ("--resume damaged/checkpoints/iter_000001: the checkpoint is damaged: no manifest.json",
                                         "start over with --overwrite"), commands=("run",),
         extra=("--resume", "damaged/checkpoints/iter_000001")),
    Case("resume-auto-only-damaged", ("--resume auto: no usable checkpoint under damaged/checkpoints",), commands=("run",),
         sets=('run.output_dir="damaged"',), extra=("--resume", "auto")),
    Case("allow-changes-without-resume", ("--allow-changes: only with --resume",), commands=("run",), extra=("--allow-changes",)),
    Case("output-dir-held-by-another-run", ("held is in use by another run (process", "lock file held/rlkit.lock"),
         sets=('run.output_dir="held"',), commands=("run",)),
    # health checks
    Case("health-stop-on-unknown-check", ("$.health.stop_on: unknown check(s) 'zero_grad'; the checks are 'all',",),
         sets=('health.stop_on=["zero_grad"]',)),
    Case("health-share-above-one", ("$.health.zero_variance_groups: must be between 0.0 and 1.0, got 1.5",),
         sets=("health.zero_variance_groups=1.5",)),
    # prompt data
    Case("data-file-missing", ("$.data.path: no file 'nope.jsonl'",), sets=('data.path="nope.jsonl"',)),
    Case("data-file-empty", ("$.data.path: 'empty.jsonl' holds no records",), sets=('data.path="empty.jsonl"',)),
    Case("data-lacks-the-field", ("prompts.jsonl:1: has no field 'text'", "set data.prompt_field"), sets=('data.prompt_field="text"',)),
    Case("data-line-not-json", ("not_json.jsonl:2: not valid JSON",), sets=('data.path="not_json.jsonl"',)),
    Case("data-line-not-an-object", ("a_list.jsonl:1: expected a JSON object, got list",), sets=('data.path="a_list.jsonl"',)),
    Case("data-not-utf8", ("$.data.path: 'latin1.jsonl' is not UTF-8 text",), sets=('data.path="latin1.jsonl"',)),
    Case("dataset-files-missing", ("$.data.data_files: no file matches 'nope/*.json'",),
         sets=('data={type="hf-dataset", path="json", data_files=["nope/*.json"]}',)),
    # --set itself
    Case("set-without-equals", ("--set run.steps: expected KEY=VALUE",), sets=("run.steps",)),
    Case("set-unknown-key", ("$.run.stpes: unknown key; did you mean 'steps'?",), sets=("run.stpes=3",)),
    Case("set-below-a-value", ("--set ppo.batch_size.x=1: 'batch_size' is not a table",), sets=("ppo.batch_size.x=1",)),
    Case("set-unparsable-value", ("$.run.seed: expected an integer, got '[1' (str)",), sets=("run.seed=[1",)),
    # the tracker
    Case("tracker-unknown-scheme", ("$.tracker.uri: MLflow cannot store to 'bogus://x'", 'tracker.type = "none"'), sets=('tracker.uri="bogus://x"',)),
    Case("tracker-store-folder-missing", ("$.tracker.uri: 'sqlite:///nowhere/m.db' puts the store in",), sets=('tracker.uri="sqlite:///nowhere/m.db"',)),
    Case("tracker-password-in-recipe", ("$.tracker.uri: holds a password", "MLFLOW_TRACKING_PASSWORD"),
         sets=('tracker.uri="http://ann:hunter2@localhost:5000"',)),
]


def write_sandbox(root: Path, tiny_model: Path) -> None:
    """A working directory with everything a recipe may point at, good and bad."""
    shutil.copytree(tiny_model, root / "model")
    (root / "unwritten").mkdir()
    shutil.copytree(tiny_model, root / "tokenizer_only", ignore=shutil.ignore_patterns("config.json", "*.safetensors"))
    (root / "agent.py").write_text("def play(record, client):\n    return 1.0\n")
    (root / "reward.py").write_text(REWARD)
    (root / "wrong_signature.py").write_text("def score(texts):\n    return [0.0 for _ in texts]\n")
    (root / "broken_syntax.py").write_text("def score(prompts, responses:\n    return []\n")
    (root / "prompts.jsonl").write_text("".join(f'{{"prompt": "abc{i}"}}\n' for i in range(32)))
    (root / "empty.jsonl").write_text("\n")
    (root / "not_json.jsonl").write_text('{"prompt": "a"}\n{prompt: b}\n')
    (root / "a_list.jsonl").write_text('["a", "b"]\n')
    (root / "latin1.jsonl").write_bytes('{"prompt": "caf\u00e9"}\n'.encode("latin-1"))
    (root / "earlier").mkdir()
    (root / "earlier" / "metrics.jsonl").write_text('{"iteration": 1}\n')
    damaged = root / "damaged" / "checkpoints" / "iter_000001"  # a checkpoint without its manifest
    damaged.mkdir(parents=True)
    (damaged / "meta.json").write_text('{"iteration": 1}')
    (root / "held").mkdir()  # an output folder this test process holds, as a live run would
    (root / "held" / "rlkit.lock").write_text(json.dumps(attrs.asdict(Holder.this_process())))
    for folder in ("store", "home", "cache", "hf"):
        (root / folder).mkdir()


def snapshot(root: Path) -> dict[str, tuple]:
    """Every folder and file under root, with each file's size, change time and content hash."""
    found = {}
    for folder, folders, files in os.walk(root):
        for name in folders:
            found[os.path.relpath(os.path.join(folder, name), root)] = ("folder",)
        for name in files:
            path = os.path.join(folder, name)
            info = os.stat(path)
            found[os.path.relpath(path, root)] = (info.st_size, info.st_mtime_ns, hashlib.sha1(Path(path).read_bytes()).hexdigest())
    return found


def sandbox_env(root: Path) -> dict[str, str]:
    return {"HOME": str(root / "home"), "XDG_CACHE_HOME": str(root / "cache"), "HF_HOME": str(root / "hf"),
            "HF_HUB_OFFLINE": "1", "RLKIT_PLUGINS": "none", "MLFLOW_TRACKING_URI": "sqlite:///store/env.db"}


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory, tiny_model) -> Path:
    root = tmp_path_factory.mktemp("bad-input")
    write_sandbox(root, tiny_model)
    return root


@pytest.fixture
def in_sandbox(sandbox, monkeypatch) -> Path:
    for name, value in sandbox_env(sandbox).items():
        monkeypatch.setenv(name, value)
    monkeypatch.chdir(sandbox)
    return sandbox


def recipe_text(case: Case) -> str:
    if case.text is not None:
        return case.text
    if case.edit is not None:
        return BASE.replace(*case.edit, 1)
    return BASE


def arguments(case: Case, command: str) -> list[str]:
    sets = [item for value in case.sets for item in ("--set", value)]
    return [command, case.recipe, *sets, *(case.extra if command == "run" else ()), *(("--quiet",) if command == "run" else ())]


def assert_refused(case: Case, code: int, out: str, err: str) -> None:
    assert code == 2, f"exit {code}\n{err}"
    assert "Traceback" not in err and "Traceback" not in out, err
    for words in case.expect:
        assert words in err, f"{words!r} not in:\n{err}"
    assert out == "", out


def test_the_corpus_is_large_and_named_uniquely():
    assert len(CASES) >= 40
    assert len({case.name for case in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_bad_input_is_refused_with_a_located_fix_and_nothing_written(case, in_sandbox, capsys):
    (in_sandbox / "recipe.toml").write_text(recipe_text(case))
    before = snapshot(in_sandbox)
    for command in case.commands:
        code = main(arguments(case, command))
        captured = capsys.readouterr()
        assert_refused(case, code, captured.out, captured.err)
        assert snapshot(in_sandbox) == before, f"rlkit {command} changed the disk"


SUBPROCESS_SAMPLE = ["model-path-not-a-hub-name", "reward-wrong-signature", "output-dir-is-a-file", "kl-type-switched-by-set"]


@pytest.mark.slow
@pytest.mark.parametrize("name", SUBPROCESS_SAMPLE)
def test_the_real_command_refuses_a_sample(name, sandbox):
    """The same cases through a fresh interpreter, as a shell runs `rlkit`: `rlkit run` only, which
    must refuse before it builds or writes anything (rlkit check's checks run first)."""
    case = next(case for case in CASES if case.name == name)
    recipe = sandbox / f"sample-{name}.toml"
    recipe.write_text(recipe_text(case))
    case = attrs.evolve(case, recipe=recipe.name)
    before = snapshot(sandbox)
    env = {**os.environ, **sandbox_env(sandbox)}
    result = subprocess.run([sys.executable, "-m", "rlkit_core.runtime.cli", *arguments(case, "run")], capture_output=True, text=True,
                            cwd=sandbox, env=env, timeout=300)
    assert_refused(case, result.returncode, result.stdout, result.stderr)
    assert snapshot(sandbox) == before


@pytest.mark.slow
@pytest.mark.parametrize("command", ["check", "run"])
@pytest.mark.parametrize("name", ["agent-model-dir-empty", "agent-model-dir-missing"])
def test_the_real_command_names_a_model_folder_not_written_yet_in_one_line(name, command, sandbox):
    """A model folder that a warm start has not written yet, or is still writing: one located line,
    as for any bad input, from both commands (`rlkit check` read the policy's tokenizer and config
    for the plan before it checked them)."""
    case = next(case for case in CASES if case.name == name)
    recipe = sandbox / f"folder-{name}.toml"
    recipe.write_text(recipe_text(case))
    env = {**os.environ, **sandbox_env(sandbox)}
    argv = arguments(attrs.evolve(case, recipe=recipe.name), command)
    result = subprocess.run([sys.executable, "-m", "rlkit_core.runtime.cli", *argv], capture_output=True, text=True,
                            cwd=sandbox, env=env, timeout=300)
    assert_refused(case, result.returncode, result.stdout, result.stderr)
    heading, *located = result.stderr.splitlines()
    assert heading.endswith("1 problem in the recipe:") and len(located) == 1, result.stderr


def test_a_folder_with_a_models_config_or_a_lora_adapters_is_a_model_folder(tmp_path):
    """transformers loads a LoRA adapter's folder as its base model with the adapter applied."""
    from rlkit_core.hf import model_folder_problem

    for config in ("config.json", "adapter_config.json"):
        folder = tmp_path / config
        folder.mkdir()
        (folder / config).write_text("{}")
        assert model_folder_problem(str(folder), "$.policy.model") is None
    (tmp_path / "weights_only").mkdir()
    (tmp_path / "weights_only" / "model.safetensors").write_bytes(b"")
    assert "has no config.json" in (model_folder_problem(str(tmp_path / "weights_only"), "$.policy.model") or "")


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write anywhere: a folder without write permission stays writable")
def test_an_output_dir_without_write_permission_is_refused(in_sandbox, capsys):
    locked = in_sandbox / "locked"
    locked.mkdir(exist_ok=True)
    locked.chmod(0o500)
    try:
        (in_sandbox / "recipe.toml").write_text(BASE)
        before = snapshot(in_sandbox)
        assert main(["run", "recipe.toml", "--set", 'run.output_dir="locked/run"', "--quiet"]) == 2
        assert "$.run.output_dir: 'locked' is not writable by this user" in capsys.readouterr().err
        assert snapshot(in_sandbox) == before
    finally:
        locked.chmod(0o700)
