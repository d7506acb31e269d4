"""The `hf` generator's kept streams: inside `continuing_streams`, a prompt whose ids begin with a
row an earlier call sampled prefills only the tokens after them, and samples what a whole prefill
samples (same ids, same log-probs to float error, same random draws). Decided by ids alone;
nothing is kept outside the block or after it."""

from __future__ import annotations

import pytest
import torch
from rlkit_plugins.hf_generator import KeptStreams

from tests.test_hf_generator_loop import STYLES, left_padded, make_generator, make_policy, models  # noqa: F401 (a fixture)

GAP = [60, 61, 62]  # what an environment's answer adds between two turns


def real_rows(ids: torch.Tensor, mask: torch.Tensor) -> list[list[int]]:
    return [row[m.bool()].tolist() for row, m in zip(ids, mask)]


def next_turn(prompts: list[list[int]], out, pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each prompt, then its sampled response (its end id included), then the gap."""
    responses = real_rows(out.response_ids, out.response_mask)
    return left_padded([p + r + GAP for p, r in zip(prompts, responses)], pad)


def sample(generator, ids, mask, seed: int, greedy: bool = False):
    torch.manual_seed(seed)
    before = generator.positions[0]
    out = generator.generate(ids, mask, greedy=greedy)
    return out, generator.positions[0] - before


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("greedy", [False, True])
def test_a_later_turn_prefills_only_its_new_tokens_and_samples_as_a_whole_prefill(models, style, greedy):  # noqa: F811
    policy = make_policy(models, style)
    pad = policy.tokenizer.pad_token_id
    opening = [[50, 51, 52, 53], [54], [55, 56, 57, 58, 59, 50, 51]]
    ids, mask = left_padded(opening, pad)
    keeping, whole = make_generator(policy, max_new_tokens=5), make_generator(policy, max_new_tokens=5)
    with keeping.continuing_streams():
        first, _ = sample(keeping, ids, mask, seed=1, greedy=greedy)
        # a prompt that continues no stream rides along in the same call
        second_ids, second_mask = next_turn(opening, first, pad)
        fresh = [70, 71, 72, 73, 74, 75]
        second_ids, second_mask = left_padded(real_rows(second_ids, second_mask) + [fresh], pad)
        continued, computed = sample(keeping, second_ids, second_mask, seed=2, greedy=greedy)
        third_ids, third_mask = next_turn(real_rows(second_ids, second_mask), continued, pad)
        third, _ = sample(keeping, third_ids, third_mask, seed=3, greedy=greedy)
    assert keeping.kept is None  # the block ended: nothing kept for calls on other weights
    reference, full = sample(whole, second_ids, second_mask, seed=2, greedy=greedy)
    assert torch.equal(continued.response_ids, reference.response_ids) and torch.equal(continued.response_mask, reference.response_mask)
    assert torch.allclose(continued.logprobs, reference.logprobs, atol=1e-5, rtol=0)
    assert computed < full
    reference_third, _ = sample(whole, third_ids, third_mask, seed=3, greedy=greedy)
    assert torch.equal(third.response_ids, reference_third.response_ids)
    assert torch.allclose(third.logprobs, reference_third.logprobs, atol=1e-5, rtol=0)
    # every row of turns two and three but the fresh one (at turn two) continued a stream of the turn before
    turn_two, turn_three = second_mask.sum(dim=1).tolist(), third_mask.sum(dim=1).tolist()
    kept_two = [len(p) + int(m.sum()) - 1 for p, m in zip(opening, first.response_mask)]
    kept_three = [n + int(m.sum()) - 1 for n, m in zip(turn_two, continued.response_mask)]
    reused, prompted = keeping.reused
    assert (reused, prompted) == (sum(kept_two) + sum(kept_three), sum(map(len, opening)) + sum(turn_two) + sum(turn_three))
    assert keeping.pop_metrics() == {"generate/kept_prefix": pytest.approx(reused / prompted)}
    assert keeping.pop_metrics() == {}


def test_outside_the_block_a_continuation_is_prefilled_whole(models):  # noqa: F811
    policy = make_policy(models, "gpt2")
    pad = policy.tokenizer.pad_token_id
    generator = make_generator(policy, max_new_tokens=4)
    opening = [[50, 51, 52], [53, 54]]
    first, _ = sample(generator, *left_padded(opening, pad), seed=1)
    ids, mask = next_turn(opening, first, pad)
    _, computed = sample(generator, ids, mask, seed=2)
    assert generator.kept is None and generator.pop_metrics() == {}
    assert computed >= int(mask.sum())  # every prompt token went through the model again


def test_a_stream_is_taken_by_its_longest_kept_prefix_and_once():
    kept = KeptStreams()
    short, long = object(), object()
    kept.keep([1, 2], short)
    kept.keep([1, 2, 3, 4], long)
    assert kept.take([1, 2, 3, 4]) == (2, short)  # not the whole prompt: it needs a token of its own to be prefilled
    assert kept.take([1, 2, 3, 4, 5]) == (4, long)
    assert kept.take([1, 2, 3, 4, 5]) is None  # each was taken once
    kept.keep([1, 2], short)
    assert kept.take([1, 3, 9]) is None and kept.take([2, 1, 3]) is None and kept.take([1, 2, 9]) == (2, short)
    kept.keep([7], short)
    kept.keep([7], long)  # two rows that sampled the same ids: each continued once
    assert {kept.take([7, 8])[1], kept.take([7, 9])[1]} == {short, long} and kept.take([7, 8]) is None
