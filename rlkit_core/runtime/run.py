"""`rlkit run`: a recipe from start (or a checkpoint) to report, with the tracker, metrics.jsonl
and checkpoints kept in step."""

from __future__ import annotations

import json
import shutil
import signal
import sys
import time
from pathlib import Path

from rlkit_core import __version__
from rlkit_core.errors import RlkitError, RunError
from rlkit_core.interfaces import Tracker
from rlkit_core.launch import Launch
from rlkit_core.progress import Progress
from rlkit_core.recipe.document import Recipe
from rlkit_core.recipe.inventory import flatten, inventory_rows
from rlkit_core.recipe.resume_check import check_resumed_recipe
from rlkit_core.recipe.schema import kl_warnings
from rlkit_core.runtime import checkpoint
from rlkit_core.runtime.evaluation import Evaluator
from rlkit_core.runtime.export import export_checkpoint
from rlkit_core.runtime.faults import BadReward, NonFiniteSteps, Stopped, StopRequests, checked_scores, failure_text, reward_name, save_bad_batch
from rlkit_core.runtime.health import HealthMonitor, HealthStop
from rlkit_core.runtime.metrics_log import MetricsLog
from rlkit_core.runtime.plot import plot_curves
from rlkit_core.runtime.report import SAMPLES_PRINTED, print_report
from rlkit_core.runtime.run_lock import RunLock, launched_as_main
from rlkit_core.runtime.trainer import Trainer, record_columns

SAMPLES_SHOWN = 4


class _Untracked(Tracker):
    """What the processes other than the main one log to: nothing (one tracked run per training run)."""

    def start(self, *, run_name, params, tags, resume_id):
        return None

    def log_metrics(self, metrics, step):
        pass

    def finish(self, status):
        pass


RUN_OUTPUTS = ("metrics.jsonl", "checkpoints", "samples_before.json", "final_model", "curves.png", "bad_batches")


def claim_output_dir(output_dir: str, resume: str | None, overwrite: bool) -> tuple[list[Path], Path | None, str]:
    """A fresh run must not mix its files with an earlier run's; say how to continue or start over.
    A folder whose run stopped before it trained an iteration (a reward that failed at once) holds
    nothing worth keeping, so a plain run starts over there. Returns (earlier outputs to clear, the
    checkpoint to start from, a note for the user); only reads, so every process can check."""
    folder = Path(output_dir)
    if resume:
        return [], *checkpoint.choose(resume, folder)
    found = [folder / name for name in RUN_OUTPUTS if (folder / name).exists()]
    if not found:
        return [], None, ""
    names = ", ".join(path.name for path in found)
    complete = checkpoint.complete_checkpoints(folder)
    metrics = MetricsLog(folder / "metrics.jsonl").read()
    if not (complete or (folder / "final_model").exists() or any(row.get("iteration", 0) >= 1 for row in metrics)):
        return found, None, f"{folder} holds only what a run left before its first iteration ({names}); starting over"
    if overwrite:
        return found, None, ""
    how = "continue it with --resume auto, " if complete else "it left no checkpoint to continue with --resume auto; "
    raise RlkitError(f"{folder} already holds a run ({names}); {how}start over with --overwrite, "
                     f"or pick another folder with --set run.output_dir=...")


def run_recipe(recipe: Recipe, quiet: bool = False, resume: str | None = None, overwrite: bool = False, out=sys.stdout,
               allow_changes: bool = False, launch: Launch | None = None) -> list[dict]:
    """Train up to `recipe.run.steps` iterations; returns the metrics of every iteration (on the
    main process; the others train alongside it and write nothing). The main process holds the
    output folder's lock throughout (see `rlkit_core.runtime.run_lock`). A resumed run refuses a recipe
    that trains differently from the checkpoint's, unless `allow_changes`. `launch`: the one the
    recipe was checked for (default: this process's, read from the environment)."""
    launch = launch or Launch.from_environment()
    with RunLock(recipe.run.output_dir) as lock:
        if launched_as_main() and (took_over := lock.acquire()):
            print(f"rlkit run: {took_over}", file=sys.stderr)
        return _run_recipe(recipe, quiet, resume, overwrite, out, lock, allow_changes, launch)


def _run_recipe(recipe: Recipe, quiet: bool, resume: str | None, overwrite: bool, out, lock: RunLock, allow_changes: bool,
                launch: Launch) -> list[dict]:
    earlier, start, note = claim_output_dir(recipe.run.output_dir, resume, overwrite)
    changes = check_resumed_recipe(checkpoint.read_meta(start)["recipe"], recipe, start, allow_changes, launch) if start else []
    trainer = Trainer(recipe, launch=launch)
    main = trainer.processes.is_main
    if main:
        for warning in kl_warnings(recipe.ppo):
            print(f"rlkit run: warning: {warning}", file=sys.stderr)
        if note:
            print(f"rlkit run: {note}", file=sys.stderr)
        if changes:
            print(f"rlkit run: warning: resuming {start} with {len(changes)} changed setting(s) (--allow-changes): "
                  + "; ".join(changes), file=sys.stderr)
        for path in earlier:
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    trainer.processes.wait()
    tracker = trainer.parts.tracker if main else _Untracked()  # one tracked run per training run
    counts = trainer.prompt_counts
    if main and (counts["cut"] or counts["skipped"] or counts["empty"]):
        print(f"prompts: {counts['loaded']} loaded, {counts['cut']} cut from the left to {trainer.max_prompt_tokens} tokens, "
              f"{counts['skipped']} skipped as too long, {counts['empty']} skipped as empty", file=out)
    run_id = None
    if start:
        meta = checkpoint.load_checkpoint(trainer, start)
        run_id = meta["run_id"]
    history = []
    if main:
        trainer.metrics_log.truncate_after(trainer.iteration)
        history = trainer.metrics_log.read()

    tags = {"rlkit.version": __version__}
    tags.update({f"rlkit.component.{r['table']}": f"{r['type']} ({r['distribution']} {r['version']})" for r in inventory_rows(recipe)})
    params = {**flatten(recipe.document), **{f"prompts.{name}": value for name, value in counts.items()},
              "processes": trainer.processes.count}
    run_id = tracker.start(run_name=recipe.run.name, params=params, tags=tags, resume_id=run_id)
    if recipe.source and not start:
        tracker.log_artifact(recipe.source, "recipe")
    notes = {"note/recipe_changes": changes} if changes else {}  # text for the next row of metrics.jsonl
    if changes:
        tracker.log_note("resume.recipe_changes", f"resumed after iteration {trainer.iteration} with --allow-changes: "
                         + "; ".join(changes), step=trainer.iteration)
    evaluator = Evaluator(trainer)  # every process evaluates the same held-out set; the main one writes
    if evaluator.enabled and trainer.iteration == 0:
        before = _evaluate(evaluator)
        if main:
            trainer.metrics_log.append(0, before)
        tracker.log_metrics(before, step=0)
        history.append({"iteration": 0, **before})
    samples_before = _samples_before(trainer)

    progress = Progress(recipe.run.steps, start=trainer.iteration, quiet=quiet or not main)
    status, final_checkpoint = "FAILED", None
    skipped = max((row.get("run/skipped_batches", 0) for row in history), default=0)
    skips_in_a_row = 0
    health = HealthMonitor(recipe.health, history)
    try:
        with StopRequests(trainer.processes) as stop:
            while trainer.iteration < recipe.run.steps:
                before = checkpoint.rng_state()  # to checkpoint the state before this iteration if its reward fails
                try:
                    metrics = trainer.step()
                    skips_in_a_row = 0
                except BadReward as fault:
                    skips_in_a_row += 1
                    if recipe.run.on_bad_reward == "stop" or skips_in_a_row >= recipe.run.max_skips_in_a_row:
                        raise _reward_failed(trainer, fault, run_id, before, skips_in_a_row) from None
                    metrics = _skip_batch(trainer, fault)
                    skipped += 1
                except NonFiniteSteps as fault:
                    raise RunError(f"{fault}; {_latest_checkpoint(trainer)}; lower optim.learning_rate or look at the "
                                   "reward's scale (score/mean), then continue with --resume auto") from None
                if skipped:
                    metrics["run/skipped_batches"] = skipped
                if evaluator.due(trainer.iteration):
                    metrics.update(_evaluate(evaluator))
                findings = health.observe(metrics, trainer.last_batch, trainer.parts.kl.target)
                notes.update(_report_findings(findings, tracker, trainer.iteration, main))
                if "note/recipe_changes" in notes:
                    metrics["run/recipe_changes"] = len(changes)
                started = time.perf_counter()
                if main:
                    trainer.metrics_log.append(trainer.iteration, metrics, notes)
                notes = {}
                tracker.log_metrics(metrics, step=trainer.iteration)
                trained = "score/mean" in metrics
                if trained and (trainer.iteration % recipe.run.sample_every == 0 or trainer.iteration == recipe.run.steps):
                    tracker.log_samples(_sample_rows(trainer.last_batch), step=trainer.iteration)
                metrics["time/tracking"] = time.perf_counter() - started
                history.append({"iteration": trainer.iteration, **metrics})
                if trained:
                    progress.update(trainer.iteration, metrics)
                every = recipe.run.checkpoint_every
                saved = None
                if every and trainer.iteration % every == 0 and trainer.iteration < recipe.run.steps:
                    saved = checkpoint.save_checkpoint(trainer, run_id, recipe.run.keep_checkpoints)
                    tracker.log_checkpoint(str(saved), trainer.iteration)
                if halt := trainer.processes.gather_objects(health.stops(findings))[0]:  # the main process decides for all
                    saved = saved or checkpoint.save_checkpoint(trainer, run_id, recipe.run.keep_checkpoints)
                    raise HealthStop(f"health check {halt.check} fired after iteration {trainer.iteration} and is in "
                                     f"health.stop_on: {halt.text}; saved {saved}; continue with --resume auto")
                signal_number = stop.requested() if trainer.iteration < recipe.run.steps else None
                if signal_number:
                    saved = saved or checkpoint.save_checkpoint(trainer, run_id, recipe.run.keep_checkpoints)
                    raise Stopped(f"stopped by {signal.Signals(signal_number).name} after iteration {trainer.iteration}; "
                                  f"saved {saved}; continue with --resume auto", signal_number)
        final_checkpoint = _finish_outputs(trainer, tracker, run_id, history)
        status = "FINISHED"
    except (KeyboardInterrupt, Stopped):
        status = "KILLED"
        raise
    finally:
        progress.close()
        tracker.finish(status)

    records = _sample_records(trainer)
    after = trainer.sample_responses(records, greedy=True)  # every process: FSDP gathers the weights
    if main:
        samples = _scored(trainer, records, [{**before, "after": a} for before, a in zip(samples_before, after)])
        print_report(history, samples, bool(trainer.eval_records), trainer.metrics_log.path, final_checkpoint, tracker, out=out)
    lock.release()  # before: with several processes, this process ends in the next line
    trainer.processes.exit_together()  # with several processes, this process ends here
    return history


def _report_findings(findings, tracker, iteration: int, main: bool) -> dict[str, str]:
    """Each health check that fired for the first time: a warning line, a tracker note, and its
    text for the row of metrics.jsonl (`health/<check>`, beside the metric with its value)."""
    texts = {}
    for finding in findings:
        line = f"health check {finding.check} after iteration {iteration}: {finding.text}"
        if main:
            print(f"rlkit run: warning: {line}", file=sys.stderr)
        tracker.log_note(f"health.{finding.check}", line, step=iteration)
        texts[f"note/health/{finding.check}"] = finding.text
    return texts


def _latest_checkpoint(trainer) -> str:
    found = checkpoint.complete_checkpoints(trainer.output_dir)
    if not found:
        return "no checkpoint was written before it (run.checkpoint_every sets how often one is)"
    return f"the latest checkpoint, {found[-1]}, is intact"


def _reward_failed(trainer, fault: BadReward, run_id, rng_before: dict, in_a_row: int) -> RunError:
    """The error that ends a run whose reward failed at iteration `trainer.iteration + 1`: which
    reward, where, and what was saved: the state before the iteration (nothing in it changed
    but the random stream, which is rewound) and the batch."""
    failed_at, last_good = trainer.iteration + 1, trainer.iteration
    saved = "nothing was trained yet, so no checkpoint"
    if last_good:
        found = checkpoint.complete_checkpoints(trainer.output_dir)
        path = found[-1] if found and checkpoint.read_meta(found[-1])["iteration"] == last_good else \
            checkpoint.save_checkpoint(trainer, run_id, trainer.recipe.run.keep_checkpoints, rng=rng_before)
        saved = f"saved the state after iteration {last_good} as {path}"
    reward = reward_name(trainer.recipe)
    if trainer.processes.is_main:
        saved += f" and the batch as {save_bad_batch(trainer.output_dir, failed_at, reward, fault)}"
    skips = f" ({in_a_row} batches in a row; run.max_skips_in_a_row)" if in_a_row > 1 else ""
    advice = "continue with --resume auto once the reward is fixed"
    if trainer.recipe.run.on_bad_reward == "stop":
        advice += ', or set run.on_bad_reward = "skip" to drop such batches'
    return RunError(f"{reward} failed at iteration {failed_at}{skips}: {fault.headline}; {saved}; {advice}{fault.frames}")


def _evaluate(evaluator) -> dict[str, float]:
    """The held-out evaluation; its reward failing ends the run (no batch to drop)."""
    try:
        return evaluator()
    except BadReward as fault:
        trainer = evaluator.trainer
        raise RunError(f"{reward_name(trainer.recipe)} failed in the held-out evaluation after iteration {trainer.iteration}: "
                       f"{fault.headline}; {_latest_checkpoint(trainer)}{fault.frames}") from None


def _skip_batch(trainer, fault: BadReward) -> dict[str, float]:
    """run.on_bad_reward = "skip": the iteration passes without training; say so and keep the batch."""
    trainer.skip_iteration()
    reward = reward_name(trainer.recipe)
    if trainer.processes.is_main:
        path = save_bad_batch(trainer.output_dir, trainer.iteration, reward, fault)
        print(f"rlkit run: warning: {reward} failed at iteration {trainer.iteration}: {fault.headline}; skipped the batch "
              f"(saved as {path})", file=sys.stderr)
    return {}


def _sample_records(trainer) -> list[dict]:
    """The prompts the report compares before and after training, fixed before training: every
    held-out one when there are (it shows the first few and counts how many got better), else the
    first training ones. Their responses are greedy, the policy's best guess, so before and after
    compare the policy rather than two draws."""
    return trainer.eval_records or trainer.records[:SAMPLES_PRINTED]


def _samples_before(trainer) -> list[dict]:
    """Responses of the starting policy to the sample prompts, kept on disk so a resumed run can
    still show what the policy said before any training. Every process generates them (under
    FSDP generation needs them all); the main process writes them."""
    path = Path(trainer.output_dir) / "samples_before.json"
    if trainer.processes.gather_objects(path.exists())[0]:
        return json.loads(path.read_text())
    records = _sample_records(trainer)
    responses = trainer.sample_responses(records, greedy=True)
    samples = [{"prompt": r["prompt"], "before": b} for r, b in zip(records, responses)]
    if trainer.processes.is_main:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(samples, indent=2))
    return samples


def _scored(trainer, records: list[dict], samples: list[dict]) -> list[dict]:
    """`samples` with the reward's score of the response before and after training. The run has
    finished by now, so a reward failing here only leaves the samples unscored."""
    both = records + records
    responses = [s["before"] for s in samples] + [s["after"] for s in samples]
    try:
        scores = checked_scores(trainer.parts.reward.score([r["prompt"] for r in both], responses, **record_columns(both)),
                                len(responses))
    except Exception as exc:  # someone else's code, after the run: say so and report without scores
        print(f"rlkit run: warning: {reward_name(trainer.recipe)} failed on the report's samples ({failure_text(exc)}); "
              "they are shown unscored", file=sys.stderr)
        return samples
    return [{**s, "before_score": b, "after_score": a} for s, b, a in zip(samples, scores, scores[len(samples):])]


def _sample_rows(batch) -> list[dict]:
    return [{"prompt": p, "response": r, "score": float(s)}
            for p, r, s in zip(batch.prompts[:SAMPLES_SHOWN], batch.responses[:SAMPLES_SHOWN], batch.scores[:SAMPLES_SHOWN])]


def _finish_outputs(trainer, tracker, run_id, history) -> Path:
    """The last checkpoint, the final model and the curves, logged with the run."""
    final_checkpoint = checkpoint.save_checkpoint(trainer, run_id, trainer.recipe.run.keep_checkpoints)
    tracker.log_checkpoint(str(final_checkpoint), trainer.iteration)
    if not trainer.processes.is_main:
        return final_checkpoint
    model_dir = Path(trainer.output_dir) / "final_model"
    if trainer.processes.sharded:  # the model holds shards; the checkpoint holds the gathered weights
        shutil.rmtree(model_dir, ignore_errors=True)
        export_checkpoint(str(final_checkpoint), str(model_dir), trainer.recipe.registry, merge_lora=True, launch=trainer.launch)
    else:
        trainer.policy.save_pretrained(str(model_dir), merge_adapters=True)
    tracker.log_model(str(model_dir))
    tracker.log_artifact(str(trainer.metrics_log.path))
    curves = plot_curves(history, Path(trainer.output_dir) / "curves.png")
    if curves:
        tracker.log_artifact(str(curves))
    return final_checkpoint
