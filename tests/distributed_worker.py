"""Run by tests/test_scaling.py, as one process or under `torchrun --nproc_per_node 2` (under FSDP
through tests/fsdp_on_cpu.py):

1. every process draws the same global rollout batch (same seed everywhere), keeps its share,
   and trains on it once: the weights must be identical on every process and equal those of one
   process that trained on the whole batch;
2. an ordinary iteration, after which every process must hold the same weights again.

Writes `<out>/result-<processes>.json` from the main process: the flat weights before and after step 1, the
update's metrics, and whether the weights agreed everywhere after each of the two.
"""

import json
import sys
from pathlib import Path

import torch

from rlkit_core.launch import Launch
from rlkit_core.recipe.document import parse_recipe
from rlkit_core.recipe.plugins import load_registry
from rlkit_core.runtime import rollout, targets, update
from rlkit_core.runtime.trainer import Trainer


def flat_weights(trainer) -> torch.Tensor:
    """Every trained weight, whole (under FSDP a process holds shards; they are gathered here)."""
    with trainer.engine.full_weights():
        critic = trainer.components.value_head.parameters() if trainer.components.value_head is not None else []
        return torch.cat([p.detach().flatten().clone() for p in [*trainer.components.policy.parameters(), *critic]])


def held_share(trainer) -> float:
    """The fraction of the trained weights this process holds: 1, or under FSDP its shards' share."""
    held = sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in trainer.engine.parameters)
    return held / len(flat_weights(trainer))


def same_everywhere(trainer) -> bool:
    weights = trainer.engine.processes.gather_objects(flat_weights(trainer))
    return all(torch.equal(weights[0], w) for w in weights)


def main(document_path: str, out: str) -> None:
    document = json.loads(Path(document_path).read_text())
    launch = Launch.from_environment()  # torchrun's, with the FSDP variables under tests/fsdp_on_cpu.py
    trainer = Trainer(parse_recipe(document, load_registry(environ={"RLKIT_PLUGINS": "none"}), launch=launch), launch=launch)
    processes = trainer.engine.processes

    start, held = flat_weights(trainer), held_share(trainer)
    computed_in = set()  # the dtypes the policy's head computed in: sampling, the no-grad passes, the update
    trainer.components.policy.model.get_output_embeddings().register_forward_hook(lambda module, args, out: computed_in.add(str(out.dtype)))
    torch.manual_seed(1234)  # the same global batch in every process
    engine, components, recipe = trainer.engine, trainer.components, trainer.recipe
    whole, _ = rollout.rollout(engine, components, recipe, trainer.stream.batch(0), recipe.ppo.samples_per_prompt, trainer.prompts.max_tokens)
    rows = len(whole) // processes.count
    mine = whole.select(torch.arange(processes.index * rows, (processes.index + 1) * rows))
    update_metrics = update.update(engine, components, recipe, targets.with_advantages(engine, components, recipe, mine), trainer.state).metrics
    weights = flat_weights(trainer)
    agreed = [same_everywhere(trainer)]

    trainer.step()
    agreed.append(same_everywhere(trainer))
    if processes.is_main:
        result = {"start": start.tolist(), "weights": weights.tolist(), "metrics": update_metrics, "agreed": agreed, "held": held,
                  "computed_in": sorted(computed_in)}
        Path(out, f"result-{processes.count}.json").write_text(json.dumps(result))
    processes.exit_together()


if __name__ == "__main__":
    main(*sys.argv[1:])
