"""shuffle: tf.data's buffer algorithm, reproducible with a seed, reshuffled per epoch."""

from __future__ import annotations

import pytest
import torch

from phalanx.data import Dataset


def values(ds: Dataset) -> list[int]:
    return [int(e) for e in ds]


def test_a_seed_fixes_every_epoch():
    a = Dataset.range(50).shuffle(10, seed=3)
    b = Dataset.range(50).shuffle(10, seed=3)
    epochs = [values(a) for _ in range(3)]
    assert epochs == [values(b) for _ in range(3)]
    assert all(sorted(e) == list(range(50)) for e in epochs)
    assert epochs[0] != epochs[1] != epochs[2]
    assert values(Dataset.range(50).shuffle(10, seed=4)) != epochs[0]


def test_without_reshuffle_every_epoch_is_the_same():
    ds = Dataset.range(30).shuffle(30, seed=1, reshuffle_each_iteration=False)
    assert values(ds) == values(ds) != list(range(30))


def test_repeat_after_shuffle_reshuffles_each_pass():
    passes = values(Dataset.range(20).shuffle(20, seed=2).repeat(2))
    assert sorted(passes[:20]) == sorted(passes[20:]) == list(range(20))
    assert passes[:20] != passes[20:]


def test_the_buffer_limits_how_far_elements_move():
    assert values(Dataset.range(20).shuffle(1, seed=0)) == list(range(20))
    out = values(Dataset.range(100).shuffle(5, seed=0))
    # With a buffer of 5, the element emitted at position i was read at position <= i + 4.
    assert all(v <= i + 4 for i, v in enumerate(out))


def test_unseeded_shuffles_follow_torch_manual_seed():
    torch.manual_seed(7)
    a = values(Dataset.range(40).shuffle(40))
    torch.manual_seed(7)
    b = values(Dataset.range(40).shuffle(40))
    assert a == b
    assert values(Dataset.range(40).shuffle(40)) != a


def test_rows_path_and_element_path_give_the_same_order():
    rows = Dataset.from_tensor_slices(torch.arange(64)).shuffle(16, seed=5)
    elements = Dataset.range(64).shuffle(16, seed=5)
    assert values(rows) == values(elements)
    batched = [
        v for b in Dataset.from_tensor_slices(torch.arange(64)).shuffle(16, seed=5).batch(10) for v in b
    ]
    assert [int(v) for v in batched] == values(Dataset.range(64).shuffle(16, seed=5))


def test_shuffled_tuples_stay_aligned():
    x = torch.arange(100)
    for a, b in Dataset.from_tensor_slices((x, x * 2)).shuffle(100, seed=0).batch(7):
        assert torch.equal(b, a * 2)


def test_shuffle_errors():
    with pytest.raises(ValueError, match="shuffle's buffer_size must be >= 1. Received: 0. HINT"):
        Dataset.range(3).shuffle(0)
    with pytest.raises(TypeError, match="shuffle's buffer_size must be an int"):
        Dataset.range(3).shuffle(2.5)
    with pytest.raises(TypeError, match="shuffle's seed must be an int"):
        Dataset.range(3).shuffle(2, seed="1")
