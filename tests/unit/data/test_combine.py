"""zip and concatenate."""

from __future__ import annotations

import pytest
import torch

from phalanx.data import Dataset


def test_zip_gives_tuples_or_dicts_and_stops_at_the_shortest():
    a, b = Dataset.range(5), Dataset.from_tensor_slices(torch.arange(3) * 10)
    assert [(int(x), int(y)) for x, y in Dataset.zip((a, b))] == [(0, 0), (1, 10), (2, 20)]
    assert [(int(x), int(y)) for x, y in Dataset.zip(a, b)] == [(0, 0), (1, 10), (2, 20)]
    named = list(Dataset.zip({"x": a, "y": b}))
    assert [int(e["y"]) for e in named] == [0, 10, 20]
    batched = next(iter(Dataset.zip((a, b)).batch(2)))
    assert batched[1].tolist() == [0, 10]


def test_zip_of_a_single_dataset():
    assert [tuple(int(v) for v in e) for e in Dataset.zip((Dataset.range(2),))] == [(0,), (1,)]


def test_concatenate():
    ds = Dataset.range(3).concatenate(Dataset.range(2))
    assert [int(v) for v in ds] == [0, 1, 2, 0, 1]
    assert [int(v) for v in ds] == [0, 1, 2, 0, 1]


def test_combine_errors():
    with pytest.raises(ValueError, match="Dataset.zip needs at least one dataset"):
        Dataset.zip(())
    with pytest.raises(TypeError, match="Dataset.zip needs phalanx.data.Dataset inputs. Received: list"):
        Dataset.zip((Dataset.range(2), [1, 2]))
    with pytest.raises(TypeError, match="concatenate needs phalanx.data.Dataset inputs. Received: range"):
        Dataset.range(2).concatenate(range(3))
