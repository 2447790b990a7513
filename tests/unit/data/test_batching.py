"""batch and unbatch: partial batches, nested elements, the slicing fast path."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from phalanx.data import UNKNOWN, Dataset, structure


def test_partial_last_batch_is_kept_unless_dropped():
    ds = Dataset.range(10)
    assert [b.tolist() for b in ds.batch(4)] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert [b.tolist() for b in ds.batch(4, drop_remainder=True)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [b.tolist() for b in ds.batch(5, drop_remainder=True)] == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]


def test_nested_elements_batch_component_by_component():
    ds = Dataset.from_tensor_slices({"x": np.zeros((5, 3), np.float64), "pair": (torch.arange(5), ["a"] * 5)})
    first = next(iter(ds.map(lambda d: d).batch(2)))  # map: the stacking path
    assert first["x"].shape == (2, 3)
    assert first["x"].dtype == torch.float64
    assert first["pair"][0].tolist() == [0, 1]
    assert first["pair"][1] == ["a", "a"]
    fast = next(iter(ds.batch(2)))
    assert fast["x"].shape == (2, 3)
    assert fast["pair"][1] == ["a", "a"]


def test_fast_path_equals_the_stacking_path():
    x, y = torch.randn(50, 3), torch.arange(50)
    fast = Dataset.from_tensor_slices((x, y)).shuffle(13, seed=9).repeat(2).batch(8)
    slow = Dataset.from_tensor_slices((x, y)).map(lambda a, b: (a, b)).shuffle(13, seed=9).repeat(2).batch(8)
    for (fx, fy), (sx, sy) in zip(fast, slow, strict=True):
        assert torch.equal(fx, sx)
        assert torch.equal(fy, sy)


def test_contiguous_batches_are_views_of_the_source():
    x = torch.arange(12.0).reshape(6, 2)
    first = next(iter(Dataset.from_tensor_slices(x).batch(4)))
    assert first.data_ptr() == x.data_ptr()


def test_batching_60000_rows_keeps_every_row_once():
    # Its speed (slicing, one gather per shuffled batch) is measured in benchmarks/bench_input.py.
    ds = Dataset.from_tensor_slices((torch.randn(60000, 784), torch.arange(60000)))
    labels = [y for _, y in ds.batch(256)]
    assert len(labels) == 235
    assert torch.equal(torch.cat(labels), torch.arange(60000))
    shuffled = [y for _, y in ds.shuffle(60000, seed=0).batch(256)]
    assert sorted(torch.cat(shuffled).tolist()) == list(range(60000))
    assert not torch.equal(torch.cat(shuffled), torch.arange(60000))


def test_batches_of_shuffled_slices_are_gathered_not_stacked(monkeypatch):
    def no_stacking(elements):
        raise AssertionError("stacked element by element")

    monkeypatch.setattr(structure, "stack", no_stacking)
    ds = Dataset.from_tensor_slices((torch.randn(100, 4), torch.arange(100)))
    assert len(list(ds.shuffle(100, seed=0).repeat(2).shard(2, 0).take(80).skip(1).batch(16))) == 5
    with pytest.raises(AssertionError, match="stacked element by element"):
        list(ds.map(lambda x, y: (x, y)).batch(16))


def test_unbatch_splits_batches_back_into_rows():
    ds = Dataset.from_tensor_slices((torch.arange(6), torch.arange(6) * 2)).batch(4).unbatch()
    assert [(int(a), int(b)) for a, b in ds] == [(i, 2 * i) for i in range(6)]
    assert ds.cardinality() == UNKNOWN
    assert [int(v) for v in Dataset.range(7).batch(3).unbatch()] == list(range(7))


def test_batch_errors():
    with pytest.raises(ValueError, match="batch_size must be >= 1. Received: 0"):
        Dataset.range(3).batch(0)
    with pytest.raises(TypeError, match="batch_size must be an int"):
        Dataset.range(3).batch("4")
    ragged = Dataset.from_generator(lambda: iter([torch.ones(2), torch.ones(3)]))
    with pytest.raises(ValueError, match=r"one shape to stack. Received shapes \[\(2,\), \(3,\)\]"):
        list(ragged.batch(2))
    with pytest.raises(ValueError, match="unbatch needs every component to have a first dimension"):
        list(Dataset.range(3).unbatch())
