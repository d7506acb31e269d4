"""What rlkit runs and what it records: no code from pickles, no code from a recipe that `rlkit
check` reads, no model code unless the recipe allows it, and no secret from the environment in
the MLflow store or the run's folder."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from rlkit_plugins.hf_policy import HFPolicyConfig
from safetensors.torch import load_file

from rlkit_core.runtime.checkpoint import write_manifest
from rlkit_core.runtime.cli import main
from rlkit_core.testing import recipe_toml

SECRETS = {
    "MLFLOW_TRACKING_USERNAME": "fake-user-3f9a1c",
    "MLFLOW_TRACKING_PASSWORD": "fake-password-8d2e7b",
    "MLFLOW_TRACKING_TOKEN": "fake-mlflow-token-51c0aa",
    "HF_TOKEN": "hf_fakeToken0123456789abcdef",
    "HUGGING_FACE_HUB_TOKEN": "hf_fakeHubToken9876543210",
    "AWS_SECRET_ACCESS_KEY": "fake-aws-secret-a1b2c3d4",
}


class WritesAFile:
    """Unpickling this would create `path`: the proof that a pickle ran code."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return open, (self.path, "w")


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, tiny_model, prompt_file, reward_file):
    """A real `rlkit run` (one iteration, MLflow in a local store) with fake secrets in its
    environment; returns the folder holding the store, the artifacts and the run's output."""
    root = tmp_path_factory.mktemp("secrets")
    document = {
        "run": {"steps": 1, "seed": 0, "output_dir": str(root / "run"), "threads": 1},
        "ppo": {"batch_size": 8, "minibatch_size": 8, "epochs": 1},
        "policy": {"type": "hf", "model": str(tiny_model)},
        "generator": {"max_new_tokens": 4},
        "reward": {"type": "python", "function": f"{reward_file}:lowercase_share"},
        "data": {"type": "jsonl", "path": str(prompt_file)},
        "tracker": {"type": "mlflow", "uri": "sqlite:///mlflow.db", "log_model": True},
    }
    (root / "recipe.toml").write_text(recipe_toml(document))
    env = {**os.environ, **SECRETS, "RLKIT_PLUGINS": "none"}
    result = subprocess.run([sys.executable, "-m", "rlkit_core.runtime.cli", "run", "recipe.toml", "--quiet"], cwd=root, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (root / "mlflow.db").is_file() and (root / "run" / "final_model").is_dir()
    return root, document, result.stdout + result.stderr


@pytest.mark.slow
def test_secrets_from_the_environment_are_nowhere_in_the_store_or_the_run(finished_run):
    root, _, console = finished_run
    files = [path for path in root.rglob("*") if path.is_file()]
    assert any(path.name == "recipe.toml" for path in files) and any(path.parts[-2:] == ("run", "metrics.jsonl") for path in files)
    assert any("mlruns" in path.parts or "mlartifacts" in path.parts for path in files), "the artifacts were not searched"
    for name, secret in SECRETS.items():
        assert secret not in console, name
        for path in files:
            assert secret.encode() not in path.read_bytes(), f"{name} found in {path}"


@pytest.mark.slow
def test_a_checkpoint_that_carries_code_is_refused_and_runs_none(finished_run, tmp_path, monkeypatch, capsys):
    root, document, _ = finished_run
    checkpoint = tmp_path / "iter_000001"
    shutil.copytree(root / "run" / "checkpoints" / "iter_000001", checkpoint)
    marker = tmp_path / "code-ran"
    state = torch.load(checkpoint / "trainer.pt", weights_only=True)  # rlkit's own file loads as plain values
    state["kl"]["extra"] = WritesAFile(marker)
    torch.save(state, checkpoint / "trainer.pt")
    document = {**document, "run": {**document["run"], "output_dir": str(tmp_path / "run")}, "tracker": {"type": "none"}}
    (tmp_path / "recipe.toml").write_text(recipe_toml(document))
    monkeypatch.setenv("RLKIT_PLUGINS", "none")

    assert main(["run", str(tmp_path / "recipe.toml"), "--resume", str(checkpoint), "--quiet"]) == 2
    assert "the checkpoint is damaged: trainer.pt is " in capsys.readouterr().err  # its size no longer matches
    write_manifest(checkpoint)  # whoever crafted the file can craft a manifest that matches it
    assert main(["run", str(tmp_path / "recipe.toml"), "--resume", str(checkpoint), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert f"--resume {checkpoint}: trainer.pt holds more than tensors and plain values, which rlkit never loads" in err
    assert "Traceback" not in err and not marker.exists()


def test_a_model_whose_pickled_weights_carry_code_is_refused(tiny_model, tmp_path, recipe_document, write_recipe, monkeypatch, capsys):
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    marker = tmp_path / "code-ran"
    weights = load_file(model / "model.safetensors")
    (model / "model.safetensors").unlink()
    torch.save({**weights, "extra": WritesAFile(marker)}, model / "pytorch_model.bin")  # the old pickled format
    recipe_document["policy"]["model"] = str(model)
    monkeypatch.setenv("RLKIT_PLUGINS", "none")

    assert main(["run", write_recipe(recipe_document), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert f"$.policy.model: {str(model)!r} has a pickled weights file that holds more than tensors" in err
    assert "Traceback" not in err and not marker.exists()
    assert not Path(recipe_document["run"]["output_dir"]).exists()


def test_rlkit_check_lists_the_code_a_run_imports_and_runs_none_of_it(recipe_document, write_recipe, tmp_path, monkeypatch, capsys):
    marker = tmp_path / "imported"
    reward = tmp_path / "reward_with_side_effect.py"
    reward.write_text(f"open({str(marker)!r}, 'w').close()\n\ndef score(prompts, responses):\n    return [0.0] * len(responses)\n")
    recipe_document["reward"]["function"] = f"{reward}:score"
    monkeypatch.setenv("RLKIT_PLUGINS", "none")

    assert main(["check", write_recipe(recipe_document)]) == 0
    plan = capsys.readouterr().out
    assert "code this recipe runs (besides rlkit's own):\n  no third-party plugins loaded\n" in plan
    assert f"[reward] imports the file {str(reward)!r} for its function 'score' ($.reward.function)" in plan
    assert not marker.exists()  # check read the function's signature from the source; it ran nothing


def test_trust_remote_code_is_off_unless_the_recipe_turns_it_on_and_check_warns(recipe_document, write_recipe, monkeypatch, capsys):
    assert HFPolicyConfig(model="m").trust_remote_code is False
    monkeypatch.setenv("RLKIT_PLUGINS", "none")
    assert main(["check", write_recipe(recipe_document)]) == 0
    assert "trust_remote_code = true" not in capsys.readouterr().out
    assert main(["check", write_recipe(recipe_document), "--set", "policy.trust_remote_code=true"]) == 0
    warnings = capsys.readouterr().out.split("warnings:\n")[1]
    assert warnings.startswith(f"  $.policy.trust_remote_code = true: {recipe_document['policy']['model']!r} may run Python code "
                               "that ships with the model")


def test_a_tracking_uri_with_a_password_is_refused(recipe_document, write_recipe, monkeypatch, capsys):
    """The recipe is logged with the run, so credentials go in the environment."""
    monkeypatch.setenv("RLKIT_PLUGINS", "none")
    recipe_document["tracker"] = {"type": "mlflow", "uri": "https://ann:hunter2@mlflow.example.com"}
    assert main(["run", write_recipe(recipe_document)]) == 2
    err = capsys.readouterr().err
    assert "$.tracker.uri: holds a password" in err and "MLFLOW_TRACKING_PASSWORD" in err
    assert not Path(recipe_document["run"]["output_dir"]).exists()
