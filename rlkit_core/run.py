"""`rlkit run`: a recipe from start to report, with the tracker and metrics.jsonl kept in step."""

from __future__ import annotations

import sys
import time

from rlkit_core import __version__
from rlkit_core.inventory import flatten, inventory_rows
from rlkit_core.recipe import Recipe
from rlkit_core.report import print_report
from rlkit_core.trainer import Trainer

SAMPLE_COUNT = 3


def run_recipe(recipe: Recipe, quiet: bool = False, out=sys.stdout) -> dict:
    """Train `recipe.run.steps` iterations; returns {'metrics': [...], 'samples': ...} for the report."""
    trainer = Trainer(recipe)
    tracker = trainer.parts.tracker
    inventory = inventory_rows(recipe)
    tags = {"rlkit.version": __version__, **{f"rlkit.plugin.{r['table']}": f"{r['type']} ({r['distribution']} {r['version']})" for r in inventory}}
    tracker.start(run_name=recipe.run.name, params=flatten(recipe.document), tags=tags, resume_id=None)
    trainer.metrics_log.truncate_after(trainer.iteration)

    sample_records = trainer.records[:SAMPLE_COUNT]
    before = trainer.sample_responses(sample_records)
    history = []
    status = "FAILED"
    try:
        while trainer.iteration < recipe.run.steps:
            metrics = trainer.step()
            started = time.perf_counter()
            trainer.metrics_log.append(trainer.iteration, metrics)
            tracker.log_metrics(metrics, step=trainer.iteration)
            if trainer.iteration % recipe.run.sample_every == 0 or trainer.iteration == recipe.run.steps:
                batch = trainer.last_batch
                rows = [{"prompt": p, "response": r, "score": float(s)} for p, r, s in zip(batch.prompts[:4], batch.responses[:4], batch.scores[:4])]
                tracker.log_samples(rows, step=trainer.iteration)
            metrics["time/tracking"] = time.perf_counter() - started
            history.append(metrics)
            if not quiet:
                print(f"iter {trainer.iteration:>4}/{recipe.run.steps}  {metrics['time/iteration']:5.1f}s  "
                      f"score {metrics['score/mean']:.3f}  kl {metrics['kl/ref']:.3f}  beta {metrics['kl/beta']:.4f}",
                      file=sys.stderr, flush=True)
        status = "FINISHED"
    finally:
        tracker.finish(status)
    after = trainer.sample_responses(sample_records)
    samples = [{"prompt": r["prompt"], "before": b, "after": a} for r, b, a in zip(sample_records, before, after)]
    print_report(history, samples, trainer.metrics_log.path, tracker, out=out)
    return {"metrics": history, "samples": samples}
