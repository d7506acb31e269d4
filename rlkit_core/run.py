"""`rlkit run`: a recipe from start (or a checkpoint) to report, with the tracker, metrics.jsonl
and checkpoints kept in step."""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

from rlkit_core import __version__, checkpoint
from rlkit_core.errors import RlkitError
from rlkit_core.evaluation import Evaluator
from rlkit_core.export import export_checkpoint
from rlkit_core.interfaces import SilentTracker
from rlkit_core.inventory import flatten, inventory_rows
from rlkit_core.plot import plot_curves
from rlkit_core.progress import Progress
from rlkit_core.recipe import Recipe
from rlkit_core.report import print_report
from rlkit_core.schema import kl_warnings
from rlkit_core.trainer import Trainer

SAMPLE_COUNT = 5
SAMPLES_SHOWN = 4


RUN_OUTPUTS = ("metrics.jsonl", "checkpoints", "samples_before.json", "final_model", "curves.png")


def claim_output_dir(output_dir: str, resume: str | None, overwrite: bool) -> list[Path]:
    """A fresh run must not mix its files with an earlier run's; say how to continue or start over.
    Returns the earlier outputs that --overwrite clears (only reads, so every process can check)."""
    folder = Path(output_dir)
    found = [name for name in RUN_OUTPUTS if (folder / name).exists()]
    if not found or resume:
        return []
    if not overwrite:
        raise RlkitError(f"{folder} already holds a run ({', '.join(found)}); continue it with --resume auto, "
                         f"start over with --overwrite, or pick another folder with --set run.output_dir=...")
    return [folder / name for name in found]


def run_recipe(recipe: Recipe, quiet: bool = False, resume: str | None = None, overwrite: bool = False, out=sys.stdout) -> list[dict]:
    """Train up to `recipe.run.steps` iterations; returns the metrics of every iteration (on the
    main process; the others train alongside it and write nothing)."""
    earlier = claim_output_dir(recipe.run.output_dir, resume, overwrite)
    resume_from = checkpoint.resolve(resume, recipe.run.output_dir) if resume else None  # a wrong --resume stops the run before it writes
    trainer = Trainer(recipe)
    main = trainer.processes.is_main
    if main:
        for warning in kl_warnings(recipe.ppo):
            print(f"rlkit run: warning: {warning}", file=sys.stderr)
        for path in earlier:
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    trainer.processes.wait()
    tracker = trainer.parts.tracker if main else SilentTracker()  # one tracked run per training run
    counts = trainer.prompt_counts
    if main and (counts["cut"] or counts["skipped"]):
        print(f"prompts: {counts['loaded']} loaded, {counts['cut']} cut from the left to {trainer.max_prompt_tokens} tokens, "
              f"{counts['skipped']} skipped as too long", file=out)
    run_id = None
    if resume:
        meta = checkpoint.load_checkpoint(trainer, resume_from)
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
    if recipe.source and not resume:
        tracker.log_artifact(recipe.source, "recipe")
    evaluator = Evaluator(trainer)  # every process evaluates the same held-out set; the main one writes
    if evaluator.enabled and trainer.iteration == 0:
        before = evaluator()
        if main:
            trainer.metrics_log.append(0, before)
        tracker.log_metrics(before, step=0)
        history.append({"iteration": 0, **before})
    samples_before = _samples_before(trainer)

    progress = Progress(recipe.run.steps, start=trainer.iteration, quiet=quiet or not main)
    status, final_checkpoint = "FAILED", None
    try:
        while trainer.iteration < recipe.run.steps:
            metrics = trainer.step()
            if evaluator.due(trainer.iteration):
                metrics.update(evaluator())
            started = time.perf_counter()
            if main:
                trainer.metrics_log.append(trainer.iteration, metrics)
            tracker.log_metrics(metrics, step=trainer.iteration)
            if trainer.iteration % recipe.run.sample_every == 0 or trainer.iteration == recipe.run.steps:
                tracker.log_samples(_sample_rows(trainer.last_batch), step=trainer.iteration)
            metrics["time/tracking"] = time.perf_counter() - started
            history.append({"iteration": trainer.iteration, **metrics})
            progress.update(trainer.iteration, metrics)
            every = recipe.run.checkpoint_every
            if every and trainer.iteration % every == 0 and trainer.iteration < recipe.run.steps:
                saved = checkpoint.save_checkpoint(trainer, run_id, recipe.run.keep_checkpoints)
                tracker.log_checkpoint(str(saved), trainer.iteration)
        status = "FINISHED"
    except KeyboardInterrupt:
        status = "KILLED"
        raise
    finally:
        progress.close()
        if status == "FINISHED":
            final_checkpoint = _finish_outputs(trainer, tracker, run_id, history)
        tracker.finish(status)

    after = trainer.sample_responses(_sample_records(trainer), greedy=True)  # every process: FSDP gathers the weights
    if main:
        samples = [{**before, "after": a} for before, a in zip(samples_before, after)]
        print_report(history, samples, trainer.metrics_log.path, final_checkpoint, tracker, out=out)
    trainer.processes.exit_together()  # with several processes, this process ends here
    return history


def _sample_records(trainer) -> list[dict]:
    """The report's sample prompts, fixed before training: the first held-out ones when there are.
    Their responses are greedy, the policy's best guess, so before and after compare the policy
    rather than two draws."""
    return (trainer.eval_records or trainer.records)[:SAMPLE_COUNT]


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
        export_checkpoint(str(final_checkpoint), str(model_dir), trainer.recipe.registry, merge_lora=True)
    else:
        trainer.policy.save_pretrained(str(model_dir), merge_adapters=True)
    tracker.log_model(str(model_dir))
    tracker.log_artifact(str(trainer.metrics_log.path))
    curves = plot_curves(history, Path(trainer.output_dir) / "curves.png")
    if curves:
        tracker.log_artifact(str(curves))
    return final_checkpoint
