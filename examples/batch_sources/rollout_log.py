"""Batch source `rollout-log`: the batches the core would sample, each row also written to a JSONL
file, for reading what the policy said at every iteration of a run.

A batch source plugin in one module: a `BatchSource` subclass, its settings as an attrs class, and
a `register_batch_sources` hook. Put the module on an entry point of the `rlkit` group (for example
`rollout-log = "my_package.rollout_log"`) and a recipe picks it in a table of its own:

    [batch_source]
    type = "rollout-log"
    path = "rollouts.jsonl"

It samples through the view the trainer gives it (`view.rollout(iteration)`, the prompt stream's
batch of that iteration, sampled now by the weights that train on it), so a run trains exactly as
without it and keeps every prompt once, in order, across a resume. A resumed run appends. Under
several processes each writes the rows of its own share, process k (from 1) to `rollouts-k.jsonl`
beside process 0's `rollouts.jsonl`.
"""

import json
from pathlib import Path

import attrs

from rlkit_core import BatchSource, hookimpl, setting


@attrs.frozen
class RolloutLogConfig:
    path: str = setting("rollouts.jsonl", help="the JSONL file the rows go to, relative to run.output_dir")


class RolloutLog(BatchSource):
    def __init__(self, config, context):
        self.path = Path(context.output_dir) / config.path
        self.tokenizer = context.policy.tokenizer

    def take(self, iteration, view):
        batch, metrics = view.rollout(iteration)
        process = view.engine.processes.index
        path = self.path.with_stem(f"{self.path.stem}-{process}") if process else self.path
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as log:
            for row, prompt in enumerate(batch.prompts):
                response = self.tokenizer.decode(batch.response_ids[row][batch.response_mask[row].bool()], skip_special_tokens=True)
                line = {"iteration": iteration + 1, "prompt": prompt, "response": response, "score": float(batch.scores[row])}
                log.write(json.dumps(line) + "\n")
        return batch, metrics


@hookimpl
def register_batch_sources(register):
    register("rollout-log", RolloutLog, RolloutLogConfig)
