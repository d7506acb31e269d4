"""Three ways to sample the turns of episodes whose environment steps take uneven time, on a
random Llama of any size (on a GPU, where a decoding step is dear): `hf`'s continuous loop
(`HFGenerator.serve`: turns join the running decode as they arrive), a `generate` call per group
of turns that arrived together (`Generator.serve`'s default), and the turn barrier (every episode's
turn in one call, then the slowest environment step).

    python benchmarks/serve_modes.py                                   # CPU, a small model
    python benchmarks/serve_modes.py --device cuda --layers 16 --width 1024 --dtype bfloat16

Each episode: a prompt of `--prompt` tokens, `--turns` turns of at most `--new-tokens` sampled
tokens, each followed by an environment step that sleeps (`--slow` seconds for a share `--share`
of the steps, the same steps in every mode, else `--fast`) and appends `--added` tokens. All modes
keep each episode's KV cache between its turns (`continuing_streams`). Prints one JSON line: the
median seconds of the rollout in each mode, and the tokens sampled.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time

import torch
from rlkit_plugins.hf_generator import HFGenerator, HFGeneratorConfig
from rlkit_plugins.hf_policy import HFPolicy, HFPolicyConfig

from rlkit_core import Completion, Generator
from rlkit_core.context import BuildContext
from rlkit_core.functional import left_padded
from rlkit_core.recipe.document import structure_table


class Episodes:
    """`Requests` for `serve`: each episode's next turn arrives once its environment step has slept."""

    def __init__(self, prompts: list[list[int]], args, pad_id: int, device: torch.device):
        self.streams = [list(prompt) for prompt in prompts]
        self.args, self.pad_id, self.device = args, pad_id, device
        self.turn = [0] * len(prompts)
        self.due = {episode: time.monotonic() for episode in range(len(prompts))}  # episode -> when its next turn arrives
        self.sampled = 0

    def delay(self, episode: int, turn: int) -> float:
        return self.args.slow if random.Random(episode * 1000 + turn).random() < self.args.share else self.args.fast

    def added(self, episode: int, turn: int) -> list[int]:
        draw = random.Random(episode * 1000 + turn + 7)
        return [draw.randrange(8, 256) for _ in range(self.args.added)]

    def arrived(self, wait: bool) -> list[tuple[int, list[int]]]:
        if wait and self.due:
            time.sleep(max(0.0, min(self.due.values()) - time.monotonic()))
        now = time.monotonic()
        ready = [episode for episode, at in self.due.items() if at <= now]
        for episode in ready:
            del self.due[episode]
        return [(episode, self.streams[episode]) for episode in ready]

    def completed(self, key: int, completion: Completion) -> None:
        self.sampled += len(completion.ids)
        self.streams[key] += completion.ids + self.added(key, self.turn[key])
        self.turn[key] += 1
        if self.turn[key] < self.args.turns:
            self.due[key] = time.monotonic() + self.delay(key, self.turn[key] - 1)


def barrier(generator: HFGenerator, episodes: Episodes) -> None:
    """Every episode's turn in one call, then the environment steps side by side: the slowest one."""
    for turn in range(episodes.args.turns):
        ids, mask = left_padded(episodes.streams, episodes.pad_id, episodes.device)
        generation = generator.generate(ids, mask)
        for episode, completion in enumerate(generation.completions()):
            episodes.completed(episode, completion)
        if turn + 1 < episodes.args.turns:
            time.sleep(max(episodes.delay(episode, turn) for episode in range(len(episodes.streams))))
    episodes.due.clear()


def build(args) -> HFGenerator:
    from transformers import ByT5Tokenizer, LlamaConfig, LlamaForCausalLM

    folder = tempfile.mkdtemp(prefix="rlkit-bench-serve-")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=384, hidden_size=args.width, intermediate_size=4 * args.width, num_hidden_layers=args.layers,
                         num_attention_heads=args.heads, num_key_value_heads=args.heads, max_position_embeddings=4096,
                         bos_token_id=1, eos_token_id=1, pad_token_id=0)
    LlamaForCausalLM(config).save_pretrained(folder)
    ByT5Tokenizer().save_pretrained(folder)
    settings, problems = structure_table({"model": folder, "dtype": args.dtype}, HFPolicyConfig, "policy")
    assert not problems, problems
    context = BuildContext(recipe=None, device=torch.device(args.device), output_dir=folder, seed=0)
    policy = HFPolicy(settings, context)
    context = BuildContext(recipe=None, device=torch.device(args.device), output_dir=folder, seed=0, policy=policy)
    return HFGenerator(HFGeneratorConfig(max_new_tokens=args.new_tokens), context)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--episodes", type=int, default=64)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--added", type=int, default=16)
    parser.add_argument("--fast", type=float, default=0.05)
    parser.add_argument("--slow", type=float, default=0.25)
    parser.add_argument("--share", type=float, default=0.1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--modes", default="continuous,call per group,barrier")
    args = parser.parse_args()
    generator = build(args)
    pad, device = generator.policy.tokenizer.pad_token_id, torch.device(args.device)
    prompts = [[random.Random(e).randrange(8, 256) for _ in range(args.prompt)] for e in range(args.episodes)]
    modes = {"continuous": lambda episodes: generator.serve(episodes),
             "call per group": lambda episodes: Generator.serve(generator, episodes),
             "barrier": lambda episodes: barrier(generator, episodes)}
    modes = {name: modes[name] for name in args.modes.split(",")}
    seconds: dict[str, list[float]] = {name: [] for name in modes}
    sampled = {}
    for _ in range(args.repeats + 1):  # the first round warms the kernels up and is not counted
        for name, play in modes.items():
            episodes = Episodes(prompts, args, pad, device)
            if device.type == "cuda":
                torch.cuda.synchronize()
            started = time.perf_counter()
            with generator.continuing_streams():
                play(episodes)
            if device.type == "cuda":
                torch.cuda.synchronize()
            seconds[name].append(time.perf_counter() - started)
            sampled[name] = episodes.sampled
    report = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "dtype": args.dtype,
              "parameters_m": round(sum(p.numel() for p in generator.policy.model.parameters()) / 1e6, 1),
              **{k: getattr(args, k) for k in ("episodes", "turns", "prompt", "new_tokens", "added", "fast", "slow", "share")},
              "seconds": {name: round(statistics.median(values[1:]), 3) for name, values in seconds.items()},
              "tokens_sampled": sampled}
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
