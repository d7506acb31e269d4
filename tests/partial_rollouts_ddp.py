"""Run by tests/test_partial_rollouts.py under `torchrun --nproc_per_node 2`: a multi-turn recipe
with `[scheduler] partial_rollouts` and a slow environment (`SlowGuessNumber`) trains a few
iterations, each process with its own workers. Writes `<out>/versions.json` from the main process:
for every process and iteration, the trained batch's staleness and the versions its sampled tokens
carry."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1]))  # `tests.`, importable here and in the worker processes spawned from here

from rlkit_core.launch import Launch  # noqa: E402
from rlkit_core.recipe.document import parse_recipe  # noqa: E402
from rlkit_core.runtime.trainer import Trainer  # noqa: E402
from tests.test_partial_rollouts import slow_registry  # noqa: E402


def main(document_path: str, out: str) -> None:
    document = json.loads(Path(document_path).read_text())
    launch = Launch.from_environment()
    trainer = Trainer(parse_recipe(document, slow_registry(), launch=launch), launch=launch)
    taken, rollouts = [], trainer._rollouts

    def recorded(iteration):
        batch, metrics = rollouts(iteration)
        assert batch.sampled_versions is not None
        sampled = batch.sampled_versions[batch.sampled_versions >= 0]
        taken.append({"iteration": iteration, "staleness": metrics["async/staleness"], "versions": sorted(set(sampled.tolist()))})
        return batch, metrics

    trainer._rollouts = recorded
    try:
        for _ in range(trainer.recipe.run.steps):
            trainer.iterate()
    finally:
        trainer.close()
    everywhere = trainer.engine.processes.gather_objects(taken)
    if trainer.engine.processes.is_main:
        Path(out, "versions.json").write_text(json.dumps(everywhere))
    trainer.engine.processes.exit_together()


if __name__ == "__main__":
    main(*sys.argv[1:])
