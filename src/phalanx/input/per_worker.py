"""Per-worker values: one per worker, resolved on the worker a scheduled function runs on.

`PerWorkerDataset` (from `ClusterCoordinator.create_per_worker_dataset`) and the
`PerWorkerIterator` that ``iter()`` gives are handed to scheduled functions as arguments;
on a worker they become that worker's own dataset and iterator, made there on first use
(and made again after the worker restarted, starting over, as in TF).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

from phalanx.ps import pickling

__all__ = ["PerWorkerDataset", "PerWorkerIterator", "PerWorkerValues"]

_ids = itertools.count()


class PerWorkerValues:
    """A tuple of values, one per worker (TF's ``PerWorkerValues``): given to a scheduled
    function, it becomes the value of the worker that runs it."""

    def __init__(self, values: tuple[Any, ...] | list[Any]) -> None:
        self._values = tuple(values)

    def __reduce__(self) -> Any:
        from phalanx.ps.worker.environment import _worker_value

        return _worker_value, (self._values,)

    @property
    def values(self) -> tuple[Any, ...]:
        """The values, by worker index."""
        return self._values

    def __repr__(self) -> str:
        return f"PerWorkerValues({self._values!r})"


class PerWorkerDataset:
    """A dataset made on every worker by ``dataset_fn`` (called there, with an
    `InputContext` if it takes an argument). Iterate it (``iter``) on the coordinator to get a
    `PerWorkerIterator` for scheduled functions.

    Args:
        dataset_fn: Returns an iterable (a DataLoader, a phalanx Dataset, a list of batches...).
    """

    def __init__(self, dataset_fn: Callable[..., Any]) -> None:
        if not callable(dataset_fn):
            raise TypeError(
                "create_per_worker_dataset takes a function that returns the dataset (it runs on "
                f"each worker). Received: {type(dataset_fn).__name__}. HINT: pass lambda: dataset."
            )
        self._id = f"dataset-{next(_ids)}"
        self._make = pickling.dumps(dataset_fn)

    def __iter__(self) -> PerWorkerIterator:
        return PerWorkerIterator(self)

    def __reduce__(self) -> Any:
        from phalanx.ps.worker.environment import _worker_dataset

        return _worker_dataset, (self._id, self._make)


class PerWorkerIterator:
    """An iterator per worker over its `PerWorkerDataset`; pass it to scheduled functions and
    call ``next()`` on it there. On the coordinator it cannot be advanced."""

    def __init__(self, dataset: PerWorkerDataset) -> None:
        self._dataset = dataset
        self._id = f"iterator-{next(_ids)}"

    def __next__(self) -> Any:
        raise RuntimeError(
            "A per-worker iterator is advanced on the workers, inside a scheduled function. "
            "HINT: coordinator.schedule(step_fn, args=(iterator,)) and call next(iterator) in step_fn."
        )

    def __iter__(self) -> PerWorkerIterator:
        return self

    def __reduce__(self) -> Any:
        from phalanx.ps.worker.environment import _worker_iterator

        return _worker_iterator, (self._id, self._dataset._id, self._dataset._make)
