"""Sources: from_tensor_slices, from_tensors, range and from_generator."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from phalanx.data import UNKNOWN, Dataset


def values(ds: Dataset) -> list[int]:
    return [int(e) for e in ds]


def test_from_tensor_slices_of_a_tensor_an_array_and_a_list():
    assert values(Dataset.from_tensor_slices(torch.arange(3))) == [0, 1, 2]
    rows = list(Dataset.from_tensor_slices(np.arange(6, dtype=np.float64).reshape(3, 2)))
    assert rows[1].dtype == torch.float64
    assert rows[1].tolist() == [2.0, 3.0]
    assert values(Dataset.from_tensor_slices([4, 5])) == [4, 5]


def test_from_tensor_slices_of_tuples_and_dicts():
    pairs = list(Dataset.from_tensor_slices((torch.ones(2, 3), np.array([7, 8]))))
    assert isinstance(pairs[1], tuple)
    assert pairs[1][0].shape == (3,)
    assert int(pairs[1][1]) == 8
    named = list(Dataset.from_tensor_slices({"x": np.zeros((2, 2), np.float64), "name": ["a", "b"]}))
    assert named[1]["x"].dtype == torch.float64
    assert named[1]["name"] == "b"


def test_from_tensor_slices_is_reiterable():
    ds = Dataset.from_tensor_slices(torch.arange(4))
    assert values(ds) == values(ds) == [0, 1, 2, 3]


def test_from_tensor_slices_errors():
    with pytest.raises(ValueError, match=r"same first dimension. Received shapes \[\(2,\), \(3, 1\)\]"):
        Dataset.from_tensor_slices((torch.ones(2), torch.ones(3, 1)))
    with pytest.raises(ValueError, match="first dimension. Received a scalar"):
        Dataset.from_tensor_slices(torch.tensor(1.0))


def test_from_tensors_is_one_element():
    ds = Dataset.from_tensors((torch.tensor([1.0]), {"s": "text"}))
    (element,) = list(ds)
    assert element[0].tolist() == [1.0]
    assert element[1] == {"s": "text"}
    assert ds.cardinality() == 1
    assert [b[0].shape for b in ds.repeat(5).batch(2)] == [(2, 1), (2, 1), (1, 1)]


def test_range_matches_python_range():
    assert values(Dataset.range(4)) == [0, 1, 2, 3]
    assert values(Dataset.range(2, 10, 3)) == [2, 5, 8]
    assert values(Dataset.range(5, 0, -2)) == [5, 3, 1]
    assert next(iter(Dataset.range(1))).dtype == torch.int64
    assert next(iter(Dataset.range(1, dtype=torch.int32))).dtype == torch.int32
    assert Dataset.range(2, 10, 3).cardinality() == 3


def test_range_errors():
    with pytest.raises(TypeError, match="takes 1 to 3 ints"):
        Dataset.range(1.5)
    with pytest.raises(TypeError, match="takes 1 to 3 ints"):
        Dataset.range()
    with pytest.raises(ValueError, match="step must not be 0"):
        Dataset.range(0, 5, 0)


def test_from_generator_calls_anew_each_pass():
    calls = []

    def gen(n):
        calls.append(n)
        yield from (np.float64(i) for i in range(n))

    ds = Dataset.from_generator(gen, args=(3,))
    assert [e.dtype for e in ds] == [torch.float64] * 3
    assert values(ds) == [0, 1, 2]
    assert calls == [3, 3]
    assert ds.cardinality() == UNKNOWN


def test_from_generator_errors():
    with pytest.raises(TypeError, match="from_generator's generator must be callable"):
        Dataset.from_generator([1, 2])
    with pytest.raises(TypeError, match="must return an iterable"):
        list(Dataset.from_generator(lambda: 3))
