"""No work on padding: forward passes trimmed to their own longest prompt and response, pieces
grouped by length, token-budget micro-batches, several rollouts packed into one row; each checked
against the padded computation."""

import attrs
import pytest
import torch

from rlkit_core.batch import RolloutBatch
from rlkit_core.errors import RecipeError
from rlkit_core.functional import logprobs_from_logits
from rlkit_core.recipe.document import parse_recipe
from rlkit_core.runtime import update
from rlkit_core.runtime.forward import PositionCount, response_view
from rlkit_core.runtime.microbatches import TooLong, budget_pieces, fixed_pieces
from rlkit_core.runtime.packing import PackedRows, PaddedRows, packed_layout
from rlkit_core.runtime.trainer import Trainer
from tests.test_trainer import advantages_with, compare_with, rollout_with, update_with


def hand_batch() -> RolloutBatch:
    """Two rollouts: prompts of 2 and 3 tokens left-padded to 4, responses of 2 and 1 padded to 4."""
    return RolloutBatch(
        prompts=["ab", "abc"], columns={"letter": ["x", "y"]}, group_ids=torch.tensor([0, 1]),
        prompt_ids=torch.tensor([[0, 0, 5, 6], [0, 5, 6, 7]]), prompt_mask=torch.tensor([[0, 0, 1, 1], [0, 1, 1, 1]]),
        response_ids=torch.tensor([[8, 1, 0, 0], [1, 0, 0, 0]]), response_mask=torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0]]),
        loss_mask=torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0]]),
        sampled_logprobs=torch.tensor([[-1.0, -2.0, 0.0, 0.0], [-3.0, 0.0, 0.0, 0.0]]),
    )


def test_trimming_drops_only_the_columns_that_are_padding_in_every_row():
    trimmed = hand_batch().trimmed()
    assert trimmed.prompt_ids.tolist() == [[0, 5, 6], [5, 6, 7]]
    assert trimmed.prompt_mask.tolist() == [[0, 1, 1], [1, 1, 1]]
    assert trimmed.response_ids.tolist() == [[8, 1], [1, 0]]
    assert trimmed.sampled_logprobs.tolist() == [[-1.0, -2.0], [-3.0, 0.0]]
    assert trimmed.columns == {"letter": ["x", "y"]}
    # position ids count real tokens only: each prompt starts at 0 and the response goes on from it
    _, attention, positions = trimmed.sequence()
    assert positions.tolist() == [[0, 0, 1, 2, 3], [0, 1, 2, 3, 3]]
    assert attention.tolist() == [[0, 1, 1, 1, 1], [1, 1, 1, 1, 0]]
    _, _, padded_positions = hand_batch().sequence()
    assert torch.equal(padded_positions[:, [1, 2, 3, 4, 5]], positions)  # the kept columns as they were


def test_pieces_group_rollouts_by_length_within_the_budget():
    index = torch.tensor([0, 1, 2, 3])
    prompts, responses = [5, 2, 8, 3], [3, 1, 8, 2]  # totals 8, 3, 16, 5
    # longest first: [2] is 16 tokens; [0, 3] is 2 × (5 + 3) = 16; adding 1 would be 3 × 8 = 24 > 20
    assert [p.tolist() for p in budget_pieces(index, prompts, responses, 20)] == [[2], [0, 3], [1]]
    assert [p.tolist() for p in budget_pieces(index, prompts, responses, 20, at_least=4)] == [[2], [0], [3], [1]]
    assert [p.tolist() for p in budget_pieces(index, prompts, responses, 100)] == [[2, 0, 3, 1]]
    with pytest.raises(TooLong) as caught:
        budget_pieces(index, prompts, responses, 15)
    assert (caught.value.tokens, caught.value.budget) == (16, 15)
    assert [p.tolist() for p in fixed_pieces(index, [8, 3, 16, 5], 2)] == [[2, 0], [3, 1]]


def test_packed_rows_lay_the_real_tokens_end_to_end_with_positions_that_restart():
    # real lengths: rollout 0 is 2 + 2 = 4 tokens, rollout 1 is 3 + 1 = 4, rollout 2 is 1 + 1 = 2
    batch = RolloutBatch(
        prompts=["ab", "abc", "a"], columns={}, group_ids=torch.tensor([0, 1, 2]),
        prompt_ids=torch.tensor([[0, 5, 6], [5, 6, 7], [0, 0, 9]]), prompt_mask=torch.tensor([[0, 1, 1], [1, 1, 1], [0, 0, 1]]),
        response_ids=torch.tensor([[8, 1], [1, 0], [3, 0]]), response_mask=torch.tensor([[1, 1], [1, 0], [1, 0]]),
        loss_mask=torch.tensor([[1, 1], [1, 0], [1, 0]]),
        sampled_logprobs=torch.zeros(3, 2),
    )
    rows = PackedRows(batch, [2, 3, 1], [2, 1, 1])
    # width 4 (the longest): rollout 0 fills row 0, rollout 1 row 1, rollout 2 (2 tokens) starts row 2; filler repeats
    # the first real token (5)
    ids, mask, positions = rows.inputs
    assert mask is None and rows.start == 0 and rows.computed == 12
    assert ids.tolist() == [[5, 6, 8, 1], [5, 6, 7, 1], [9, 3, 5, 5]]
    assert positions.tolist() == [[0, 1, 2, 3], [0, 1, 2, 3], [0, 1, 0, 0]]
    # the position before each response token: rollout 0's tokens sit at flat 2, 3 (read 1, 2); rollout 1's at 7 (read 6);
    # rollout 2's at 9 (read 8); padding reads position 0
    assert rows.response_index.tolist() == [[1, 2], [6, 0], [8, 0]]
    per_position = torch.arange(12).view(3, 4)
    assert rows.at_response(per_position).tolist() == [[1, 2], [6, 0], [8, 0]]
    # two short rollouts share a row when they fit: lengths 4, 2, 2 in width 4
    shorter = batch.with_(prompt_mask=torch.tensor([[0, 1, 1], [0, 0, 1], [0, 0, 1]]))
    ids, _, positions = PackedRows(shorter, [2, 1, 1], [2, 1, 1]).inputs
    assert ids.tolist() == [[5, 6, 8, 1], [7, 1, 9, 3]] and positions.tolist() == [[0, 1, 2, 3], [0, 1, 0, 1]]


def test_a_row_a_little_wider_than_the_longest_rollout_can_save_a_row():
    # width 10: 10 | 9 | 6 (5 does not fit beside it) | 5: 4 rows, 40 positions for 30 tokens;
    # width 11: 10 | 9 | 6 + 5: 3 rows, 33 positions (3 rows need at least 30 / 3 = 10, and 10 does not do)
    assert packed_layout([10, 9, 6, 5]) == (11, [(0, 0), (1, 0), (2, 0), (2, 6)])
    # 2 rows would need 15 > 1.25 × 10: not tried; as wide as the longest already leaves no room
    assert packed_layout([10, 10, 10]) == (10, [(0, 0), (1, 0), (2, 0)])
    assert packed_layout([4, 2, 2]) == (4, [(0, 0), (1, 0), (1, 2)])


def test_packed_pieces_count_their_rows_times_their_width():
    index = torch.tensor([0, 1, 2, 3])
    prompts, responses = [5, 2, 8, 3], [3, 1, 8, 2]  # totals 8, 3, 16, 5
    # longest first, width 16: [2] alone is 16; 0 (8 tokens) needs a second row: 32 > 20
    # then width 8: 0, then 3 (5) → a row of its own: 16; then 1 (3 tokens) fits beside 3: still 16
    assert [p.tolist() for p in budget_pieces(index, prompts, responses, 20, packed=True)] == [[2], [0, 3, 1]]
    assert [p.tolist() for p in budget_pieces(index, prompts, responses, 32, packed=True)] == [[2, 0, 3, 1]]  # rows 16 | 8 5 3
    # padded, the same budget of 20 holds fewer: [0, 3] is 2 × (5 + 3) = 16, adding 1 makes 3 × 8 = 24
    assert [p.tolist() for p in budget_pieces(index, prompts, responses, 20)] == [[2], [0, 3], [1]]


def ragged(batch: RolloutBatch, pad: int, seed: int = 0) -> RolloutBatch:
    """`batch` with responses cut after 1..R tokens (none longer than it was) and three more
    all-padding columns before the prompts and after the responses: the padded computation that
    trimming must reproduce."""
    generator = torch.Generator().manual_seed(seed)
    rows, width = batch.response_ids.shape
    lengths = torch.minimum(torch.randint(1, width + 1, (rows,), generator=generator), batch.response_mask.sum(dim=1))
    mask = (torch.arange(width) < lengths[:, None]).long()
    extra = torch.zeros(rows, 3, dtype=torch.long)
    return batch.with_(
        prompt_ids=torch.cat([extra + pad, batch.prompt_ids], dim=1), prompt_mask=torch.cat([extra, batch.prompt_mask], dim=1),
        response_ids=torch.cat([torch.where(mask.bool(), batch.response_ids, pad), extra + pad], dim=1),
        response_mask=torch.cat([mask, extra], dim=1), loss_mask=torch.cat([mask, extra], dim=1),
        sampled_logprobs=torch.cat([batch.sampled_logprobs * mask, extra.float()], dim=1),
    )


@pytest.fixture(params=["byte-level", "padless-gpt2-separate-critic", "chat-llama"])
def ragged_document(request, recipe_document, tmp_path):
    """Real-style tokenizers too: GPT-2's without PAD (rlkit adds one) with a critic of its own, and
    Llama's rotary positions with several end ids."""
    from rlkit_core.testing.offline_models import write_tiny_model

    recipe_document["ppo"].update({"batch_size": 16, "minibatch_size": 16, "epochs": 1})
    recipe_document["generator"]["max_new_tokens"] = 12
    if request.param == "padless-gpt2-separate-critic":
        recipe_document["policy"]["model"] = str(write_tiny_model(tmp_path / "gpt2-style", "gpt2"))
        recipe_document["value_head"] = {"type": "separate", "model": str(write_tiny_model(tmp_path / "critic", "gpt2", classifier=True))}
    if request.param == "chat-llama":
        recipe_document["policy"]["model"] = str(write_tiny_model(tmp_path / "chat-style", "chat"))
    return recipe_document


def rollout(trainer: Trainer) -> RolloutBatch:
    """A ragged batch; the critic's zero-initialised head gets weights, so that values differ by position."""
    torch.manual_seed(5)
    head = getattr(trainer.components.value_head, "head", None) or trainer.components.value_head.score
    torch.nn.init.normal_(head.weight, std=0.1)
    return ragged(rollout_with(trainer, trainer.stream.batch(0))[0], trainer.components.policy.tokenizer.pad_token_id)


@pytest.mark.parametrize("packed, budget", [(False, 0), (False, 60), (True, 0), (True, 100)],
                         ids=["trimmed-fixed", "trimmed-budget", "packed-fixed", "packed-budget"])
def test_no_grad_passes_on_trimmed_pieces_equal_the_padded_computation(ragged_document, builtin_registry, budget, packed):
    """Packed with a budget, short rollouts share rows: attention must stay within each."""
    ragged_document["ppo"].update({"forward_batch_size": 0 if budget else 4, "max_tokens_per_forward": budget,
                                   "pack_sequences": packed})
    counter, laid_out = PositionCount(), []

    def observe(phase, chunk, rows):
        laid_out.append((len(chunk), len(rows.inputs[0])))
        counter(phase, chunk, rows)
    trainer = Trainer(parse_recipe(ragged_document, builtin_registry), observe=observe)
    batch = rollout(trainer)
    compared = compare_with(trainer, batch)

    with torch.no_grad():  # the whole padded batch in one pass, as before trimming
        sequence = batch.sequence()
        logprobs, values, _, _ = response_view(trainer.components, batch, PaddedRows(batch), grad=False)
        ref_logits = trainer.components.policy.reference_logits(*sequence, start=batch.prompt_length - 1)[:, :-1]
        ref_logprobs = logprobs_from_logits(ref_logits, batch.response_ids, trainer.components.generator.temperature,
                                            trainer.components.policy.suppressed_token_ids)
    counted = batch.response_mask.bool()
    assert counted.float().mean() < 0.7  # ragged: there was padding to leave out
    for name, padded in [("old_logprobs", logprobs), ("ref_logprobs", ref_logprobs), ("values", values)]:
        assert (getattr(compared, name)[counted] - padded[counted]).abs().max() < 1e-5, name
    computed, real = counter.positions["forward"]
    assert computed < 0.8 * (batch.prompt_mask.numel() + batch.response_mask.numel())  # pieces were trimmed
    assert real == int(batch.prompt_mask.sum() + batch.response_mask.sum())
    if packed:  # rows of rollouts end to end leave less padding than any trimmed piece
        assert computed < 1.25 * real, (computed, real)
    if packed and budget:
        assert sum(rows for _, rows in laid_out) < len(batch)  # some rows held several rollouts


@pytest.mark.parametrize("packed, split, policy", [
    (False, {"gradient_accumulation_steps": 4}, {}), (False, {"max_tokens_per_microbatch": 60}, {}),
    (True, {"gradient_accumulation_steps": 4}, {}), (True, {"max_tokens_per_microbatch": 100}, {}),
    (True, {"max_tokens_per_microbatch": 100}, {"gradient_checkpointing": True, "lora_r": 4}),
], ids=["trimmed-accumulating", "trimmed-budget", "packed-accumulating", "packed-budget", "packed-budget-lora-checkpointing"])
def test_the_update_on_trimmed_micro_batches_equals_the_padded_one(ragged_document, builtin_registry, split, packed, policy, monkeypatch):
    ragged_document["ppo"].update(split, pack_sequences=packed)
    ragged_document["policy"].update(policy)
    ragged_document["optim"]["max_grad_norm"] = 0.0  # the step sees the summed gradient as it is
    trainer = Trainer(parse_recipe(ragged_document, builtin_registry))
    batch = advantages_with(trainer, rollout(trainer))
    token_count = batch.response_mask.sum()
    # the whole padded minibatch at once: the fixed split of one
    update._micro_step(trainer.engine, trainer.components, trainer.recipe, batch, PaddedRows(batch), token_count)
    padded = torch.cat([p.grad.flatten() for p in trainer.engine.parameters])
    trainer.engine.optimizer.zero_grad(set_to_none=True)

    gradients = []  # the summed gradient the optimiser step sees
    trainer.engine.optimizer.optimizer.register_step_pre_hook(lambda *_: gradients.append(torch.cat([p.grad.flatten() for p in trainer.engine.parameters])))
    micro_batches, step = [], update._micro_step  # (rollouts, computed positions, rows) of each
    monkeypatch.setattr(update, "_micro_step", lambda engine, components, recipe, micro, rows, count: micro_batches.append(
        (len(micro), rows.computed, len(rows.inputs[0]))) or step(engine, components, recipe, micro, rows, count))
    update_with(trainer, batch)
    assert len(gradients) == 1 and padded.abs().max() > 1e-3
    assert (gradients[0] - padded).abs().max() < 1e-5 * padded.abs().max()
    assert len(micro_batches) > 1  # the minibatch was split, by length
    assert sum(rollouts for rollouts, _, _ in micro_batches) == len(batch)
    if "max_tokens_per_microbatch" in split:
        assert all(positions <= split["max_tokens_per_microbatch"] for _, positions, _ in micro_batches)
    if packed and "max_tokens_per_microbatch" in split:  # pieces of similar lengths: only a budget's larger ones share rows
        assert sum(rows for _, _, rows in micro_batches) < len(batch)


def test_a_rollout_longer_than_the_budget_is_a_located_error(recipe_document, builtin_registry):
    recipe_document["ppo"]["max_tokens_per_microbatch"] = 5
    trainer = Trainer(parse_recipe(recipe_document, builtin_registry))
    with pytest.raises(RecipeError) as caught:
        trainer.step()
    message = str(caught.value)
    assert "$.ppo.max_tokens_per_microbatch: a rollout of" in message and "budget of 5" in message


@pytest.mark.parametrize("settings, place", [({"max_tokens_per_microbatch": 64, "gradient_accumulation_steps": 2}, "$.ppo.gradient_accumulation_steps"),
                                             ({"max_tokens_per_forward": 64, "forward_batch_size": 4}, "$.ppo.forward_batch_size"),
                                             ({"max_tokens_per_forward": -1}, "$.ppo.max_tokens_per_forward")])
def test_budget_settings_that_do_not_go_together_are_located(recipe_document, builtin_registry, settings, place):
    recipe_document["ppo"].update(settings)
    with pytest.raises(RecipeError) as caught:
        parse_recipe(recipe_document, builtin_registry)
    assert place in str(caught.value)


def test_the_memory_estimate_takes_the_token_budget(recipe_document):
    from rlkit_core.memory import ModelShape, Workload, estimate

    shape = ModelShape(parameters=1000, trainable=100, layers=2, hidden=8, heads=2, vocab=10, weight_bytes=4, reference_copy=True)
    work = Workload(micro_batch=2, forward_batch=4, generate_batch=4, prompt_tokens=3, response_tokens=5,
                    checkpointing=False, mixed_precision="no", micro_tokens=8, forward_tokens=16)
    # a budget of 8 positions is one rollout of the longest 8 tokens: a layer keeps 1·8·8·(34 + 10)·4/2 = 5632 bytes;
    # 16 positions in the no-grad passes are two rollouts
    parts = estimate(shape, work)
    assert parts["update"] == 2 * 5632 + (2 * 8 * 10 * 4 + 4 * 5 * 10 * 4)
    assert parts["forward"] == 2 * 2 * 8 * 10 * 4 + 2 * 2 * 5 * 10 * 4
    assert estimate(shape, attrs.evolve(work, micro_tokens=16))["update"] == estimate(shape, attrs.evolve(work, micro_tokens=0))["update"]


@pytest.mark.parametrize("style", ["byte-level", "padless-gpt2"])
def test_generation_in_length_ordered_chunks_gives_each_prompt_its_own_response(recipe_document, builtin_registry, tmp_path, style):
    """Greedy, so that the responses are fixed: chunked by length, without padding columns, each
    comes back in its place as in one padded call."""
    from rlkit_core.prompts import encode_prompts
    from rlkit_core.testing.offline_models import write_tiny_model

    if style == "padless-gpt2":
        recipe_document["policy"]["model"] = str(write_tiny_model(tmp_path / "gpt2-style", "gpt2"))
    trainer = Trainer(parse_recipe(recipe_document, builtin_registry))
    generator = trainer.components.generator
    prompt_ids, prompt_mask = encode_prompts(trainer.components.policy.tokenizer, trainer.prompts.train[:8], trainer.engine.device)
    assert len(set(prompt_mask.sum(dim=1).tolist())) > 2  # prompts of several lengths
    pad = torch.full((8, 4), trainer.components.policy.tokenizer.pad_token_id)
    padded_ids, padded_mask = torch.cat([pad, prompt_ids], dim=1), torch.cat([torch.zeros_like(pad), prompt_mask], dim=1)
    whole = generator.generate(prompt_ids, prompt_mask, greedy=True)
    generator.config = attrs.evolve(generator.config, batch_size=3)
    seen, generate = [], generator._generate
    generator._generate = lambda ids, mask, greedy: seen.append((ids.shape[1], mask.sum(dim=1).tolist())) or generate(ids, mask, greedy)
    chunked = generator.generate(padded_ids, padded_mask, greedy=True)
    width = whole.response_ids.shape[1]
    assert torch.equal(chunked.response_mask[:, :width], whole.response_mask)
    assert torch.equal(chunked.response_ids[:, :width], whole.response_ids)
    assert (chunked.logprobs[:, :width] - whole.logprobs).abs().max() < 1e-5
    lengths = sorted(prompt_mask.sum(dim=1).tolist(), reverse=True)
    assert [chunk for _, chunk in seen] == [lengths[:3], lengths[3:6], lengths[6:]]  # by length, longest first
    assert [columns for columns, _ in seen] == [lengths[0], lengths[3], lengths[6]]  # no column of padding only


@pytest.mark.slow
def test_rlkit_check_estimates_the_update_with_the_token_budget(recipe_document, write_recipe, builtin_registry):
    import re
    import subprocess
    import sys
    from pathlib import Path

    from rlkit_core.recipe.plan import memory_estimate

    def update_mib(lines: str) -> float:
        return float(re.search(r"working memory: update ([\d,.]+)", lines).group(1).replace(",", ""))

    fixed = update_mib("\n".join(memory_estimate(parse_recipe(recipe_document, builtin_registry), 200)))
    recipe_document["ppo"]["max_tokens_per_microbatch"] = 416
    done = subprocess.run([str(Path(sys.executable).with_name("rlkit")), "check", write_recipe(recipe_document), "--prompt-tokens", "200"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    # 8 rollouts of 208 tokens a micro-batch, or a budget of 416 positions: two rollouts of the longest length
    assert fixed > 3 * update_mib(done.stdout)


def test_every_process_runs_as_many_micro_batches_as_the_one_that_needs_most(recipe_document, builtin_registry, monkeypatch):
    """DDP's and FSDP's collective calls pair up only if every process takes as many steps."""
    from rlkit_core.runtime.forward import chunks_of, lengths_of

    recipe_document["ppo"].update({"batch_size": 16, "minibatch_size": 16})
    trainer = Trainer(parse_recipe(recipe_document, builtin_registry))
    batch = rollout_with(trainer, trainer.stream.batch(0))[0]
    index, lengths = torch.arange(len(batch)), lengths_of(batch)
    processes = trainer.engine.processes
    assert len(chunks_of(index, lengths, 1000, 16, "max_tokens_per_microbatch", False, processes)) == 1  # all fit at once
    monkeypatch.setattr(trainer.engine.processes, "count", 2)
    monkeypatch.setattr(trainer.engine.processes, "gather_objects", lambda value: [value, 5])  # the other process needs 5
    pieces = chunks_of(index, lengths, 1000, 16, "max_tokens_per_microbatch", False, processes)
    assert len(pieces) == 5 and sorted(torch.cat(pieces).tolist()) == list(range(16))
