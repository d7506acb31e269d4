"""Generator `hf`: batched sampling on the policy's own weights, with a decoding loop of rlkit's own.

The loop runs the prompts through the model once, in groups of similar length joined into one KV
cache, then one token per step for the rows still running: a row that ends (an end id, or
`max_new_tokens`) leaves the cache and the step's inputs, so no step computes a finished row
(transformers' `generate`, which this loop replaced, computes every row of a padded batch until
the longest response ends). Sampling is exactly π/T unless the recipe asks otherwise: the
loop applies only the recipe's settings (temperature, top_k, top_p, min_new_tokens, the policy's
suppressed ids), so a hub model's `generation_config.json` never changes what is sampled. The
sampled log-probs come from the scores after all of these, so `check/logprob_gap` (learner vs
sampler) shows any processing that makes the sampler differ from π.

Inside `continuing_streams` (a rollout's episodes) the loop keeps each row's KV cache when the row
ends, keyed by the ids it holds, and a later prompt whose ids begin with a kept row's ids prefills
only the tokens after them: a turn costs its own tokens, not the whole conversation again. The ids
decide, never a render; the block ends before the weights change, and the kept caches with it.

`serve` (the turns of episodes that do not wait on each other) runs one decoding loop for the whole
rollout: between two steps it prefills the prompts that arrived meanwhile and joins them to the
running rows (continuous batching) once they are as many as the rows running, or none runs (a join
is a prefill pass and a copy of the running cache: one per arrival cost more than it saved on a
CPU, benchmarks/README.md), and answers each row the step it ends, so that its episode's
environment step starts while the others decode on.

The random draws of `generate` are generate's: `torch.multinomial(probs, 1)` draws one exponential variate per
row and token (a sample is argmax(p / q), q ~ Exp(1)), so the loop draws q for every row of the call,
finished ones included, and uses the running rows' part. The same seed gives the same tokens as
`generate` did, and leaves the random state where it did (tests/test_hf_generator_loop.py).
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any

import attrs
import torch

from rlkit_core import Completion, Generation, Generator, Requests, StandardSampling, hookimpl
from rlkit_core.functional import left_padded, response_mask

# The prefill runs the prompts in groups of similar length, with at most this share of a group's
# positions padding: a few more forward passes instead of computing a ragged batch's padding.
PREFILL_PADDING = 0.1


@attrs.frozen
class HFGeneratorConfig(StandardSampling):
    """The `hf` generator's settings: the sampling settings, `batch_size` the prompts of one decoding loop."""


def without_padding_columns(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompts without the leading columns that no prompt reaches: positions count real
    tokens only, so generation continues each prompt as it would with them."""
    start = int(prompt_mask.any(dim=0).long().argmax())
    return prompt_ids[:, start:], prompt_mask[:, start:]


def prefill_groups(lengths: list[int], padding: float = PREFILL_PADDING) -> list[int]:
    """Sizes of consecutive groups of `lengths` (longest first) in which padding to the group's
    longest is at most `padding` of the group's positions."""
    sizes, longest, real = [], 0, 0
    for length in lengths:
        if sizes and (sizes[-1] + 1) * longest * (1 - padding) <= real + length:
            sizes[-1], real = sizes[-1] + 1, real + length
        else:
            sizes.append(1)
            longest, real = length, length
    return sizes


def joinable(config) -> bool:
    """Whether the model's KV cache is plain full attention in every layer, so that rows' caches can
    be padded and joined (not sliding windows or linear layers)."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    return all(type(layer) is DynamicLayer for layer in DynamicCache(config=config).layers)


def joined_cache(caches: list, width: int, config):
    """One KV cache for the rows of all `caches` (in order): each group's keys and values
    left-padded with zeros to `width` columns, which the attention mask leaves out."""
    from transformers import DynamicCache

    joined = DynamicCache(config=config)
    for index, layers in enumerate(zip(*(cache.layers for cache in caches))):
        keys, values = ([torch.nn.functional.pad(t, (0, 0, width - t.shape[-2], 0)) for t in tensors]
                        for tensors in zip(*((layer.keys, layer.values) for layer in layers)))
        joined.update(torch.cat(keys), torch.cat(values), index)
    return joined


def forward_options(model) -> tuple[Any, str, dict[str, Any]]:
    """(the transformers model under a peft wrapper, the name of its cache argument, the options of a
    decoding forward pass: a cache, logits at the last position only where the model can)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    accepted = inspect.signature(base.forward).parameters
    cache_name = "cache" if "cache" in accepted else "past_key_values"  # transformers 5 calls it `cache`, 4 `past_key_values`
    options: dict[str, Any] = {"use_cache": True, "logits_to_keep": 1} if "logits_to_keep" in accepted else {"use_cache": True}
    return base, cache_name, options


def without_padding_columns_in_cache(cache, mask: torch.Tensor) -> torch.Tensor:
    """`mask` without the leading columns that no row reaches any more, cut from `cache` alike (rows
    that joined with long prompts have left)."""
    start = int(mask.any(dim=0).long().argmax())
    if start:
        for layer in cache.layers:
            layer.keys, layer.values = layer.keys[:, :, start:], layer.values[:, :, start:]
    return mask[:, start:]


@attrs.frozen
class KeptRow:
    """One row's KV cache as its call left it: per layer (keys, values) [heads, columns, head_dim], and
    `mask` [columns], whose ones are the columns of the ids it was kept under, in order."""

    mask: torch.Tensor
    layers: list[tuple[torch.Tensor, torch.Tensor]]


class KeptStreams:
    """The KV caches of the rows a block's calls sampled, each keyed by the ids whose keys and values
    it holds; a prompt takes the longest kept stream its ids begin with. Each is taken once: the row
    that continues it keeps its own when it ends."""

    def __init__(self):
        self.by_length: dict[int, dict[tuple[int, ...], list]] = {}
        self.reused, self.prompted = 0, 0  # prompt tokens taken from kept caches, and all prompt tokens, this block

    def keep(self, ids: list[int], row) -> None:
        self.by_length.setdefault(len(ids), {}).setdefault(tuple(ids), []).append(row)

    def take(self, ids: list[int]) -> tuple[int, Any] | None:
        """(how many of `ids` it holds, the row) of the longest kept stream that `ids` begin with and
        go past (a prompt needs one token of its own to be prefilled), removed from the kept ones."""
        for length in sorted((n for n in self.by_length if n < len(ids)), reverse=True):
            found = self.by_length[length].get(tuple(ids[:length]))
            if found:
                return length, found.pop()
        return None


class HFGenerator(Generator):
    """Pure temperature sampling by default (no top-k/top-p), so that the sampler is exactly π/T
    and the KL to the reference cannot go negative through truncation."""

    runs_under_fsdp = True  # samples with the policy module, inside the engine

    def __init__(self, config: HFGeneratorConfig, context):
        self.config = config
        self.temperature = config.temperature
        self.policy = context.policy
        # (positions the model computed, real tokens among them), summed over calls: the benchmark's
        # padding share; the real count stays a device tensor (reading it would wait on the device)
        self.positions = (0, 0)
        self.kept: KeptStreams | None = None  # inside `continuing_streams` only
        self.reused = (0, 0)  # (prompt tokens taken from kept caches, all prompt tokens) since the last `pop_metrics`

    @contextlib.contextmanager
    def continuing_streams(self):
        self.kept = KeptStreams()
        try:
            yield
        finally:
            kept, self.kept = self.kept, None
            self.reused = (self.reused[0] + kept.reused, self.reused[1] + kept.prompted)  # till `pop_metrics`

    def pop_metrics(self) -> dict[str, float]:
        (reused, prompted), self.reused = self.reused, (0, 0)
        return {"generate/kept_prefix": reused / prompted} if prompted else {}

    @torch.no_grad()
    def generate(self, prompt_ids, prompt_mask, greedy: bool = False) -> Generation:
        size = self.config.batch_size or len(prompt_ids)  # 0 (or sampling settings alone): all at once
        if size >= len(prompt_ids):
            return self._generate(*without_padding_columns(prompt_ids, prompt_mask), greedy)
        # Chunks of prompts of similar length, longest first, each without the columns that are
        # padding in all its rows. Rows are sampled independently, so the order changes only which
        # random draws a row gets (greedy responses are the same); the results come back in order.
        order = prompt_mask.sum(dim=1).argsort(descending=True, stable=True)
        chunks = [self._generate(*without_padding_columns(prompt_ids[rows], prompt_mask[rows]), greedy) for rows in order.split(size)]
        width, original = max(chunk.response_ids.shape[1] for chunk in chunks), order.argsort()

        def joined(field, pad):
            return torch.cat([torch.nn.functional.pad(getattr(c, field), (0, width - getattr(c, field).shape[1]), value=pad)
                              for c in chunks])[original]

        return Generation(response_ids=joined("response_ids", self.policy.tokenizer.pad_token_id),
                          response_mask=joined("response_mask", 0), logprobs=joined("logprobs", 0.0))

    def _generate(self, prompt_ids, prompt_mask, greedy: bool) -> Generation:
        model = self.policy.model
        pad = self.policy.tokenizer.pad_token_id
        was_training = model.training
        model.eval()
        try:
            response_ids, logprobs = self._decode(model, prompt_ids, prompt_mask, greedy)
        finally:
            model.train(was_training)
        mask = response_mask(response_ids, self.policy.eos_token_ids)
        logprobs = torch.where(mask.bool(), logprobs, 0.0)
        return Generation(response_ids=response_ids * mask + pad * (1 - mask), response_mask=mask, logprobs=logprobs)

    @torch.no_grad()
    def serve(self, requests: Requests, greedy: bool = False) -> None:
        model = self.policy.model
        base, cache_name, options = forward_options(model)
        if not joinable(base.config):  # rows' caches cannot be joined: a generate call per arrival
            return super().serve(requests, greedy)
        was_training = model.training
        model.eval()
        try:
            self._serve(model, base.config, requests, greedy, cache_name, options)
        finally:
            model.train(was_training)

    def _serve(self, model, config, requests: Requests, greedy: bool, cache_name: str, options: dict[str, Any]) -> None:
        """The continuous decoding loop: each pass feeds the running rows their last token, prefills
        the prompts that arrived (once they are as many as the running rows), joins both into one
        cache, samples a token for every row, and answers and drops the rows that ended. Row i of
        the cache, mask and positions is `keys[i]`."""
        ends = torch.tensor(self.policy.eos_token_ids, device=requests.device)
        keys: list[Any] = []
        prompts: list[list[int]] = []  # the rows' prompt ids, under which their caches are kept
        tokens: list[list[int]] = []
        logprobs: list[list[float]] = []
        cache: Any = None
        mask = positions = steps = chosen = torch.empty(0)
        waiting: list[tuple[Any, list[int]]] = []  # arrived, not yet joined
        while True:
            waiting += requests.arrived(wait=not keys and not waiting)
            if not waiting and not keys:
                return
            # newcomers join once they are as many as the rows running (or none runs): each join is a
            # prefill pass and a copy of the running rows' cache, not worth paying for every one
            arrived, waiting = (waiting, []) if len(waiting) >= len(keys) else ([], waiting)
            if keys:
                logits = model(input_ids=chosen[:, None], attention_mask=mask, position_ids=positions, **options, **{cache_name: cache}).logits[:, -1]
                self.positions = (self.positions[0] + len(keys), self.positions[1] + len(keys))
            if arrived:
                new_logits, new_cache, new_mask, order = self._admitted(model, config, [ids for _, ids in arrived], requests, cache_name, options)
                new_positions = (new_mask.long().cumsum(dim=1) - 1)[:, -1:]
                if keys:
                    width = max(mask.shape[1], new_mask.shape[1])
                    cache = joined_cache([cache, new_cache], width, config)
                    mask = torch.cat([torch.nn.functional.pad(m, (width - m.shape[1], 0)) for m in (mask, new_mask)])
                    logits, positions = torch.cat([logits, new_logits]), torch.cat([positions, new_positions])
                    steps = torch.cat([steps, steps.new_zeros(len(order))])
                else:
                    cache, mask, logits, positions = new_cache, new_mask, new_logits, new_positions
                    steps = torch.zeros(len(order), dtype=torch.long, device=requests.device)
                keys += [arrived[i][0] for i in order]
                prompts += [arrived[i][1] for i in order]
                tokens += [[] for _ in order]
                logprobs += [[] for _ in order]
            scores = self._processed(logits.to(dtype=torch.float32, copy=True), steps, greedy)
            if greedy:
                chosen = scores.argmax(dim=-1)
            else:  # torch.multinomial(softmax(scores), 1), as `_decode` draws it
                chosen = (torch.softmax(scores, dim=-1) / torch.empty_like(scores).exponential_()).argmax(dim=-1)
            logprob = torch.log_softmax(scores, dim=-1).gather(-1, chosen[:, None]).squeeze(-1)
            steps = steps + 1
            ended = torch.isin(chosen, ends) | (steps >= self.config.max_new_tokens)
            for row, (token, value) in enumerate(zip(chosen.tolist(), logprob.tolist())):  # the step's tokens read from the device
                tokens[row].append(token)
                logprobs[row].append(value)
            if ended.any():
                at = ended.nonzero().squeeze(1)
                if self.kept is not None:  # the cache holds the prompt and the tokens fed back: all but the last sampled
                    for row, _, kept in self._ending(cache, mask, torch.arange(len(keys)), at, 0):
                        self.kept.keep(prompts[row] + tokens[row][:-1], kept)
                for row in at.tolist():
                    requests.completed(keys[row], Completion(tokens[row], logprobs[row]))
                going = (~ended).nonzero().squeeze(1)
                kept_rows = going.tolist()
                keys, prompts, tokens, logprobs = ([column[i] for i in kept_rows] for column in (keys, prompts, tokens, logprobs))
                if not keys:
                    cache = None
                    continue
                cache.batch_select_indices(going)
                chosen, mask, positions, steps = chosen[going], mask[going], positions[going], steps[going]
                mask = without_padding_columns_in_cache(cache, mask)
            mask, positions = torch.cat([mask, mask.new_ones(len(keys), 1)], dim=1), positions + 1

    def _admitted(self, model, config, prompts: list[list[int]], requests: Requests, cache_name: str, options: dict[str, Any]
                  ) -> tuple[torch.Tensor, Any, torch.Tensor, list[int]]:
        """The arrived prompts prefilled (after the kept streams they continue, inside
        `continuing_streams`): their last-position logits, cache and mask, and the order of the
        prompts in them."""
        continued = self._continued(prompts) if self.kept is not None else {}
        logits, cache, order, mask = self._prefill(model, config, *left_padded(prompts, requests.pad_id, requests.device), options,
                                                   cache_name, continued, joins=True)
        return logits, cache, mask, order.tolist()

    def _decode(self, model, prompt_ids, prompt_mask, greedy: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, R] sampled ids (anything after a row's end) and their log-probs, R the longest response.
        `running` holds the batch rows still decoding, in the cache's order; the cache, mask and
        positions hold only those."""
        base, cache_name, options = forward_options(model)
        rows, limit = prompt_ids.shape[0], self.config.max_new_tokens
        joins = joinable(base.config)  # once per call: it builds a cache to look at its layers
        keeping = self.kept is not None and joins
        prompts = [ids[row_mask.bool()].tolist() for ids, row_mask in zip(prompt_ids, prompt_mask)] if keeping else []
        continued = self._continued(prompts) if keeping else {}
        logits, cache, running, mask = self._prefill(model, base.config, prompt_ids, prompt_mask, options, cache_name, continued, joins)
        options[cache_name] = cache
        ends = torch.tensor(self.policy.eos_token_ids, device=prompt_ids.device)
        ended: list[tuple[int, int, KeptRow]] = []  # (batch row, step, its cache) as rows end, when keeping
        positions = (mask.long().cumsum(dim=1) - 1)[:, -1:]  # real tokens only, as generate counts them
        tokens, logprobs = [], []  # per step, for the running rows
        chosen = torch.empty(0)  # the previous step's tokens, fed back from the second step on
        for step in range(limit):
            if step:
                logits = model(input_ids=chosen[:, None], attention_mask=mask, position_ids=positions, **options).logits[:, -1]
            scores = self._processed(logits.to(dtype=torch.float32, copy=True), step, greedy)
            if greedy:
                chosen = scores.argmax(dim=-1)
            else:  # torch.multinomial(softmax(scores), 1) with every row's draws (module docstring)
                noise = torch.empty(rows, scores.shape[-1], device=scores.device).exponential_()[running]
                chosen = (torch.softmax(scores, dim=-1) / noise).argmax(dim=-1)
            tokens.append((running, chosen))
            logprobs.append(torch.log_softmax(scores, dim=-1).gather(-1, chosen[:, None]).squeeze(-1))
            if step + 1 == limit:
                if keeping:
                    ended += self._ending(cache, mask, running, torch.arange(len(running)), step)
                break
            kept = torch.isin(chosen, ends, invert=True).nonzero().squeeze(1)  # the step's one read from the device
            if keeping and len(kept) < len(running):
                ended += self._ending(cache, mask, running, torch.isin(chosen, ends).nonzero().squeeze(1), step)
            if len(kept) == 0:
                break
            if len(kept) < len(running):
                cache.batch_select_indices(kept)
                running, chosen, mask, positions = running[kept], chosen[kept], mask[kept], positions[kept]
            mask, positions = torch.cat([mask, mask.new_ones(len(running), 1)], dim=1), positions + 1
            self.positions = (self.positions[0] + len(running), self.positions[1] + len(running))
        pad = self.policy.tokenizer.pad_token_id
        response_ids = prompt_ids.new_full((rows, len(tokens)), pad)
        sampled = torch.zeros(rows, len(tokens), device=prompt_ids.device)
        for step, ((at, chosen), logprob) in enumerate(zip(tokens, logprobs)):
            response_ids[at, step], sampled[at, step] = chosen, logprob
        if self.kept is not None:
            for row, step, kept in ended:  # the cache holds the prompt and the tokens fed back: all but the last sampled
                self.kept.keep(prompts[row] + response_ids[row, :step].tolist(), kept)
        return response_ids, sampled

    def _continued(self, prompts: list[list[int]]) -> dict[int, tuple[int, KeptRow]]:
        """{row: (ids held, kept cache)} for the prompts that continue a kept stream; counts the reuse."""
        assert self.kept is not None
        continued = {}
        for row, ids in enumerate(prompts):
            found = self.kept.take(ids)
            if found is not None:
                continued[row] = found
                self.kept.reused += found[0]
            self.kept.prompted += len(ids)
        return continued

    @staticmethod
    def _ending(cache, mask, running, at: torch.Tensor, step: int) -> list[tuple[int, int, KeptRow]]:
        """(batch row, step, its cache) of the running rows at `at`: one copy per layer for all of them."""
        at = at.to(mask.device)
        picked = [(layer.keys.index_select(0, at), layer.values.index_select(0, at)) for layer in cache.layers]
        masks = mask.index_select(0, at)
        rows = running[at.to(running.device)].tolist()  # `serve` numbers its rows on the CPU (found on a GPU: an index must be on its tensor's device)
        return [(row, step, KeptRow(masks[i], [(keys[i], values[i]) for keys, values in picked])) for i, row in enumerate(rows)]

    def _prefill(self, model, config, prompt_ids, prompt_mask, options, cache_name, continued: dict[int, tuple[int, KeptRow]],
                 joins: bool) -> tuple[torch.Tensor, Any, torch.Tensor, torch.Tensor]:
        """The prompts through the model in groups of similar length, each cut to its longest prompt,
        then the rows in `continued` in one group after their kept caches: (last-position logits,
        one KV cache for all rows, the rows' order in both, the cache's attention mask). A cache
        that is not plain full attention in every layer (sliding windows, linear layers: `joins`
        False) is not joined: then one group, and nothing continued."""
        from transformers import DynamicCache

        lengths = prompt_mask.sum(dim=1)
        order = lengths.argsort(descending=True, stable=True)
        if continued:
            order = order[torch.isin(order, torch.tensor(list(continued), device=order.device), invert=True)]
        sizes = prefill_groups(lengths[order].tolist()) if joins else [len(order)]
        logits, caches, masks = [], [], []
        for rows in order.split(sizes) if len(order) else ():
            ids, mask = without_padding_columns(prompt_ids[rows], prompt_mask[rows])
            caches.append(DynamicCache(config=config))
            positions = (mask.long().cumsum(dim=1) - 1).clamp(min=0)
            out = model(input_ids=ids, attention_mask=mask, position_ids=positions, **options, **{cache_name: caches[-1]})
            logits.append(out.logits[:, -1])
            masks.append(mask)
            self.positions = (self.positions[0] + mask.numel(), self.positions[1] + mask.sum())
        if continued:
            rows = torch.tensor(list(continued), device=order.device)
            logit, cache, mask = self._prefill_after(model, config, prompt_ids[rows], prompt_mask[rows], list(continued.values()), options,
                                                     cache_name)
            logits.append(logit)
            caches.append(cache)
            masks.append(mask)
            order = torch.cat([order, rows])
        width = max(mask.shape[1] for mask in masks)
        mask = torch.cat([torch.nn.functional.pad(mask, (width - mask.shape[1], 0)) for mask in masks])
        return torch.cat(logits), caches[0] if len(caches) == 1 else joined_cache(caches, width, config), order, mask

    def _prefill_after(self, model, config, prompt_ids, prompt_mask, continued: list[tuple[int, KeptRow]], options, cache_name
                       ) -> tuple[torch.Tensor, Any, torch.Tensor]:
        """Rows whose prompts continue kept streams: the kept caches' own columns gathered into one
        cache, each left-padded to the longest, then only the tokens after them through the model.
        (last-position logits, the cache, its mask: the kept columns, then the new ones, each left-padded)."""
        from transformers import DynamicCache

        held = [length for length, _ in continued]
        kept = [row for _, row in continued]
        wide, columns = max(held), max(row.mask.shape[0] for row in kept)
        # for each row, the indices of its held columns (right-padded rows keep their indices), left-padded with column 0
        gather = torch.zeros((len(kept), wide), dtype=torch.long, device=prompt_ids.device)
        for index, (row, length) in enumerate(zip(kept, held)):
            gather[index, wide - length:] = row.mask.nonzero().squeeze(1)
        cache = DynamicCache(config=config)
        for index, layers in enumerate(zip(*(row.layers for row in kept))):
            keys, values = (torch.stack([torch.nn.functional.pad(t, (0, 0, 0, columns - t.shape[-2])) for t in tensors]) for tensors in zip(*layers))
            at = gather[:, None, :, None].expand(-1, keys.shape[1], -1, keys.shape[-1])
            cache.update(keys.gather(2, at), values.gather(2, at), index)
        real = [ids[row_mask.bool()] for ids, row_mask in zip(prompt_ids, prompt_mask)]
        added = [ids[length:] for ids, length in zip(real, held)]
        width = max(len(ids) for ids in added)
        ids = prompt_ids.new_full((len(added), width), self.policy.tokenizer.pad_token_id)
        mask = prompt_mask.new_zeros((len(added), wide + width))
        for row, (new, length) in enumerate(zip(added, held)):
            ids[row, width - len(new):] = new
            mask[row, wide - length:wide] = 1
            mask[row, wide + width - len(new):] = 1
        positions = (mask.long().cumsum(dim=1) - 1)[:, wide:].clamp(min=0)
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions, **options, **{cache_name: cache})
        self.positions = (self.positions[0] + ids.numel(), self.positions[1] + sum(len(new) for new in added))
        return out.logits[:, -1], cache, mask

    def _processed(self, logits: torch.Tensor, step: int | torch.Tensor, greedy: bool) -> torch.Tensor:
        """The scores a token is chosen from, as generate processes them: end ids forbidden before
        `min_new_tokens`, the suppressed ids never, then (sampling) temperature, top-k, top-p.
        `step`: the step of every row, or each row's (`serve`'s rows started at different steps)."""
        from transformers import TopKLogitsWarper, TopPLogitsWarper

        if isinstance(step, torch.Tensor):
            early = (step < self.config.min_new_tokens).nonzero().squeeze(1)
            if len(early):
                logits[early[:, None], torch.tensor(self.policy.eos_token_ids, device=logits.device)] = -float("inf")
        elif step < self.config.min_new_tokens:
            logits[:, list(self.policy.eos_token_ids)] = -float("inf")
        if self.policy.suppressed_token_ids:
            logits[:, list(self.policy.suppressed_token_ids)] = -float("inf")
        if greedy:
            return logits
        if self.temperature != 1.0:
            logits = logits / self.temperature
        if self.config.top_k:
            logits = TopKLogitsWarper(self.config.top_k)(None, logits)  # pyright: ignore[reportArgumentType] (the warpers never read input_ids)
        if self.config.top_p < 1.0:
            logits = TopPLogitsWarper(self.config.top_p)(None, logits)  # pyright: ignore[reportArgumentType] (the warpers never read input_ids)
        return logits


@hookimpl
def register_generators(register):
    register("hf", HFGenerator, HFGeneratorConfig)
