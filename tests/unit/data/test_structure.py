"""Nested elements: conversion of leaves, stacking into batches, splitting batches."""

from __future__ import annotations

from collections import namedtuple

import numpy as np
import pytest
import torch

from phalanx.data import structure

Point = namedtuple("Point", ["x", "y"])


def test_numpy_keeps_its_dtype_and_shares_memory():
    a = np.arange(4, dtype=np.float64)
    t = structure.to_tensors(a)
    assert t.dtype == torch.float64
    a[0] = 7.0
    assert t[0].item() == 7.0


def test_read_only_arrays_are_copied_without_warning(recwarn):
    a = np.arange(3)
    a.flags.writeable = False
    assert structure.to_tensors(a).tolist() == [0, 1, 2]
    assert not recwarn.list


def test_numbers_lists_and_strings():
    converted = structure.to_tensors((1, 2.5, True, [1, 2], ["a", "b"], "s", np.float64(1.5)))
    assert converted[0].dtype == torch.int64
    assert converted[1].dtype == torch.float32
    assert converted[2].dtype == torch.bool
    assert converted[3].tolist() == [1, 2]
    assert converted[4] == ["a", "b"]
    assert converted[5] == "s"
    assert converted[6].dtype == torch.float64
    assert structure.to_tensors([torch.ones(2), torch.zeros(2)]).shape == (2, 2)
    assert structure.to_tensors(np.array(["x", "y"])) == ["x", "y"]


def test_structures_are_rebuilt_with_their_types():
    out = structure.to_tensors({"p": Point(np.zeros(1), 1)})
    assert isinstance(out["p"], Point)
    assert isinstance(out["p"].x, torch.Tensor)


def test_unconvertible_leaves_are_refused():
    with pytest.raises(TypeError, match="Dataset elements must be tensors"):
        structure.to_tensors(object())
    with pytest.raises(TypeError, match="object arrays"):
        structure.to_tensors(np.array([np.zeros(1), np.zeros(2)], dtype=object))
    with pytest.raises(TypeError, match="must convert to one tensor"):
        structure.to_tensors([[1, 2], [3]])


def test_apply_unpacks_plain_tuples_only():
    assert structure.apply_unpacked(lambda a, b: a + b, (1, 2)) == 3
    assert structure.apply_unpacked(lambda p: p.x, Point(1, 2)) == 1
    assert structure.apply_unpacked(lambda d: d["a"], {"a": 5}) == 5


def test_stack_nested_and_strings():
    batch = structure.stack([(torch.ones(2), {"s": "a"}), (torch.zeros(2), {"s": "b"})])
    assert batch[0].shape == (2, 2)
    assert batch[1] == {"s": ["a", "b"]}
    points = structure.stack([Point(torch.tensor(1), torch.tensor(2))] * 3)
    assert isinstance(points, Point)
    assert points.x.tolist() == [1, 1, 1]


def test_stack_errors_name_what_differs():
    with pytest.raises(ValueError, match=r"one shape to stack. Received shapes \[\(2,\), \(3,\)\]"):
        structure.stack([torch.ones(2), torch.ones(3)])
    with pytest.raises(ValueError, match="same structure.*tuple of 2 and tuple of 1"):
        structure.stack([(torch.ones(1), torch.ones(1)), (torch.ones(1),)])
    with pytest.raises(ValueError, match="same structure.*dict with keys"):
        structure.stack([{"a": torch.ones(1)}, {"b": torch.ones(1)}])
    with pytest.raises(ValueError, match="different kinds"):
        structure.stack([torch.ones(1), "a"])


def test_unstack_and_leading_size_errors():
    rows = list(structure.unstack({"x": torch.arange(6).reshape(3, 2), "s": ["a", "b", "c"]}))
    assert rows[2]["x"].tolist() == [4, 5]
    assert rows[2]["s"] == "c"
    with pytest.raises(ValueError, match="unbatch needs every component to have a first dimension"):
        list(structure.unstack(torch.tensor(1.0)))
    with pytest.raises(ValueError, match=r"same first dimension. Received shapes \[\(2,\), \(3,\)\]"):
        structure.leading_size((torch.ones(2), torch.ones(3)), "from_tensor_slices")


def test_index_by_tensor_gathers_rows():
    data = (torch.arange(5) * 10, ["a", "b", "c", "d", "e"])
    picked = structure.index(data, torch.tensor([4, 0]))
    assert picked[0].tolist() == [40, 0]
    assert picked[1] == ["e", "a"]
