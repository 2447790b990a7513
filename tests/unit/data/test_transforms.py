"""Element-wise transformations: map (sequential and parallel), filter, enumerate, cache."""

from __future__ import annotations

import threading
from collections import namedtuple

import numpy as np
import pytest
import torch

from phalanx.data import AUTOTUNE, Dataset

Pair = namedtuple("Pair", ["a", "b"])


def values(ds: Dataset) -> list[int]:
    return [int(e) for e in ds]


def test_map_unpacks_tuples_like_tf_data():
    ds = Dataset.from_tensor_slices((torch.arange(4), torch.arange(4) * 10))
    assert values(ds.map(lambda a, b: a + b)) == [0, 11, 22, 33]
    assert values(Dataset.from_tensor_slices({"a": torch.arange(3)}).map(lambda d: d["a"] * 2)) == [0, 2, 4]
    named = Dataset.from_generator(lambda: iter([Pair(torch.tensor(1), torch.tensor(2))]))
    assert values(named.map(lambda p: p.a + p.b)) == [3]


def test_map_converts_outputs_to_tensors():
    out = next(iter(Dataset.range(1).map(lambda v: (np.ones(2), 1.5))))
    assert out[0].dtype == torch.float64
    assert out[1].dtype == torch.float32


def test_parallel_map_keeps_the_order_and_uses_threads():
    names = set()

    def slow_square(v):
        names.add(threading.current_thread().name)
        return v * v

    ds = Dataset.range(64).map(slow_square, num_parallel_calls=4)
    assert values(ds) == [i * i for i in range(64)]
    assert all(n.startswith("phalanx-map") for n in names)
    assert values(Dataset.range(10).map(lambda v: v + 1, num_parallel_calls=AUTOTUNE)) == list(range(1, 11))
    unordered_ok = Dataset.range(10).map(lambda v: v, num_parallel_calls=3, deterministic=False)
    assert values(unordered_ok) == list(range(10))  # phalanx keeps the order regardless


def test_parallel_map_raises_at_the_failing_element():
    def fail_at_5(v):
        if int(v) == 5:
            raise RuntimeError("element 5 is bad")
        return v

    it = iter(Dataset.range(20).map(fail_at_5, num_parallel_calls=3))
    assert [int(next(it)) for _ in range(5)] == [0, 1, 2, 3, 4]
    with pytest.raises(RuntimeError, match="element 5 is bad"):
        next(it)


def test_abandoned_parallel_map_stops_its_threads(settled_thread_count):
    before = threading.active_count()
    it = iter(Dataset.range(1000).map(lambda v: v, num_parallel_calls=4))
    next(it)
    del it
    assert settled_thread_count(before) == before


def test_map_errors():
    with pytest.raises(
        ValueError, match=r"num_parallel_calls must be >= 1, or phalanx.data.AUTOTUNE \(-1\). Received: 0"
    ):
        Dataset.range(2).map(lambda v: v, num_parallel_calls=0)
    with pytest.raises(ValueError, match="Received: -3"):
        Dataset.range(2).map(lambda v: v, num_parallel_calls=-3)
    with pytest.raises(TypeError, match="num_parallel_calls must be an int, AUTOTUNE or None"):
        Dataset.range(2).map(lambda v: v, num_parallel_calls=2.0)
    with pytest.raises(TypeError, match="map's fn must be callable"):
        Dataset.range(2).map(3)


def test_filter_with_python_and_tensor_predicates():
    assert values(Dataset.range(10).filter(lambda v: v % 3 == 0)) == [0, 3, 6, 9]
    pairs = Dataset.from_tensor_slices((torch.arange(4), torch.tensor([1, 0, 1, 0])))
    assert [int(a) for a, _ in pairs.filter(lambda a, keep: keep == 1)] == [0, 2]


def test_filter_errors():
    with pytest.raises(ValueError, match=r"one-element tensor. Received a tensor of shape \(2,\)"):
        list(Dataset.from_tensor_slices(torch.ones(3, 2)).filter(lambda row: row > 0))
    with pytest.raises(TypeError, match="filter's predicate must be callable"):
        Dataset.range(2).filter(None)


def test_enumerate_counts_from_start():
    pairs = list(Dataset.from_tensor_slices(["a", "b"]).enumerate(start=5))
    assert [(int(i), s) for i, s in pairs] == [(5, "a"), (6, "b")]
    assert pairs[0][0].dtype == torch.int64
    with pytest.raises(TypeError, match="enumerate's start must be an int"):
        Dataset.range(2).enumerate("0")


def test_cache_replays_the_first_complete_pass():
    calls = []

    def gen():
        for i in range(3):
            calls.append(i)
            yield i

    cached = Dataset.from_generator(gen).cache()
    it = iter(cached)
    next(it)  # an abandoned pass is not kept
    del it
    assert values(cached) == [0, 1, 2]
    assert values(cached) == [0, 1, 2]
    assert calls == [0, 0, 1, 2]


def test_cache_freezes_a_shuffled_order():
    cached = Dataset.range(20).shuffle(20, seed=1).cache()
    assert values(cached) == values(cached)
