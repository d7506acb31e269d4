"""The `hf` generator's `serve`: one decoding loop for requests that arrive while it runs. Requests
that arrive mid-decode join the running rows at the next step once they are as many (or none runs),
each row is answered the step it ends, and every answer is what a `generate` call of that prompt alone gives (greedy: the same ids,
log-probs to float error), on the byte-level toy and on real-style tokenizers."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from rlkit_core import Completion
from tests.test_hf_generator_loop import (  # noqa: F401 (a fixture)
    COUNTDOWN,
    ENDS_NOW,
    FOREVER,
    STYLES,
    follow_script,
    left_padded,
    lift_logits,
    make_generator,
    make_policy,
    models,
    recomputed_logits,
)


class Arrivals:
    """Requests that arrive at given calls of `arrived` (the generator calls it once a decoding
    step), noting at which call each was answered."""

    def __init__(self, schedule: dict[int, list[tuple[str, list[int]]]], pad_id: int, then: list | None = None):
        self.schedule, self.pad_id, self.device = schedule, pad_id, torch.device("cpu")
        self.calls, self.answers, self.answered_at = 0, {}, {}
        self.then = then  # requests that come after the first answer to an earlier one (a next turn)

    def arrived(self, wait: bool) -> list[tuple[str, list[int]]]:
        now, self.calls = self.calls, self.calls + 1
        due = [at for at in self.schedule if at <= now]
        if wait and not due and self.schedule:  # nothing is decoding: the next one arrives now
            due = [min(self.schedule)]
        return [request for at in sorted(due) for request in self.schedule.pop(at)]

    def completed(self, key: str, completion: Completion) -> None:
        assert key not in self.answers
        self.answers[key], self.answered_at[key] = completion, self.calls
        if self.then and key == self.then[0]:
            self.schedule[self.calls] = [self.then[1](completion)]


def alone(policy, prompt: list[int], greedy: bool, **config):
    """The generate call of `prompt` alone, as a completion."""
    generator = make_generator(policy, **config)
    [completion] = generator.generate(*left_padded([prompt], policy.tokenizer.pad_token_id), greedy=greedy).completions()
    return completion


@pytest.mark.parametrize("style", STYLES)
def test_a_request_arriving_mid_decode_joins_the_running_rows_and_leaves_first(models, style):  # noqa: F811
    policy = make_policy(models, style)
    follow_script(policy)
    long, short = [50, 51, 52, FOREVER], [53, 54, 55, 56, 57, 58, 59, COUNTDOWN[2]]  # the late one is the longer prompt
    arrivals = Arrivals({0: [("long", long)], 3: [("short", short)]}, policy.tokenizer.pad_token_id)
    generator = make_generator(policy, max_new_tokens=8)
    generator.serve(arrivals, greedy=True)
    answers = arrivals.answers
    # the long request ran its 8 steps; the short one joined at the 4th and ended 3 steps later, while the long one decoded on
    assert answers["long"].ids == [FOREVER] * 8
    assert answers["short"].ids == [COUNTDOWN[1], COUNTDOWN[0], policy.eos_token_ids[-1]]
    assert arrivals.answered_at["short"] < arrivals.answered_at["long"]
    assert arrivals.calls == 9  # one decoding loop: a call a step, then the wait that ended it
    for key, prompt in (("long", long), ("short", short)):
        reference = alone(policy, prompt, greedy=True, max_new_tokens=8)
        assert answers[key].ids == reference.ids
        assert answers[key].logprobs == pytest.approx(reference.logprobs, abs=1e-5)


@pytest.mark.parametrize("late", [1, 2])
def test_newcomers_join_once_they_are_as_many_as_the_rows_running(models, late):  # noqa: F811
    """Two rows decoding to the limit; one newcomer waits for them to end (a join costs a prefill
    pass and a copy of the running cache), two join at the next step and end first."""
    policy = make_policy(models, "gpt2")
    follow_script(policy)
    running = [("a", [50, FOREVER]), ("b", [51, 52, FOREVER])]
    newcomers = [(f"late{i}", [53 + i, COUNTDOWN[1]]) for i in range(late)]
    arrivals = Arrivals({0: running, 2: newcomers}, policy.tokenizer.pad_token_id)
    make_generator(policy, max_new_tokens=8).serve(arrivals, greedy=True)
    assert all(arrivals.answers[key].ids == [FOREVER] * 8 for key, _ in running)
    for key, _ in newcomers:
        assert arrivals.answers[key].ids == [COUNTDOWN[0], policy.eos_token_ids[-1]]
        if late == 1:  # joined when the two had ended: answered two passes after them
            assert arrivals.answered_at[key] == arrivals.answered_at["a"] + 2
        else:
            assert arrivals.answered_at[key] < arrivals.answered_at["a"]


def test_sampled_logprobs_are_the_policys_and_a_late_row_holds_its_own_ends_back(models):  # noqa: F811
    """Sampling: each answer's log-probs are the policy's at the temperature, and `min_new_tokens`
    counts each row's own steps: with every end id lifted far above the rest, a request joining at
    step 4 ends at its own third token, while the running row's script outweighs the end ids."""
    policy = make_policy(models, "chat")
    follow_script(policy, lift=100.0)
    lift_logits(policy, policy.eos_token_ids, 50.0)
    prompts = {"first": [50, 51, FOREVER], "late": [52, ENDS_NOW]}
    arrivals = Arrivals({0: [("first", prompts["first"])], 4: [("late", prompts["late"])]}, policy.tokenizer.pad_token_id)
    generator = make_generator(policy, max_new_tokens=6, temperature=0.7, min_new_tokens=2)
    torch.manual_seed(0)
    generator.serve(arrivals)
    late = arrivals.answers["late"]
    assert arrivals.answers["first"].ids == [FOREVER] * 6
    assert len(late.ids) == 3 and late.ids[-1] in policy.eos_token_ids
    for key, prompt in prompts.items():
        answer = arrivals.answers[key]
        ids, mask = left_padded([prompt], policy.tokenizer.pad_token_id)
        response = torch.tensor([answer.ids])
        logits = recomputed_logits(policy, ids, mask, SimpleNamespace(response_ids=response, response_mask=torch.ones_like(response))) / 0.7
        logits[0, :2, list(policy.eos_token_ids)] = -float("inf")  # as min_new_tokens holds them back
        logits[..., list(policy.suppressed_token_ids)] = -float("inf")
        expected = torch.log_softmax(logits, dim=-1).gather(-1, response[..., None]).squeeze(-1)[0]
        assert answer.logprobs == pytest.approx(expected.tolist(), abs=1e-4)


def test_a_next_turn_served_in_the_same_loop_prefills_only_its_new_tokens(models):  # noqa: F811
    """Inside `continuing_streams`, a turn that continues an answered row (its prompt, its sampled
    ids, then what the environment added) takes that row's kept cache, within the running loop."""
    policy = make_policy(models, "gpt2")
    follow_script(policy)
    gap = [60, 61, COUNTDOWN[1]]
    first, other = [50, 51, 52, COUNTDOWN[2]], [53, 54, FOREVER]

    def next_turn(completion: Completion) -> tuple[str, list[int]]:
        return "next", first + completion.ids + gap

    arrivals = Arrivals({0: [("first", first), ("other", other)]}, policy.tokenizer.pad_token_id, then=["first", next_turn])
    generator = make_generator(policy, max_new_tokens=10)
    with generator.continuing_streams():
        generator.serve(arrivals, greedy=True)
    answers = arrivals.answers
    assert answers["first"].ids == [COUNTDOWN[1], COUNTDOWN[0], policy.eos_token_ids[-1]]
    assert answers["next"].ids == [COUNTDOWN[0], policy.eos_token_ids[-1]]
    assert arrivals.answered_at["next"] < arrivals.answered_at["other"]  # the next turn joined while `other` decoded
    reused, prompted = generator.reused
    held = len(first) + len(answers["first"].ids) - 1  # the cache holds all but the last sampled id
    assert (reused, prompted) == (held, len(first) + len(other) + len(first) + len(answers["first"].ids) + len(gap))
    reference = alone(policy, first + answers["first"].ids + gap, greedy=True, max_new_tokens=10)
    assert answers["next"].ids == reference.ids
    assert answers["next"].logprobs == pytest.approx(reference.logprobs, abs=1e-5)
