"""The peer on the tool task: TRL's GRPOTrainer with `environment_factory` on `cheapest-item`.

    python benchmarks/trl_tool_task.py --seed 0                  # TRL's defaults
    python benchmarks/trl_tool_task.py --seed 0 --update rlkit   # rlkit's update: 4 minibatches × 4 passes, constant lr

Same warm start, training puzzles, held-out puzzles and budget as `recipes/ppo_tool_qwen3.toml`
(64 episodes a round: 8 puzzles × 8 episodes; learning rate 1e-4, gradients clipped at 1.0,
temperature 1, at most 6 turns of 32 tokens and 256 tokens after the prompt). The environment is
the plugin's own `CheapestItem` behind TRL's class protocol: each `price` call goes through its
`step`, so calls, costs and tool messages are rlkit's, and the reward is its `answer` on the last
turn read by rlkit's chat format (0 when the episode never answered). The model is saved before
training and every `--every` rounds, and each save is scored by rlkit's own held-out evaluation
(`rlkit_core.runtime.evaluation.Evaluator`): the figures are comparable with the recipe's
`eval/solved` to the last digit, and the first line (round 0) is the warm start's. Prints one JSON
line per save, then the median seconds a round. Needs `trl` (the test extra); runs offline.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from pathlib import Path

import tomllib
import torch

from rlkit_core.chat_format import episode_format
from rlkit_core.messages import Reply, ToolCall
from rlkit_core.recipe.document import parse_recipe
from rlkit_core.recipe.plugins import load_registry
from rlkit_core.runtime.evaluation import Evaluator
from rlkit_core.runtime.trainer import Trainer

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "ppo_tool_qwen3.toml"
UPDATES = {
    # TRL's defaults: one optimiser step on a round's 64 episodes, the learning rate decaying to 0
    "trl": {"per_device_train_batch_size": 64, "steps_per_generation": 1, "num_iterations": 1, "lr_scheduler_type": "linear"},
    # the recipe's update: 4 minibatches of 16, 4 passes over each round, a constant learning rate
    "rlkit": {"per_device_train_batch_size": 16, "steps_per_generation": 4, "num_iterations": 4, "lr_scheduler_type": "constant"},
}


def recipe_document(seed: int, overrides: list[str]) -> dict:
    document = tomllib.loads(RECIPE.read_text())
    document["run"]["seed"] = seed
    document["tracker"] = {"type": "none"}
    for override in overrides:  # table.key=value, the value in TOML
        key, value = override.split("=", 1)
        table, name = key.rsplit(".", 1)
        document[table][name] = tomllib.loads(f"v = {value}")["v"]
    return document


def held_out_figures(document: dict, model_dir: Path, registry) -> dict[str, float]:
    """rlkit's held-out evaluation of the model in `model_dir`, with the recipe's settings."""
    document = copy.deepcopy(document)
    document["policy"] = {"type": "hf", "model": str(model_dir)}
    trainer = Trainer(parse_recipe(document, registry))
    figures = Evaluator(trainer.recipe, trainer.engine, trainer.components, trainer.context, trainer.prompts)()
    return {name: figures[name] for name in ("eval/solved", "eval/optimal", "eval/score", "eval/tool_calls", "eval/malformed_tool_calls")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--update", choices=sorted(UPDATES), default="trl")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--every", type=int, default=5, help="save and evaluate every this many rounds")
    parser.add_argument("--out", default="runs/trl_tool_task")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the recipe's runs were timed with 1)")
    parser.add_argument("--set", action="append", default=[], help="a recipe value, table.key=value (e.g. eval.size=16)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.manual_seed(args.seed)
    document, registry = recipe_document(args.seed, [f"run.threads={args.threads}", *args.set]), load_registry()
    base = Trainer(parse_recipe(copy.deepcopy(document), registry))  # builds (or finds) the warm start
    policy, task = base.components.policy, base.components.environment  # the plugin's CheapestItem
    environment_config = base.recipe["environment"].config
    chat = episode_format(environment_config, policy.tokenizer, policy.eos_token_ids, registry)[0]  # reads a turn as the runner does
    tokenizer, tools = policy.tokenizer, task.tools()
    out = Path(args.out) / f"{args.update}-s{args.seed}"
    out.mkdir(parents=True, exist_ok=True)
    limits = {"turns": environment_config.max_turns, "tokens": environment_config.max_episode_tokens,
              "turn_tokens": base.recipe["generator"].config.max_new_tokens}
    assistant = tokenizer("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]

    class CheapestItemForTRL:
        """The plugin's environment behind TRL's protocol: `reset` with the dataset's columns, one method a tool."""

        def reset(self, prompt=None, prices=None, **_):
            self.episode = task.reset({"prompt": prompt[-1]["content"], "prices": list(prices)}, 0).state

        def price(self, position: int):  # no return annotation: the schema would gain a "return" rlkit's has not
            """Look up the price of one item.

            Args:
                position: the item's position in the question, 1 for the first
            """
            step = task.step(self.episode, Reply(text="", turn=0, tool_calls=[ToolCall("price", {"position": position})]))
            return step.messages[0]["content"]

    def last_turn(ids: list[int]) -> list[int]:
        for start in range(len(ids) - len(assistant), -1, -1):
            if ids[start:start + len(assistant)] == assistant:
                return ids[start + len(assistant):]
        return ids

    def reward(completions, completion_ids, environments, **_):
        scores = []
        for messages, ids, env in zip(completions, completion_ids, environments):
            final, ended = messages[-1] if messages else {}, bool(ids) and ids[-1] in policy.eos_token_ids
            reply = chat.read(last_turn(list(ids)), 0, tools)
            answered = final.get("role") == "assistant" and not final.get("tool_calls") and ended and not reply.parse_error
            scores.append(float(task.step(env.episode, reply).reward or 0.0) if answered and not reply.tool_calls else 0.0)
        return scores

    steps_per_round = UPDATES[args.update]["steps_per_generation"] * UPDATES[args.update]["num_iterations"]
    saved: list[tuple[int, Path]] = []

    def save(round_: int, model) -> None:
        path = out / f"round{round_}"
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
        settings = json.loads((path / "config.json").read_text())
        settings["use_cache"] = True  # TRL's gradient checkpointing turned it off in the saved config
        (path / "config.json").write_text(json.dumps(settings))
        saved.append((round_, path))

    class Rounds(TrainerCallback):
        def __init__(self):
            self.seconds, self.started = [], time.perf_counter()

        def on_step_end(self, _args, state, _control, model=None, **__):
            if state.global_step % steps_per_round == 0:
                self.seconds.append(time.perf_counter() - self.started)
                self.started = time.perf_counter()
                if (state.global_step // steps_per_round) % args.every == 0:
                    save(state.global_step // steps_per_round, model)

    train = Dataset.from_list([{"prompt": [{"role": "user", "content": r["prompt"]}], "prices": r["prices"]} for r in base.prompts.train])
    config = GRPOConfig(
        output_dir=str(out / "trainer"), seed=args.seed, use_cpu=True, bf16=False, report_to="none", save_strategy="no",
        logging_steps=1, num_generations=8, gradient_accumulation_steps=1, max_steps=args.rounds * steps_per_round,
        learning_rate=base.recipe.optim.learning_rate, max_grad_norm=base.recipe.optim.max_grad_norm, temperature=1.0,
        max_completion_length=limits["tokens"], generation_kwargs={"max_new_tokens": limits["turn_tokens"]},
        max_tool_calling_iterations=limits["turns"] - 1, **UPDATES[args.update])
    rounds = Rounds()
    trainer = GRPOTrainer(model=copy.deepcopy(policy.model), reward_funcs=reward, args=config, train_dataset=train,
                          processing_class=tokenizer, environment_factory=CheapestItemForTRL, callbacks=[rounds])
    save(0, trainer.model)
    trainer.train()
    del base
    for round_, path in saved:
        print(json.dumps({"update": args.update, "seed": args.seed, "round": round_, **held_out_figures(document, path, registry)}), flush=True)
    print(json.dumps({"update": args.update, "seed": args.seed, "median_seconds_a_round": statistics.median(rounds.seconds)}), flush=True)


if __name__ == "__main__":
    main()
