"""A tool task on a real model family's chat template: the `cheapest-item` environment, its puzzles
(`cheapest-item-puzzles`), and a tiny Qwen3-architecture chat model warm-started on played
transcripts (`warm-start-tool-chat`). Everything is made here, offline, but the chat template,
which is read from an installed package (`trl` ships the real templates of the families).

A puzzle names two or three items; the model looks up each one's price by its position in the
question with the typed `price` tool (one call a turn), then answers with the cheapest one's
position. Reward: 1 when the answer is the cheapest, less `call_cost` for every call beyond the
fewest (one per item); 0 otherwise. Positions, not names, so that a tiny model's calls need no
copying from the question: what PPO has to improve is which calls it makes and the answer.

The warm start is supervised on transcripts played carelessly, as demonstrations written in a
hurry are: some skip an item's lookup and answer from the prices seen, some look an item up twice,
some answer a wrong position. The transcripts are played through the core's chat format on the real
template, so the warm start sees exactly the ids its episodes will be made of; it writes no think
block, so on Qwen3's template its episodes never split. Its byte-level BPE is trained on rendered
transcripts, so the template's boilerplate is a few tokens.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs

from rlkit_core import (
    PromptSource,
    RecipeError,
    Reset,
    StandardEpisode,
    Step,
    ToolEnvironment,
    at_least,
    between,
    building_at,
    chat_format_for,
    greater_than,
    hookimpl,
    setting,
    tool,
)

from .warm_start import Example, WarmStartConfig, WarmStartPolicy

ITEMS = ("apple", "pear", "fig", "plum", "lime", "kiwi", "mango", "peach", "grape", "melon")
CONTEXT = 640  # positions of the chat model: the longest careless transcript fits
SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
TAGS = ("<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")  # plain added tokens, as Qwen's


def question(items: Sequence[str]) -> str:
    listed = [f"{position} {item}" for position, item in enumerate(items, 1)]
    return f"Which is cheapest: {', '.join(listed[:-1])} or {listed[-1]}? Look up each price by its position, then answer with the cheapest's."


@attrs.frozen
class CheapestItemConfig(StandardEpisode):
    max_turns: int = setting(6, help="turns before the episode ends unanswered (the fewest: one per item, then the answer)",
                             validator=greater_than(0))
    call_cost: float = setting(0.1, help="reward lost for each price call beyond one per item", validator=at_least(0))


@attrs.define
class Shop:
    prices: list[int]  # by position in the question, from 1
    calls: int = 0

    @property
    def cheapest(self) -> int:
        return self.prices.index(min(self.prices)) + 1


class CheapestItem(ToolEnvironment):
    """Look up each item's price, then name the cheapest (see the module)."""

    def __init__(self, config: CheapestItemConfig, context=None):
        self.config = config
        self.where = building_at(context, "environment")

    def start(self, record, seed):
        prices = record.get("prices")
        if not isinstance(prices, list) or len(prices) < 2 or not all(isinstance(v, int) for v in prices):
            raise RecipeError([f"{self.where}: a record's 'prices' column is {prices!r}, not a list of two or more whole-number "
                               "prices (by position); use the cheapest-item-puzzles data"])
        return Reset([{"role": "user", "content": str(record["prompt"])}], Shop(list(prices)))

    @tool
    def price(self, state: Shop, position: int) -> int:
        """Look up the price of one item.

        Args:
            position: the item's position in the question, 1 for the first
        """
        state.calls += 1
        if not 1 <= position <= len(state.prices):
            raise IndexError(f"no item at position {position}; the positions are 1 to {len(state.prices)}")
        return state.prices[position - 1]

    def answer(self, state: Shop, reply):
        numbers = re.findall(r"\d+", reply.text)
        solved = bool(numbers) and int(numbers[-1]) == state.cheapest
        extra = max(0, state.calls - len(state.prices))
        reward = max(0.0, 1.0 - self.config.call_cost * extra) if solved else 0.0
        return Step(reward=reward, done=True, info={"solved": float(solved), "optimal": float(solved and extra == 0)})

    def info(self, state):
        return {"solved": 0.0, "optimal": 0.0}


@attrs.frozen
class PuzzlesConfig:
    size: int = setting(4096, help="puzzles to generate", validator=greater_than(0))
    seed: int = setting(0, help="seed of the puzzles (the same seed gives the same puzzles)")
    max_items: int = setting(3, help="items of a puzzle at most (at least 2)", validator=between(2, len(ITEMS)))


def random_puzzle(rng: random.Random, max_items: int) -> dict[str, Any]:
    items = rng.sample(ITEMS, rng.randint(2, max_items))
    return {"prompt": question(items), "prices": rng.sample(range(1, 10), len(items))}  # distinct: one cheapest


class Puzzles(PromptSource):
    def __init__(self, config: PuzzlesConfig, context=None):
        self.config = config

    def load(self):
        rng = random.Random(f"cheapest/{self.config.seed}")
        return [random_puzzle(rng, self.config.max_items) for _ in range(self.config.size)]


# --- the warm start ------------------------------------------------------------------------------

def installed_template(name: str) -> str:
    """The chat template `name` (e.g. "qwen3") as the installed `trl` ships it, in `chat_templates/`."""
    try:
        import trl
    except ImportError:
        raise RecipeError([f"$.policy.chat_template: {name!r} is read from the templates the `trl` package ships, and trl is not "
                           "installed; pip install trl (or the project's test extra)"]) from None
    path = Path(trl.__file__).parent / "chat_templates" / f"{name}.jinja"
    if not path.is_file():
        known = sorted(p.stem for p in path.parent.glob("*.jinja"))
        raise RecipeError([f"$.policy.chat_template: trl ships no template {name!r}; it has {', '.join(known)}"])
    return path.read_text()


def call_text(position: int) -> str:
    """A price call as Qwen-family templates render it (JSON in tool-call tags)."""
    return f'<tool_call>\n{{"name": "price", "arguments": {{"position": {position}}}}}\n</tool_call>'


def careless_turns(rng: random.Random, puzzle: dict[str, Any], skip: float, repeat: float, wrong: float) -> list[str]:
    """What a hurried demonstrator writes, turn by turn: a call per item in the question's order
    (with probability `skip` one item after the first is never looked up, with `repeat` one is
    looked up twice), then the position of the cheapest of the prices seen (with `wrong`, another)."""
    prices = puzzle["prices"]
    positions = list(range(1, len(prices) + 1))
    looked = list(positions)
    if rng.random() < skip:
        looked.pop(rng.randrange(1, len(looked)))
    if rng.random() < repeat:
        at = rng.randrange(len(looked))
        looked.insert(at + 1, looked[at])
    named = min(looked, key=lambda position: prices[position - 1])
    if rng.random() < wrong:
        named = rng.choice([position for position in positions if position != named])
    return [call_text(position) for position in looked] + [f"The cheapest is item {named}."]


def transcript_examples(tokenizer, template_tools: list[dict], size: int, seed: int, skip: float, repeat: float, wrong: float,
                        max_items: int = 3) -> list[Example]:
    """Careless transcripts played as episodes are (the core's chat format on the tokenizer's
    template): sampled turns counted by the loss, everything rendered between them not."""
    rng = random.Random(f"sft/{seed}")
    ends = (tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.convert_tokens_to_ids("<|endoftext|>"))
    chat = chat_format_for("template", tokenizer, ends)
    examples = []
    for _ in range(size):
        puzzle = random_puzzle(rng, max_items)
        history: list[dict] = [{"role": "user", "content": puzzle["prompt"]}]
        ids = chat.opening(history, template_tools)
        counted = [False] * len(ids)
        for turn, text in enumerate(careless_turns(rng, puzzle, skip, repeat, wrong), 1):
            sampled = chat.encode(text) + [ends[0]]
            ids, counted = ids + sampled, counted + [True] * len(sampled)
            reply = chat.read(sampled, turn)
            history.append(chat.assistant_message(reply))
            if not reply.tool_calls:
                break
            position = reply.tool_calls[0].arguments["position"]
            answer = [{"role": "tool", "name": "price", "content": str(puzzle["prices"][position - 1])}]
            bridge = chat.bridge(ids, history, answer, template_tools)
            if bridge is None:
                raise ValueError("the template rewrote a careless transcript's history: its warm start would train on what "
                                 "episodes never see")
            history += answer
            ids, counted = ids + bridge, counted + [False] * len(bridge)
        examples.append((ids, counted))
    return examples


def chat_model_maker(template: str, tools: list[Any], vocab_size: int) -> Callable[[int, int, int], tuple[Any, Any]]:
    """`build_warm_start`'s `make` for a chat model: a byte-level BPE of `vocab_size` trained on
    transcripts rendered with `template`, with Qwen's special tokens, and a fresh Qwen3 model."""

    def make(n_layer: int, n_embd: int, n_head: int):
        from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
        from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

        def tokenizer_of(backend):
            return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                           chat_template=template)

        backend = Tokenizer(models.BPE())
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        backend.decoder = decoders.ByteLevel()
        rng = random.Random("tokenizer")
        renderer = tokenizer_of(backend)  # renders text only: no vocabulary needed yet
        texts = []
        for _ in range(400):
            puzzle = random_puzzle(rng, 3)
            conversation: list[dict] = [{"role": "user", "content": puzzle["prompt"]}]
            for position, price in enumerate(puzzle["prices"], 1):
                conversation += [{"role": "assistant", "content": "", "tool_calls": [
                    {"type": "function", "function": {"name": "price", "arguments": {"position": position}}}]},
                    {"role": "tool", "name": "price", "content": str(price)}]
            conversation.append({"role": "assistant", "content": f"The cheapest is item {position}."})
            texts.append(renderer.apply_chat_template(conversation, tools=tools, tokenize=False))
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL), show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        backend.train_from_iterator(texts, trainer)
        backend.add_tokens([AddedToken(tag, special=False, normalized=False) for tag in TAGS])
        tokenizer = tokenizer_of(backend)
        end, pad = backend.token_to_id("<|im_end|>"), backend.token_to_id("<|endoftext|>")
        config = Qwen3Config(vocab_size=len(tokenizer), hidden_size=n_embd, intermediate_size=3 * n_embd, num_hidden_layers=n_layer,
                             num_attention_heads=n_head, num_key_value_heads=n_head, head_dim=n_embd // n_head,
                             max_position_embeddings=CONTEXT, tie_word_embeddings=True, eos_token_id=end, pad_token_id=pad,
                             bos_token_id=None)
        model = Qwen3ForCausalLM(config)
        model.generation_config.eos_token_id = [end, pad]  # as Qwen's: the end of a turn, or of a text
        model.generation_config.pad_token_id = pad
        return tokenizer, model

    return make


@attrs.frozen
class ToolChatConfig(WarmStartConfig):
    chat_template: str = setting("qwen3", help="the model family's chat template, by its name among those trl ships (qwen3, qwen2_5, ...)")
    vocab_size: int = setting(1024, help="size of the byte-level BPE trained on rendered transcripts", validator=greater_than(300))
    sft_steps: int = setting(600, help="supervised steps on careless transcripts", validator=at_least(0))
    sft_examples: int = setting(3000, help="careless transcripts to supervise on", validator=greater_than(0))
    skip_share: float = setting(0.3, help="share of transcripts that never look one item up", validator=between(0.0, 1.0))
    repeat_share: float = setting(0.2, help="share of transcripts that look one item up twice", validator=between(0.0, 1.0))
    wrong_share: float = setting(0.1, help="share of transcripts that name a wrong item", validator=between(0.0, 1.0))


class WarmStartToolChat(WarmStartPolicy):
    """A tiny Qwen3 chat model supervised on careless transcripts (`transcript_examples`)."""

    @staticmethod
    def folder_name(config) -> str:
        return (f"tool-chat-{config.chat_template}-l{config.n_layer}-d{config.n_embd}-h{config.n_head}-v{config.vocab_size}"
                f"-s{config.sft_steps}-seed{config.seed}")

    @staticmethod
    def corpus(config) -> dict:
        return {"corpus": "cheapest-item-positions", "chat_template": config.chat_template, "vocab_size": config.vocab_size,
                "shares": [config.skip_share, config.repeat_share, config.wrong_share], "examples": config.sft_examples}

    @staticmethod
    def examples(config, tokenizer, size: int, seed: int) -> list[Example]:
        return transcript_examples(tokenizer, CheapestItem(CheapestItemConfig()).tools(), config.sft_examples, seed,
                                   config.skip_share, config.repeat_share, config.wrong_share)

    @staticmethod
    def model_maker(config):
        return chat_model_maker(installed_template(config.chat_template), CheapestItem(CheapestItemConfig()).tools(),
                                config.vocab_size)


@hookimpl
def register_environments(register):
    register("cheapest-item", CheapestItem, CheapestItemConfig)


@hookimpl
def register_prompt_sources(register):
    register("cheapest-item-puzzles", Puzzles, PuzzlesConfig)


@hookimpl
def register_policies(register):
    register("warm-start-tool-chat", WarmStartToolChat, ToolChatConfig)
