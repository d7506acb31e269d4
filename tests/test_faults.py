"""Faults at run time, met as a user meets them: real `rlkit run` processes with a reward that
misbehaves, non-finite steps, signals, SIGKILL inside a checkpoint write, and a full disk."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlkit_core.runtime import checkpoint

pytestmark = pytest.mark.slow  # real rlkit runs in subprocesses, stopped, killed and resumed

COMMAND = [sys.executable, "-m", "rlkit_core.runtime.cli", "run", "--quiet"]
ENV = {**os.environ, "RLKIT_PLUGINS": "none"}

# A reward that scores as the suite's usual one, except on the calls that BAD names while the
# marker file exists (one call per iteration, and one for the end-of-run report's samples: nothing
# else calls the reward without an [eval] table).
REWARD = '''
import os

calls = 0


def fail(good):
    raise KeyError("reference")


BAD = {bad}


def score(prompts, responses, letter):
    global calls
    calls += 1
    good = [sum(c.islower() for c in r) / 8 for r in responses]
    if calls in BAD and os.path.exists({marker!r}):
        return BAD[calls](good)
    return good
'''

# How a reward can break its contract, and what the run says about it.
MISBEHAVIOURS = {
    "one too few": ("lambda good: good[:-1]", "returned 15 scores for 16 responses"),
    "one too many": ("lambda good: good + [0.0]", "returned 17 scores for 16 responses"),
    "not numbers": ('lambda good: ["high"] * len(good)', "returned ['high', 'high',"),
    "nan": ('lambda good: good[:-1] + [float("nan")]', "returned a score that is not a finite float32 number (nan) for response 15"),
    "inf": ('lambda good: [float("-inf")] + good[1:]', "returned a score that is not a finite float32 number (-inf) for response 0"),
    "raises": ("fail", "raised KeyError: 'reference'"),
}
HUGE = "lambda good: [3e38] * len(good)"  # finite scores whose whitened advantages are not


def metrics_of(output_dir):
    return [json.loads(line) for line in (Path(output_dir) / "metrics.jsonl").read_text().splitlines()]


def without_timing(rows):
    return [{k: v for k, v in row.items() if not k.startswith("time/")} for row in rows]


def run(recipe, *args, env=ENV):
    return subprocess.run(COMMAND + [recipe, *args], env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture
def faulty(recipe_document, write_recipe, tmp_path):
    """write({call: misbehaviour}, **run settings) -> (recipe path, output_dir, marker file)."""
    def write(bad=None, name="faulty", **run_settings):
        marker = tmp_path / f"{name}.broken"
        marker.touch()
        reward = tmp_path / f"{name}_reward.py"
        table = "{" + ", ".join(f"{call}: {code}" for call, code in (bad or {}).items()) + "}"
        reward.write_text(REWARD.format(bad=table, marker=str(marker)))
        output_dir = tmp_path / name
        document = dict(recipe_document, run={**recipe_document["run"], "steps": 3, "output_dir": str(output_dir), **run_settings},
                        reward={"type": "python", "function": f"{reward}:score"})
        return write_recipe(document, f"{name}.toml"), output_dir, marker

    return write


def test_a_reward_that_raises_stops_the_run_naming_it_what_was_saved_and_the_users_frames(faulty):
    recipe, output_dir, _ = faulty({2: "fail"})
    result = run(recipe)
    assert result.returncode == 1, result.stderr
    lines = result.stderr.splitlines()
    assert lines[0].startswith('rlkit run: reward "python" (function = "') and "failed at iteration 2: " in lines[0]
    assert "raised KeyError: 'reference'" in lines[0]
    assert f"saved the state after iteration 1 as {output_dir / 'checkpoints' / 'iter_000001'}" in lines[0]
    assert f"and the batch as {output_dir / 'bad_batches' / 'iter_000002.json'}" in lines[0]
    assert "Traceback" not in result.stderr and "rlkit_core" not in result.stderr and "rlkit_plugins" not in result.stderr
    frames = [line for line in lines[1:] if line.startswith("  File ")]
    reward_file = Path(recipe).parent / "faulty_reward.py"
    assert frames == [f'  File "{reward_file}", line 19, in score', f'  File "{reward_file}", line 8, in fail']
    assert '    raise KeyError("reference")' in lines
    saved = json.loads((output_dir / "bad_batches" / "iter_000002.json").read_text())
    assert saved["iteration"] == 2 and len(saved["rows"]) == 16 and saved["problem"].startswith("raised KeyError")


def test_every_way_of_breaking_the_reward_contract_is_caught_where_scores_enter_the_trainer(faulty):
    # one misbehaviour per iteration, 2 to 7, each skipped (stopping takes the same path, tested above)
    bad = {call: code for call, (code, _) in enumerate(MISBEHAVIOURS.values(), start=2)}
    recipe, output_dir, _ = faulty(bad, steps=8, on_bad_reward="skip")
    result = run(recipe)
    assert result.returncode == 0, result.stderr
    warnings = [line for line in result.stderr.splitlines() if line.startswith("rlkit run: warning: reward")]
    assert len(warnings) == len(MISBEHAVIOURS)
    for iteration, (warning, (_, problem)) in enumerate(zip(warnings, MISBEHAVIOURS.values()), start=2):
        assert f"failed at iteration {iteration}: {problem}" in warning and "skipped the batch" in warning
        assert (output_dir / "bad_batches" / f"iter_{iteration:06d}.json").is_file()
    rows = metrics_of(output_dir)
    assert [row["iteration"] for row in rows] == list(range(1, 9))
    assert [row.get("run/skipped_batches") for row in rows] == [None, 1, 2, 3, 4, 5, 6, 6]
    assert ["score/mean" in row for row in rows] == [True] + [False] * 6 + [True]


def test_a_padless_policys_bad_batch_is_skipped_and_saved_as_text(faulty, recipe_document, tmp_path):
    """GPT-2-style: no PAD of its own (rlkit adds one) and responses of varied lengths; the bad batch
    is skipped, saved as the prompts and responses the reward saw, and the run goes on."""
    from rlkit_core.testing.offline_models import write_tiny_model

    recipe_document["policy"]["model"] = str(write_tiny_model(tmp_path / "gpt2-style", "gpt2"))
    recipe, output_dir, _ = faulty({2: MISBEHAVIOURS["nan"][0]}, on_bad_reward="skip")
    result = run(recipe)
    assert result.returncode == 0, result.stderr
    assert MISBEHAVIOURS["nan"][1] in result.stderr
    saved = json.loads((output_dir / "bad_batches" / "iter_000002.json").read_text())
    assert len(saved["rows"]) == 16 and all(set(row) == {"prompt", "response"} and isinstance(row["response"], str)
                                            for row in saved["rows"])
    assert [row.get("run/skipped_batches") for row in metrics_of(output_dir)] == [None, 1, 1]


def test_rlkit_debug_shows_the_whole_traceback(faulty):
    recipe, _, _ = faulty({2: "fail"})
    result = run(recipe, env={**ENV, "RLKIT_DEBUG": "1"})
    assert result.returncode == 1
    assert "Traceback" in result.stderr and "rlkit_core" in result.stderr


def test_a_run_stopped_by_its_reward_resumes_as_if_never_stopped(faulty):
    straight, straight_dir, marker = faulty(name="straight", steps=4)
    marker.unlink()
    assert run(straight).returncode == 0

    recipe, output_dir, marker = faulty({3: "fail"}, name="stopped", steps=4)
    assert run(recipe).returncode == 1
    assert checkpoint.resolve("auto", output_dir).name == "iter_000002"
    marker.unlink()  # the reward is fixed
    result = run(recipe, "--resume", "auto")
    assert result.returncode == 0, result.stderr
    assert without_timing(metrics_of(output_dir)) == without_timing(metrics_of(straight_dir))


def test_skipping_stops_after_max_skips_in_a_row(faulty):
    recipe, output_dir, _ = faulty({2: "fail", 3: "fail"}, on_bad_reward="skip", max_skips_in_a_row=2, steps=4)
    result = run(recipe)
    assert result.returncode == 1
    assert "failed at iteration 3 (2 batches in a row; run.max_skips_in_a_row)" in result.stderr
    assert "saved the state after iteration 2" in result.stderr  # the skipped iteration 2 changed nothing


def test_non_finite_steps_are_skipped_and_counted(faulty):
    # Scores of 3e38 are finite, but the advantages whitened from them are not: every step of
    # iteration 2 has a non-finite loss.
    recipe, output_dir, _ = faulty({2: HUGE})
    result = run(recipe)
    assert result.returncode == 0, result.stderr
    rows = metrics_of(output_dir)
    assert [row["train/nonfinite"] for row in rows] == [0.0, 1.0, 0.0]
    assert rows[2]["train/loss"] is not None  # the weights were left as they were: training goes on


def test_too_many_non_finite_steps_in_a_row_stop_with_the_last_checkpoint_intact(faulty):
    recipe, output_dir, _ = faulty({2: HUGE}, checkpoint_every=1, max_skips_in_a_row=3)
    result = run(recipe)
    assert result.returncode == 1
    kept = output_dir / "checkpoints" / "iter_000001"
    assert result.stderr.startswith("rlkit run: 3 optimiser steps in a row had a non-finite loss or gradient, in iteration 2")
    assert f"the latest checkpoint, {kept}, is intact" in result.stderr
    assert [c.name for c in checkpoint.complete_checkpoints(output_dir)] == ["iter_000001"]


def test_a_run_that_failed_in_its_first_iteration_can_simply_be_rerun(faulty):
    recipe, output_dir, marker = faulty({1: "fail"})
    failed = run(recipe)
    assert failed.returncode == 1 and "nothing was trained yet, so no checkpoint" in failed.stderr
    assert (output_dir / "samples_before.json").exists() and not checkpoint.complete_checkpoints(output_dir)
    marker.unlink()
    again = run(recipe)
    assert again.returncode == 0, again.stderr
    assert "holds only what a run left before its first iteration (samples_before.json, bad_batches); starting over" in again.stderr
    assert [row["iteration"] for row in metrics_of(output_dir)] == [1, 2, 3]
    assert not (output_dir / "bad_batches").exists()  # the earlier run's leftovers were cleared

    marker.touch()
    assert run(recipe, "--overwrite").returncode == 1
    refused = run(recipe, "--resume", "auto")  # nothing to resume: say so rather than start over unasked
    assert refused.returncode == 2 and "--resume auto: no complete checkpoint under" in refused.stderr
    assert "start without --resume" in refused.stderr


def test_a_folder_with_trained_iterations_but_no_checkpoint_needs_overwrite(faulty):
    recipe, output_dir, _ = faulty({2: HUGE}, max_skips_in_a_row=3)  # stops in iteration 2; checkpoints only at the end
    assert run(recipe).returncode == 1
    assert not checkpoint.complete_checkpoints(output_dir)
    refused = run(recipe)
    assert refused.returncode == 2
    assert "it left no checkpoint to continue with --resume auto; start over with --overwrite" in refused.stderr


def wait_for(process, condition, what, seconds=240):
    deadline = time.monotonic() + seconds
    while not condition():
        assert process.poll() is None, f"the run ended before {what}"
        assert time.monotonic() < deadline, f"no {what} within {seconds} s"
        time.sleep(0.02)


def started(recipe, *args, env=ENV, sigint=signal.SIG_DFL):
    """A run as from a terminal: Ctrl-C at its default even when the tests themselves run as a
    shell's background job, whose children start with SIGINT ignored."""
    return subprocess.Popen(COMMAND + [recipe, *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, sigint))


def test_sigterm_and_ctrl_c_checkpoint_the_iteration_and_exit_with_a_clear_line(faulty):
    straight, straight_dir, _ = faulty(name="straight", steps=5)
    assert run(straight).returncode == 0

    for name, number, code in [("term", signal.SIGTERM, 143), ("ctrl_c", signal.SIGINT, 130)]:
        recipe, output_dir, _ = faulty(name=name, steps=5)
        process = started(recipe)
        wait_for(process, lambda folder=output_dir: (folder / "metrics.jsonl").exists(), "first iteration")
        process.send_signal(number)
        _, stderr = process.communicate(timeout=120)
        assert process.returncode == code, stderr
        stopped_after = checkpoint.resolve("auto", output_dir)
        iteration = int(stopped_after.name[len("iter_"):])
        assert 1 <= iteration < 5
        assert f"rlkit run: stopped by {number.name} after iteration {iteration}; saved {stopped_after}; continue with --resume auto" in stderr
        assert "Traceback" not in stderr
        resumed = run(recipe, "--resume", "auto")
        assert resumed.returncode == 0, resumed.stderr
        assert without_timing(metrics_of(output_dir)) == without_timing(metrics_of(straight_dir))


def test_a_second_ctrl_c_stops_at_once(faulty):
    recipe, output_dir, _ = faulty({2: "lambda good: __import__('time').sleep(60) or good"})  # a slow iteration 2
    process = started(recipe)
    wait_for(process, lambda folder=output_dir: (folder / "metrics.jsonl").exists(), "first iteration")
    process.send_signal(signal.SIGINT)
    for line in process.stderr:  # the first Ctrl-C is acknowledged before the second is sent
        if "Ctrl-C again stops at once" in line:
            break
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=30)
    assert process.returncode == 130
    assert stderr.strip() == "rlkit: interrupted"
    assert not checkpoint.complete_checkpoints(output_dir)


def test_a_run_started_with_ctrl_c_ignored_keeps_ignoring_it(faulty):
    """As under nohup or in a background job: SIGINT stays ignored and the run goes to its end."""
    recipe, output_dir, _ = faulty({2: "lambda good: __import__('time').sleep(3) or good"}, steps=3)  # still running at the signal
    process = started(recipe, sigint=signal.SIG_IGN)
    wait_for(process, lambda folder=output_dir: (folder / "metrics.jsonl").exists(), "first iteration")
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 0, stderr
    assert [row["iteration"] for row in metrics_of(output_dir)] == [1, 2, 3]


def test_sigkill_before_the_first_checkpoint_and_inside_a_checkpoint_write_then_resume_auto(faulty):
    recipe, output_dir, _ = faulty(steps=4, checkpoint_every=1)
    process = started(recipe)
    wait_for(process, lambda: (output_dir / "samples_before.json").exists(), "samples before training")
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=30)
    assert not checkpoint.complete_checkpoints(output_dir)

    # Run again (nothing to resume), and killed halfway through writing iteration 2's checkpoint (test-only hook).
    killed = run(recipe, env={**ENV, "RLKIT_TEST_CHECKPOINT_FAULT": "kill@2"})
    assert killed.returncode == -signal.SIGKILL
    assert [c.name for c in checkpoint.complete_checkpoints(output_dir)] == ["iter_000001"]
    half_written = list((output_dir / "checkpoints").glob(".iter_000002.tmp-*"))
    assert half_written and (half_written[0] / "policy.safetensors").exists() and not (half_written[0] / "meta.json").exists()

    resumed = run(recipe, "--resume", "auto")
    assert resumed.returncode == 0, resumed.stderr
    assert [row["iteration"] for row in metrics_of(output_dir)] == [1, 2, 3, 4]
    assert [c.name for c in checkpoint.complete_checkpoints(output_dir)] == ["iter_000003", "iter_000004"]


def test_a_full_disk_while_checkpointing_keeps_the_previous_checkpoint_and_exits_1(faulty):
    recipe, output_dir, _ = faulty(steps=3, checkpoint_every=1)
    # Test-only hook: the write of iteration 2's checkpoint fails with ENOSPC after its first file.
    result = run(recipe, env={**ENV, "RLKIT_TEST_CHECKPOINT_FAULT": "enospc@2"})
    assert result.returncode == 1
    kept = output_dir / "checkpoints" / "iter_000001"
    assert result.stderr.splitlines() == [
        f"rlkit run: writing the checkpoint {output_dir / 'checkpoints' / 'iter_000002'} failed: No space left on device; "
        f"the latest complete one, {kept}, is intact; free some space (or set run.output_dir elsewhere) and continue with --resume auto"]
    assert [p.name for p in (output_dir / "checkpoints").iterdir()] == ["iter_000001"]  # nothing half-written left
    resumed = run(recipe, "--resume", "auto")
    assert resumed.returncode == 0, resumed.stderr
    assert [row["iteration"] for row in metrics_of(output_dir)] == [1, 2, 3]


def test_empty_prompts_are_skipped_and_prompts_too_long_for_the_context_are_cut(recipe_document, write_recipe, prompt_file, tmp_path):
    # The tiny policy has 128 positions; with 8 response tokens a prompt may have 120.
    data = tmp_path / "ragged.jsonl"
    extra = [{"prompt": "", "letter": "e"}, {"prompt": "ab" * 150, "letter": "e"}]
    data.write_text(prompt_file.read_text() + "".join(json.dumps(record) + "\n" for record in extra))
    recipe_document["data"]["path"] = str(data)
    result = run(write_recipe(recipe_document))
    assert result.returncode == 0, result.stderr
    assert "prompts: 66 loaded, 1 cut from the left to 120 tokens, 0 skipped as too long, 1 skipped as empty" in result.stdout

    recipe_document["data"]["max_prompt_tokens"] = 125
    recipe_document["run"]["output_dir"] = str(tmp_path / "refused")
    refused = run(write_recipe(recipe_document, "too_long.toml"))
    assert refused.returncode == 2 and not (tmp_path / "refused").exists()
    assert ("$.data.max_prompt_tokens: 125 prompt tokens and 8 response tokens (generator.max_new_tokens) do not fit in the "
            "policy's context of 128 positions; set it to 120 or less") in refused.stderr


def torchrun(recipe, *args):
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               str(Path(sys.executable).with_name("rlkit")), "run", "--quiet", recipe, *args]
    return subprocess.run(command, env=ENV, capture_output=True, text=True, timeout=300)


ON_PROCESS_1 = "lambda good: ({}) if os.environ['RANK'] == '1' else good"


def test_two_processes_stop_together_when_the_reward_fails_on_one(faulty):
    recipe, output_dir, _ = faulty({2: ON_PROCESS_1.format("fail(good)")})
    result = torchrun(recipe)
    assert result.returncode != 0
    assert 'rlkit run: reward "python"' in result.stderr and "failed at iteration 2: raised KeyError: 'reference'" in result.stderr
    saved = checkpoint.resolve("auto", output_dir)
    assert saved.name == "iter_000001" and checkpoint.read_meta(saved)["processes"] == 2
    assert len(json.loads((output_dir / "bad_batches" / "iter_000002.json").read_text())["rows"]) == 8  # process 1's share


def test_two_processes_skip_together_a_bad_batch_and_a_non_finite_step_on_one(faulty):
    recipe, output_dir, _ = faulty({2: ON_PROCESS_1.format("fail(good)"), 3: ON_PROCESS_1.format("[3e38] * len(good)")},
                                   steps=4, on_bad_reward="skip")
    result = torchrun(recipe)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = metrics_of(output_dir)
    assert [row["iteration"] for row in rows] == [1, 2, 3, 4]
    assert [row.get("run/skipped_batches") for row in rows] == [None, 1, 1, 1]
    assert [row.get("train/nonfinite") for row in rows] == [0.0, None, 1.0, 0.0]


def test_a_reward_that_finds_the_recipe_wrong_still_exits_2_with_its_located_message(recipe_document, write_recipe):
    recipe_document["reward"] = {"type": "rouge"}  # reads a `reference` column the data lacks
    result = run(write_recipe(recipe_document))
    assert result.returncode == 2
    assert "$.reward.reference_field: the data has no column 'reference' (columns: letter)" in result.stderr
