"""The run's state between iterations, and the run's outputs that touch no disk until written."""

from rlkit_core.recipe.document import parse_recipe
from rlkit_core.runtime import checkpoint
from rlkit_core.runtime.metrics_log import MetricsLog
from rlkit_core.runtime.run import claim_output_dir
from rlkit_core.runtime.state import RunState
from rlkit_core.runtime.trainer import Trainer


def test_both_counts_in_a_row_restart_after_a_trained_iteration():
    state = RunState(iteration=3, nonfinite_in_a_row=1, skips_in_a_row=0, skipped_batches=2)
    failed = state.reward_failed()
    assert failed == RunState(iteration=3, nonfinite_in_a_row=1, skips_in_a_row=1, skipped_batches=2)  # not yet skipped
    skipped = failed.skipped()
    assert skipped == RunState(iteration=4, nonfinite_in_a_row=1, skips_in_a_row=1, skipped_batches=3)
    assert skipped.reward_failed().skipped() == RunState(iteration=5, nonfinite_in_a_row=1, skips_in_a_row=2, skipped_batches=4)
    assert skipped.trained(nonfinite_in_a_row=0) == RunState(iteration=5, nonfinite_in_a_row=0, skips_in_a_row=0, skipped_batches=3)


def test_checking_an_output_folder_and_opening_its_log_create_nothing(tmp_path):
    folder = tmp_path / "run"
    assert claim_output_dir(str(folder), None, overwrite=False) == ([], None, "")
    log = MetricsLog(folder / "metrics.jsonl")
    assert log.read() == [] and not folder.exists()
    log.append(1, {"score/mean": 0.5})
    assert log.read() == [{"iteration": 1, "score/mean": 0.5}]


def test_a_checkpoint_restores_the_whole_run_state(recipe_document, builtin_registry):
    recipe = parse_recipe(recipe_document, builtin_registry)
    trainer = Trainer(recipe)
    state = RunState(iteration=2, nonfinite_in_a_row=1, skips_in_a_row=1, skipped_batches=1)
    path = checkpoint.save_checkpoint(trainer.engine, trainer.components, recipe, state, None, keep=1)
    resumed = Trainer(recipe)
    assert resumed.resume(path)["iteration"] == 2 and resumed.state == state
