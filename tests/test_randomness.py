"""Each seeded stream's derivation from the run seed, pinned: a change here changes every run's figures."""

import torch

from rlkit_core.randomness import (
    data_order_generator,
    evaluation_seed,
    held_out_generator,
    minibatch_order_generator,
    sampling_seed,
)


def test_each_stream_is_seeded_as_the_runs_have_always_been():
    # seed * 1_000_003 + index: seed 2, index 3 -> 2_000_009; seed + 7_919: 5 -> 7_924
    assert data_order_generator(2, 3).initial_seed() == 2_000_009
    assert minibatch_order_generator(2, 3).initial_seed() == 2_000_009
    assert sampling_seed(3, 0) == 3 and sampling_seed(3, 2) == 2_000_009
    assert evaluation_seed(5) == 7_924 and held_out_generator(5).initial_seed() == 7_924


def test_a_stream_depends_on_its_seed_and_index_only():
    first = torch.randperm(10, generator=data_order_generator(0, 1))
    torch.rand(3)  # the global stream moves; the derived one does not care
    assert torch.equal(first, torch.randperm(10, generator=data_order_generator(0, 1)))
    assert not torch.equal(first, torch.randperm(10, generator=data_order_generator(1, 0)))
