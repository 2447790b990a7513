"""Per-worker input: the chief's handles and the worker's datasets and iterators (no processes)."""

from __future__ import annotations

import pytest

from phalanx.input.per_worker import (
    OutOfRangeError,
    PerWorkerDataset,
    PerWorkerValues,
    WorkerIterator,
    make_dataset,
)
from phalanx.ps.pickling import dumps


def test_a_dataset_function_taking_an_argument_gets_an_input_context():
    contexts = []
    assert make_dataset(lambda ctx: contexts.append(ctx) or [1], num_workers=3, worker_index=2) == [1]
    (context,) = contexts
    assert (context.num_input_pipelines, context.input_pipeline_id) == (3, 2)
    assert make_dataset(lambda: [5], num_workers=3, worker_index=2) == [5]


def test_an_exhausted_worker_iterator_is_out_of_range_and_names_the_worker():
    iterator = WorkerIterator(iter([1]), worker_index=4)
    assert iterator.get_next() == 1
    with pytest.raises(OutOfRangeError, match=r"dataset of worker 4 is exhausted\. HINT: repeat"):
        next(iterator)


def test_on_the_chief_a_per_worker_iterator_cannot_advance():
    iterator = iter(PerWorkerDataset(lambda: [1, 2], dumps))
    assert iter(iterator) is iterator
    with pytest.raises(RuntimeError, match="advanced on the workers.*HINT"):
        next(iterator)


def test_a_per_worker_dataset_needs_a_function():
    with pytest.raises(TypeError, match=r"takes a function.*Received: list\. HINT"):
        PerWorkerDataset([1, 2], dumps)


def test_per_worker_values_keep_one_value_per_worker():
    values = PerWorkerValues(["a", "b"])
    assert values.values == ("a", "b")
    assert repr(values) == "PerWorkerValues(('a', 'b'))"
