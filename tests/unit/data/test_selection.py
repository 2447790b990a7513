"""take, skip, shard and repeat, on element chains and on the rows fast path alike."""

from __future__ import annotations

import pytest
import torch

from phalanx.data import INFINITE, UNKNOWN, Dataset


def values(ds: Dataset) -> list[int]:
    return [int(e) for e in ds]


def _both(n: int) -> list[Dataset]:
    """The same integers as tensor slices (rows path) and as a range (element path)."""
    return [Dataset.from_tensor_slices(torch.arange(n)), Dataset.range(n)]


@pytest.mark.parametrize("ds", _both(10))
def test_take_skip_shard(ds):
    assert values(ds.take(3)) == [0, 1, 2]
    assert values(ds.take(-1)) == list(range(10))
    assert values(ds.take(0)) == []
    assert values(ds.skip(7)) == [7, 8, 9]
    assert values(ds.skip(-1)) == []
    assert values(ds.skip(20)) == []
    assert values(ds.shard(3, 1)) == [1, 4, 7]
    assert [b.tolist() for b in ds.shard(3, 0).batch(2)] == [[0, 3], [6, 9]]


@pytest.mark.parametrize("ds", _both(4))
def test_batches_through_selections_match_elements(ds):
    chain = ds.skip(1).repeat(3).shard(2, 1).take(3)  # 1 2 3 1 2 3 1 2 3 -> 2 1 3 2 -> 2 1 3
    expected = [2, 1, 3]
    assert values(chain) == expected
    assert [v for b in chain.batch(2) for v in b.tolist()] == expected


@pytest.mark.parametrize("ds", _both(3))
def test_repeat(ds):
    assert values(ds.repeat(2)) == [0, 1, 2, 0, 1, 2]
    assert values(ds.repeat(0)) == []
    assert values(ds.repeat().take(7)) == [0, 1, 2, 0, 1, 2, 0]
    assert values(ds.repeat(-1).take(4)) == [0, 1, 2, 0]


def test_repeat_forever_over_nothing_ends():
    assert values(Dataset.range(0).repeat()) == []
    assert values(Dataset.range(5).filter(lambda v: v > 10).repeat()) == []
    assert values(Dataset.from_tensor_slices(torch.arange(0)).repeat().batch(2)) == []


def test_repeat_restarts_generators():
    ds = Dataset.from_generator(lambda: iter(range(2))).repeat(2)
    assert values(ds) == [0, 1, 0, 1]
    assert ds.cardinality() == UNKNOWN
    assert Dataset.from_generator(lambda: iter(range(2))).repeat().cardinality() == INFINITE


def test_selection_errors():
    ds = Dataset.range(4)
    with pytest.raises(ValueError, match="take's count must be >= -1. Received: -2. HINT: use -1"):
        ds.take(-2)
    with pytest.raises(ValueError, match="skip's count must be >= -1"):
        ds.skip(-3)
    with pytest.raises(ValueError, match="repeat's count must be >= -1"):
        ds.repeat(-2)
    with pytest.raises(TypeError, match="take's count must be an int"):
        ds.take(1.0)
    with pytest.raises(ValueError, match="shard's num_shards must be >= 1"):
        ds.shard(0, 0)
    with pytest.raises(ValueError, match=r"shard's index must be in \[0, num_shards=2\). Received: index=2"):
        ds.shard(2, 2)
    with pytest.raises(ValueError, match="shard's index must be >= 0"):
        ds.shard(2, -1)
    with pytest.raises(TypeError, match="shard's index must be an int"):
        ds.shard(2, True)
