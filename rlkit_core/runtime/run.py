# pyright: standard
"""`rlkit run`: a recipe from start (or a checkpoint) to report, with the tracker, metrics.jsonl
and checkpoints kept in step."""

from __future__ import annotations

import json
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Literal

from rlkit_core import __version__
from rlkit_core.batch import RolloutBatch
from rlkit_core.errors import RlkitError, RunError
from rlkit_core.interfaces import NullTracker
from rlkit_core.launch import Launch
from rlkit_core.progress import Progress
from rlkit_core.recipe.assemble import Components
from rlkit_core.recipe.document import Recipe
from rlkit_core.recipe.inventory import flatten, inventory_rows
from rlkit_core.recipe.registry import Registry
from rlkit_core.recipe.resume_check import check_resumed_recipe
from rlkit_core.recipe.schema import kl_warnings
from rlkit_core.runtime import checkpoint
from rlkit_core.runtime.engine import Engine
from rlkit_core.runtime.environment_calls import CallsHung
from rlkit_core.runtime.episodes import chat_audit
from rlkit_core.runtime.evaluation import Evaluator
from rlkit_core.runtime.export import export_checkpoint
from rlkit_core.runtime.faults import (
    BadReward,
    NonFiniteSteps,
    NothingTrained,
    Stopped,
    StopRequests,
    checked_scores,
    failure_text,
    reward_name,
    save_bad_batch,
)
from rlkit_core.runtime.health import HealthMonitor, HealthStop
from rlkit_core.runtime.metrics_log import MetricsLog
from rlkit_core.runtime.plot import plot_curves
from rlkit_core.runtime.prompt_stream import Prompts
from rlkit_core.runtime.push_check import WeightPushFailed
from rlkit_core.runtime.report import SAMPLES, print_report
from rlkit_core.runtime.rollout import record_columns, sample_responses
from rlkit_core.runtime.run_lock import RunLock, launched_as_main
from rlkit_core.runtime.scheduling import ProducerFault
from rlkit_core.runtime.state import RunState
from rlkit_core.runtime.trainer import Trainer

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
    engine, components, prompts = trainer.engine, trainer.components, trainer.prompts
    processes = engine.processes
    main = processes.is_main
    if main:
        for warning in kl_warnings(recipe.ppo):
            print(f"rlkit run: warning: {warning}", file=sys.stderr)
        if note:
            print(f"rlkit run: {note}", file=sys.stderr)
        if components.environment is not None:  # how turns become tokens, as `rlkit check` audits it
            for line in chat_audit(recipe, components.policy).lines():
                print(f"rlkit run: episodes: {line}", file=sys.stderr)
        if changes:
            print(f"rlkit run: warning: resuming {start} with {len(changes)} changed setting(s) (--allow-changes): "
                  + "; ".join(changes), file=sys.stderr)
        for path in earlier:
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    processes.wait()
    outputs = RunOutputs(recipe, components.tracker, main)
    counts = prompts.counts
    if main and (counts["cut"] or counts["skipped"] or counts["empty"]):
        print(f"prompts: {counts['loaded']} loaded, {counts['cut']} cut from the left to {prompts.max_tokens} tokens, "
              f"{counts['skipped']} skipped as too long, {counts['empty']} skipped as empty", file=out)
    run_id = trainer.resume(start)["run_id"] if start else None
    outputs.continue_after(trainer.state.iteration)
    run_id = outputs.start_tracking(counts, processes.count, run_id, resumed=bool(start))
    if changes:
        outputs.notes["note/recipe_changes"] = changes  # text for the next row of metrics.jsonl
        outputs.recipe_changes = len(changes)
        outputs.tracker.log_note("resume.recipe_changes", f"resumed after iteration {trainer.state.iteration} with --allow-changes: "
                                 + "; ".join(changes), step=trainer.state.iteration)
    checkpointer = Checkpointer(recipe, engine, components, outputs.tracker, run_id)
    # every process evaluates the same held-out set; the main one writes
    evaluator = Evaluator(recipe, engine, components, trainer.context, prompts)
    if evaluator.enabled and trainer.state.iteration == 0:
        outputs.evaluated_before(_evaluate(evaluator, trainer.state))
    samples_before = _samples_before(trainer)

    status, final_checkpoint = "FAILED", None
    health = HealthMonitor(recipe.health, outputs.history)
    outputs.progress = Progress(recipe.run.steps, start=trainer.state.iteration, quiet=quiet or not main)
    try:
        with StopRequests(processes) as stop:
            while trainer.state.iteration < recipe.run.steps:
                metrics, batch = _train_or_skip(trainer, checkpointer)
                if evaluator.due(trainer.state.iteration):
                    metrics.update(_evaluate(evaluator, trainer.state))
                findings = health.observe(metrics, batch, components.kl.target)
                outputs.record(trainer.state.iteration, metrics, batch, findings)
                checkpointer.maybe_save(trainer.state, "schedule")
                _stop_if_nothing_trains(trainer, metrics, checkpointer)
                _stop_if_asked(trainer.state, processes, health.stops(findings), stop, checkpointer)
        final_checkpoint = _finish_outputs(trainer, outputs, checkpointer)
        status = "FINISHED"
    except (KeyboardInterrupt, Stopped):
        status = "KILLED"
        raise
    finally:
        trainer.close()
        outputs.progress.close()
        outputs.tracker.finish(status)

    samples = _samples_after(trainer, samples_before) if samples_before else []
    if main:
        print_report(outputs.history, samples, bool(prompts.held_out), outputs.metrics_log.path, final_checkpoint,
                     outputs.tracker, out=out, shown=recipe.run.report_samples)
    lock.release()  # before: with several processes, this process ends in the next line
    processes.exit_together()  # with several processes, this process ends here
    return outputs.history


class RunOutputs:
    """Where a run's numbers go: metrics.jsonl (the main process's), the tracker (the main
    process's; the others get a silent one) with its sample tables, the progress line, and the
    history of every row, which the report reads. Making one touches nothing on disk."""

    def __init__(self, recipe: Recipe, tracker, main: bool):
        self.recipe, self.main = recipe, main
        self.metrics_log = MetricsLog(Path(recipe.run.output_dir) / "metrics.jsonl")
        self.tracker = tracker if main else NullTracker()  # one tracked run per training run
        self.progress: Progress | None = None
        self.history: list[dict] = []
        self.notes: dict = {}  # text for the next row of metrics.jsonl
        self.recipe_changes = 0  # settings a resumed run changed, counted in its first row

    def continue_after(self, iteration: int) -> None:
        """The rows of metrics.jsonl up to `iteration` (the checkpoint a resumed run starts from)
        are its history; later ones, which it redoes, are dropped."""
        if self.main:
            self.metrics_log.truncate_after(iteration)
            self.history = self.metrics_log.read()

    def start_tracking(self, counts: dict[str, int], processes: int, run_id: str | None, resumed: bool) -> str | None:
        """The tracked run, started (or continued: `run_id`) with the recipe's settings as
        parameters and the components as tags; returns its id."""
        recipe = self.recipe
        tags = {"rlkit.version": __version__}
        tags.update({f"rlkit.component.{r['table']}": f"{r['type']} ({r['distribution']} {r['version']})" for r in inventory_rows(recipe)})
        params = {**flatten(recipe.document), **{f"prompts.{name}": value for name, value in counts.items()}, "processes": processes}
        run_id = self.tracker.start(run_name=recipe.run.name, params=params, tags=tags, resume_id=run_id)
        if recipe.source and not resumed:
            self.tracker.log_artifact(recipe.source, "recipe")
        return run_id

    def evaluated_before(self, metrics: dict[str, float]) -> None:
        """The held-out evaluation before the first iteration, as row 0."""
        if self.main:
            self.metrics_log.append(0, metrics)
        self.tracker.log_metrics(metrics, step=0)
        self.history.append({"iteration": 0, **metrics})

    def record(self, iteration: int, metrics: dict[str, float], batch, findings) -> None:
        """Iteration `iteration`'s row: the health checks that fired, metrics.jsonl, the tracker
        (and a sample table on `run.sample_every`), the history and the progress line."""
        run = self.recipe.run
        self.notes.update(_report_findings(findings, self.tracker, iteration, self.main))
        if "note/recipe_changes" in self.notes:
            metrics["run/recipe_changes"] = self.recipe_changes
        started = time.perf_counter()
        if self.main:
            self.metrics_log.append(iteration, metrics, self.notes)
        self.notes = {}
        self.tracker.log_metrics(metrics, step=iteration)
        trained = "score/mean" in metrics
        if trained and (iteration % run.sample_every == 0 or iteration == run.steps):
            self.tracker.log_samples(_sample_rows(batch), step=iteration)
        metrics["time/tracking"] = time.perf_counter() - started
        self.history.append({"iteration": iteration, **metrics})
        if trained and self.progress is not None:
            self.progress.update(iteration, metrics)


class Checkpointer:
    """The run's checkpoints: on the schedule (`run.checkpoint_every`), when the run stops early,
    and at the end."""

    def __init__(self, recipe: Recipe, engine: Engine, components: Components, tracker, run_id: str | None):
        self.recipe, self.engine, self.components, self.tracker, self.run_id = recipe, engine, components, tracker, run_id
        self.latest: tuple[int, Path] | None = None  # (iteration, folder) of the latest this run wrote

    def save(self, state: RunState, rng: dict | None = None) -> Path:
        """A checkpoint of `state` (with the random state `rng` when given; see `save_checkpoint`)."""
        path = checkpoint.save_checkpoint(self.engine, self.components, self.recipe, state, self.run_id,
                                          self.recipe.run.keep_checkpoints, rng=rng)
        self.latest = (state.iteration, path)
        return path

    def maybe_save(self, state: RunState, reason: Literal["schedule", "stop"]) -> Path | None:
        """`schedule`: a checkpoint when `run.checkpoint_every` says one is due after this iteration
        (not after the last: the end writes that one), logged with the tracker. `stop`: the state as
        it is, unless it was written already. Returns the checkpoint (None: none was due)."""
        if reason == "stop":
            return self.latest[1] if self.latest and self.latest[0] == state.iteration else self.save(state)
        every = self.recipe.run.checkpoint_every
        if not (every and state.iteration % every == 0 and state.iteration < self.recipe.run.steps):
            return None
        path = self.save(state)
        self.tracker.log_checkpoint(str(path), state.iteration)
        return path


def _train_or_skip(trainer: Trainer, checkpointer: Checkpointer) -> tuple[dict[str, float], RolloutBatch | None]:
    """The next iteration, trained, or skipped when its reward failed and the recipe says skip:
    its metrics and the batch it trained on (None when skipped). Both counts of failures in a row
    obey `run.max_skips_in_a_row`: batches whose reward failed (counted here) and optimiser steps
    that were not finite (counted by the update); past it, the run ends with what was saved."""
    run, state = trainer.recipe.run, trainer.state
    before = checkpoint.rng_state()  # to checkpoint the state before this iteration if its reward fails
    try:
        result = trainer.iterate()
        metrics, batch = result.metrics, result.batch if result.trained else None
    except BadReward as fault:
        in_a_row = state.reward_failed().skips_in_a_row
        if run.on_bad_reward == "stop" or in_a_row >= run.max_skips_in_a_row:
            raise _reward_failed(trainer, checkpointer, fault, before, in_a_row) from None
        metrics, batch = _skip_batch(trainer, fault), None
    # a batch made ahead failed or never came, the environment's calls hung, or a weight push did not land: what trained so far is kept
    except (ProducerFault, CallsHung, WeightPushFailed) as fault:
        saved = checkpointer.maybe_save(state, "stop")
        raise RunError(f"{fault}; saved {saved}; continue with --resume auto") from None
    except NonFiniteSteps as fault:
        raise RunError(f"{fault}; {_latest_checkpoint(run.output_dir)}; lower optim.learning_rate or look at the "
                       "reward's scale (score/mean), then continue with --resume auto") from None
    if trainer.state.skipped_batches:
        metrics["run/skipped_batches"] = trainer.state.skipped_batches
    return metrics, batch


def _stop_if_nothing_trains(trainer: Trainer, metrics: dict[str, float], checkpointer: Checkpointer) -> None:
    """Say so when an iteration trained nothing; end the run (exit 3, with a checkpoint) after
    `run.max_skips_in_a_row` such iterations in a row, or at its last iteration when none of its
    iterations ever trained: a run that learned nothing never ends as if it had."""
    state, run = trainer.state, trainer.recipe.run
    if not state.untrained_in_a_row:
        return
    statuses = ", ".join(f"{name} = {value:.2f}" for name, value in metrics.items() if name.startswith("env/status_") and value)
    why = f"no rollout had a token to train: every episode ended in a status kept out of training ({statuses})" if statuses else \
        "no rollout had a token to train"
    if trainer.engine.processes.is_main:
        print(f"rlkit run: warning: iteration {state.iteration} trained nothing: {why}; the weights, the optimiser and the KL "
              "controller were left as they were", file=sys.stderr)
    if state.untrained_in_a_row >= run.max_skips_in_a_row:
        streak = f"{state.untrained_in_a_row} iterations in a row (run.max_skips_in_a_row)"
    elif state.untrained_batches >= state.iteration >= run.steps:  # the last iteration, and none ever trained
        streak = "every iteration of the run"
    else:
        return
    saved = checkpointer.maybe_save(state, "stop")
    raise NothingTrained(f"{streak} trained nothing, up to iteration {state.iteration}: {why}; look at the warnings above for the "
                         f"environment's faults, fix them, then continue with --resume auto (saved {saved})")


def _stop_if_asked(state: RunState, processes, finding, stop: StopRequests, checkpointer: Checkpointer) -> None:
    """End the run early, with a checkpoint, when a health check in `health.stop_on` fired
    (`finding`, as the main process saw it) or a signal asked to stop before the last iteration."""
    if halt := processes.gather_objects(finding)[0]:  # the main process decides for all
        saved = checkpointer.maybe_save(state, "stop")
        raise HealthStop(f"health check {halt.check} fired after iteration {state.iteration} and is in "
                         f"health.stop_on: {halt.text}; saved {saved}; continue with --resume auto")
    signal_number = stop.requested() if state.iteration < checkpointer.recipe.run.steps else None
    if signal_number:
        saved = checkpointer.maybe_save(state, "stop")
        raise Stopped(f"stopped by {signal.Signals(signal_number).name} after iteration {state.iteration}; "
                      f"saved {saved}; continue with --resume auto", signal_number)


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


def _latest_checkpoint(output_dir: str) -> str:
    found = checkpoint.complete_checkpoints(output_dir)
    if not found:
        return "no checkpoint was written before it (run.checkpoint_every sets how often one is)"
    return f"the latest checkpoint, {found[-1]}, is intact"


def _reward_failed(trainer: Trainer, checkpointer: Checkpointer, fault: BadReward, rng_before: dict, in_a_row: int) -> RunError:
    """The error that ends a run whose reward failed at iteration `trainer.state.iteration + 1`:
    which reward, where, and what was saved: the state before the iteration (nothing in it changed
    but the random stream, which is rewound) and the batch."""
    recipe, state = trainer.recipe, trainer.state
    output_dir = recipe.run.output_dir
    failed_at, last_good = state.iteration + 1, state.iteration
    saved = "nothing was trained yet, so no checkpoint"
    if last_good:
        found = checkpoint.complete_checkpoints(output_dir)
        path = found[-1] if found and checkpoint.read_meta(found[-1])["iteration"] == last_good else \
            checkpointer.save(state, rng=rng_before)
        saved = f"saved the state after iteration {last_good} as {path}"
    reward = reward_name(recipe)
    if trainer.engine.processes.is_main:
        saved += f" and the batch as {save_bad_batch(output_dir, failed_at, reward, fault)}"
    skips = f" ({in_a_row} batches in a row; run.max_skips_in_a_row)" if in_a_row > 1 else ""
    advice = "continue with --resume auto once the reward is fixed"
    if recipe.run.on_bad_reward == "stop":
        advice += ', or set run.on_bad_reward = "skip" to drop such batches'
    return RunError(f"{reward} failed at iteration {failed_at}{skips}: {fault.headline}; {saved}; {advice}{fault.frames}")


def _evaluate(evaluator: Evaluator, state: RunState) -> dict[str, float]:
    """The held-out evaluation; its reward failing ends the run (no batch to drop)."""
    try:
        return evaluator()
    except BadReward as fault:
        recipe = evaluator.recipe
        raise RunError(f"{reward_name(recipe)} failed in the held-out evaluation after iteration {state.iteration}: "
                       f"{fault.headline}; {_latest_checkpoint(recipe.run.output_dir)}{fault.frames}") from None


def _skip_batch(trainer: Trainer, fault: BadReward) -> dict[str, float]:
    """run.on_bad_reward = "skip": the iteration passes without training; say so and keep the batch."""
    trainer.skip_iteration()
    reward, iteration = reward_name(trainer.recipe), trainer.state.iteration
    if trainer.engine.processes.is_main:
        path = save_bad_batch(trainer.recipe.run.output_dir, iteration, reward, fault)
        print(f"rlkit run: warning: {reward} failed at iteration {iteration}: {fault.headline}; skipped the batch "
              f"(saved as {path})", file=sys.stderr)
    return {}


def _sample_records(prompts: Prompts, shown: int) -> list[dict]:
    """The prompts the report compares before and after training, fixed before training: every
    held-out one when there are (it shows the first `shown` and counts how many got better), else
    the first `shown` training ones; none when `shown` is 0 (`run.report_samples`: each is an
    episode, which may cost an agent's calls). Their responses are greedy, the policy's best guess,
    so before and after compare the policy rather than two draws."""
    return (prompts.held_out or prompts.train[:shown]) if shown else []


def _samples_before(trainer: Trainer) -> list[dict]:
    """Responses of the starting policy to the sample prompts, kept on disk so a resumed run can
    still show what the policy said before any training; none on a resumed run that kept none (its
    starting policy is gone). Every process generates them (under FSDP generation needs them all);
    the main process writes them."""
    processes, shown = trainer.engine.processes, trainer.recipe.run.report_samples
    path = Path(trainer.recipe.run.output_dir) / "samples_before.json"
    if not shown:
        return []
    if processes.gather_objects(path.exists())[0]:
        return json.loads(path.read_text())
    if trainer.state.iteration:  # resumed, from a run that played none
        return []
    records = _sample_records(trainer.prompts, shown)
    responses = sample_responses(trainer.engine, trainer.components, trainer.recipe, records, trainer.recipe.ppo.batch_size,
                                 trainer.prompts.max_tokens, greedy=True)
    samples = [{"prompt": r["prompt"], "before": b} for r, b in zip(records, responses)]
    if processes.is_main:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(samples, indent=2))
    return samples


def _samples_after(trainer: Trainer, samples_before: list[dict]) -> list[dict]:
    """`samples_before` with the trained policy's responses to the same prompts, scored on the main
    process. Every process generates them (FSDP gathers the weights)."""
    records = _sample_records(trainer.prompts, trainer.recipe.run.report_samples)[:len(samples_before)]
    after = sample_responses(trainer.engine, trainer.components, trainer.recipe, records, trainer.recipe.ppo.batch_size,
                             trainer.prompts.max_tokens, greedy=True)
    samples = [{**before, "after": a} for before, a in zip(samples_before, after)]
    if not trainer.engine.processes.is_main:
        return samples
    return _scored(trainer.recipe, trainer.components, records, samples)


def _scored(recipe: Recipe, components: Components, records: list[dict], samples: list[dict]) -> list[dict]:
    """`samples` with the reward's score of the response before and after training. The run has
    finished by now, so a reward failing here only leaves the samples unscored."""
    if components.reward is None:  # the environment's rewards alone: they belong to whole episodes, not to these texts
        return samples
    both = records + records
    responses = [s["before"] for s in samples] + [s["after"] for s in samples]
    try:
        scores = checked_scores(components.reward.score([r["prompt"] for r in both], responses, **record_columns(both)),
                                len(responses))
    except Exception as exc:  # someone else's code, after the run: say so and report without scores
        print(f"rlkit run: warning: {reward_name(recipe)} failed on the report's samples ({failure_text(exc)}); "
              "they are shown unscored", file=sys.stderr)
        return samples
    return [{**s, "before_score": b, "after_score": a} for s, b, a in zip(samples, scores, scores[len(samples):])]


def _sample_rows(batch) -> list[dict]:
    return [{"prompt": p, "response": r, "score": float(s)}
            for p, r, s in zip(batch.prompts[:SAMPLES], batch.responses[:SAMPLES], batch.scores[:SAMPLES])]


def _finish_outputs(trainer: Trainer, outputs: RunOutputs, checkpointer: Checkpointer) -> Path:
    """The last checkpoint, the final model and the curves, logged with the run."""
    recipe, processes, tracker = trainer.recipe, trainer.engine.processes, outputs.tracker
    final_checkpoint = checkpointer.save(trainer.state)
    tracker.log_checkpoint(str(final_checkpoint), trainer.state.iteration)
    if not processes.is_main:
        return final_checkpoint
    model_dir = Path(recipe.run.output_dir) / "final_model"
    if processes.sharded:  # the model holds shards; the checkpoint holds the gathered weights
        shutil.rmtree(model_dir, ignore_errors=True)
        assert isinstance(recipe.registry, Registry)  # a recipe parsed for a run knows where its components came from
        export_checkpoint(str(final_checkpoint), str(model_dir), recipe.registry, merge_lora=True, launch=trainer.launch)
    else:
        trainer.components.policy.save_pretrained(str(model_dir), merge_adapters=True)
    tracker.log_model(str(model_dir))
    tracker.log_artifact(str(outputs.metrics_log.path))
    curves = plot_curves(outputs.history, Path(recipe.run.output_dir) / "curves.png")
    if curves:
        tracker.log_artifact(str(curves))
    return final_checkpoint
