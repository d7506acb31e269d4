"""What the first update does to an agent's tool calls, on one recorded batch.

    python benchmarks/first_update.py --set advantage.lam=0.95 --set advantage.lam=1.0

Builds the tool recipe's trainer (recipes/ppo_tool_qwen3.toml, the cached warm start), plays
iteration 1's episodes once, and for each setting given (each `--set` a variant of the recipe,
compared on the same recorded batch, from the same weights) estimates the advantages and runs
iteration 1's update. Prints one JSON line per setting:

- `tool_advantage_solved`: the mean advantage of the tool-call turns' tokens in solved episodes,
  and `negative_share_solved`, the share of those tokens whose advantage is below 0 (the update
  pushes their probability down although the episode was solved);
- `tool_logprob_change_solved` / `_failed`: the change of the mean log-probability of those tokens
  (and of the failed episodes') from before to after the update: what the update did to the
  policy's own sampled behaviour, not only to the ratio on the old samples;
- `approx_kl`: the update's own figure.
"""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path

import tomllib
import torch

from rlkit_core.recipe.document import parse_recipe
from rlkit_core.recipe.plugins import load_registry
from rlkit_core.runtime import rollout, targets, update
from rlkit_core.runtime.forward import response_view, rows_of
from rlkit_core.runtime.trainer import Trainer

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "ppo_tool_qwen3.toml"


def tool_turn_mask(batch, call_id: int) -> torch.Tensor:
    """[B, R] bool: the counted tokens of the turns whose ids hold the tool-call tag."""
    mask = batch.loss_mask.bool()
    marked = torch.zeros_like(mask)
    for row in range(len(batch)):
        counted = mask[row].nonzero().squeeze(1).tolist()
        turn: list[int] = []
        for position in counted + [None]:
            if position is not None and (not turn or position == turn[-1] + 1):
                turn.append(position)
                continue
            if turn and (batch.response_ids[row, turn] == call_id).any():
                marked[row, turn] = True
            turn = [position] if position is not None else []
    return marked


def logprobs_of(trainer: Trainer, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """([B, R] log-probs of the sampled tokens, [B, R, V] log-probs of every token) under the current weights."""
    with torch.no_grad():
        logprobs, _, _, logits = response_view(trainer.components, batch, rows_of(batch, trainer.recipe.ppo.pack_sequences), grad=False)
        assert logits is not None  # a forward without a gradient keeps them
    return logprobs, torch.log_softmax(logits.float() / trainer.components.generator.temperature, dim=-1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default=str(RECIPE))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--set", action="append", default=[], help="a variant: table.key=value (TOML value)")
    args = parser.parse_args()
    document = tomllib.loads(Path(args.recipe).read_text())
    document["run"]["seed"] = args.seed
    document["tracker"] = {"type": "none"}
    registry = load_registry()
    base = Trainer(parse_recipe(copy.deepcopy(document), registry))
    records = base.stream_records(0)
    batch, metrics = rollout.rollout(base.engine, base.components, base.recipe, records, base.recipe.ppo.samples_per_prompt,
                                     base.prompts.max_tokens)
    weights = copy.deepcopy(base.components.policy.state_dict())
    head = copy.deepcopy(base.components.value_head.state_dict()) if base.components.value_head is not None else None
    call_id = base.components.policy.tokenizer.convert_tokens_to_ids("<tool_call>")
    tools = tool_turn_mask(batch, call_id)
    solved = (batch.scores > 0.5).unsqueeze(1)
    print(json.dumps({"episodes": len(batch), "solved": float(solved.float().mean()), "env/tool_calls": metrics.get("env/tool_calls"),
                      "env/splits": metrics.get("env/splits")}))
    for variant in ["(recipe)"] + args.set:
        changed = copy.deepcopy(document)
        if variant != "(recipe)":
            key, value = variant.split("=", 1)
            table, name = key.split(".", 1)
            changed.setdefault(table, {})[name] = tomllib.loads(f"v = {value}")["v"]
        trainer = Trainer(parse_recipe(changed, registry))
        trainer.components.policy.load_state_dict(copy.deepcopy(weights))
        if head is not None and trainer.components.value_head is not None:
            trainer.components.value_head.load_state_dict(copy.deepcopy(head))
        aimed = targets.with_advantages(trainer.engine, trainer.components, trainer.recipe, batch, trainer.observe)
        before, whole_before = logprobs_of(trainer, aimed)
        updated = update.update(trainer.engine, trainer.components, trainer.recipe, aimed, trainer.state, trainer.observe)
        after, whole_after = logprobs_of(trainer, aimed)
        good, bad = tools & solved, tools & ~solved
        advantages = aimed.advantages
        # the exact KL(π_old ‖ π_new) of every tool-call position's whole next-token distribution, summed over an
        # episode's tool-call tokens (the change of what it will sample there), and the mass off the likeliest token
        exact = (whole_before.exp() * (whole_before - whole_after)).sum(-1)
        off_before, off_after = 1 - whole_before.exp().amax(-1), 1 - whole_after.exp().amax(-1)
        per_episode = tools.float().sum() / len(batch)
        print(json.dumps({
            "variant": variant,
            "tool_advantage_solved": round(float(advantages[good].mean()), 4),
            "negative_share_solved": round(float((advantages[good] < 0).float().mean()), 4),
            "answer_advantage_solved": round(float(advantages[aimed.loss_mask.bool() & ~tools & solved].mean()), 4),
            "tool_logprob_change_solved": round(float((after - before)[good].mean()), 4),
            "tool_logprob_change_failed": round(float((after - before)[bad].mean()), 4) if bad.any() else None,
            "approx_kl": round(updated.metrics.get("train/approx_kl", float("nan")), 5),
            "tool_exact_kl_per_episode": round(float(exact[tools].mean() * per_episode), 4),
            "tool_off_mass_per_episode": [round(float(off_before[tools].mean() * per_episode), 3),
                                          round(float(off_after[tools].mean() * per_episode), 3)],
        }))


if __name__ == "__main__":
    main()
