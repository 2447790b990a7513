"""Per-worker input of a parameter-server cluster: one value, dataset or iterator per worker.

On the chief, `PerWorkerDataset` (from `ClusterCoordinator.create_per_worker_dataset`), the
`PerWorkerIterator` that ``iter()`` gives and `PerWorkerValues` are handed to scheduled
functions as arguments. They travel by reference (`phalanx.ps.pickling`): on a worker they
become that worker's own value, dataset and iterator, made there on first use (and made again
after the worker restarted, starting over, as in TF). The worker's side is here too:
`make_dataset` calls the dataset function and `WorkerIterator` raises `OutOfRangeError`.
"""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Callable, Iterator
from typing import Any

from phalanx.input.input_options import InputContext

__all__ = [
    "OutOfRangeError",
    "PerWorkerDataset",
    "PerWorkerIterator",
    "PerWorkerValues",
    "WorkerIterator",
    "make_dataset",
]

_ids = itertools.count()


class OutOfRangeError(Exception):
    """A per-worker iterator had no more data (tf.errors.OutOfRangeError)."""


# ---------------------------------------------------------------------- on the chief
class PerWorkerValues:
    """A tuple of values, one per worker (TF's ``PerWorkerValues``): given to a scheduled
    function, it becomes the value of the worker that runs it."""

    def __init__(self, values: tuple[Any, ...] | list[Any]) -> None:
        self._values = tuple(values)

    @property
    def values(self) -> tuple[Any, ...]:
        """The values, by worker index."""
        return self._values

    def __repr__(self) -> str:
        return f"PerWorkerValues({self._values!r})"


class PerWorkerDataset:
    """A dataset made on every worker by ``dataset_fn`` (called there, with an
    `InputContext` if it takes an argument). Iterate it (``iter``) on the chief to get a
    `PerWorkerIterator` for scheduled functions.

    Args:
        dataset_fn: Returns an iterable (a DataLoader, a phalanx Dataset, a list of batches...).
        dumps: Pickles ``dataset_fn`` for the workers (the cluster's pickling contract,
            `phalanx.ps.pickling.dumps`, which the coordinator passes).

    Raises:
        TypeError: ``dataset_fn`` is not callable.
    """

    def __init__(self, dataset_fn: Callable[..., Any], dumps: Callable[[Any], bytes]) -> None:
        if not callable(dataset_fn):
            raise TypeError(
                "create_per_worker_dataset takes a function that returns the dataset (it runs on "
                f"each worker). Received: {type(dataset_fn).__name__}. HINT: pass lambda: dataset."
            )
        self.dataset_id = f"dataset-{next(_ids)}"
        self.pickled_fn = dumps(dataset_fn)  # pickled once: every worker makes the same dataset

    def __iter__(self) -> PerWorkerIterator:
        return PerWorkerIterator(self)


class PerWorkerIterator:
    """An iterator per worker over its `PerWorkerDataset`; pass it to scheduled functions and
    call ``next()`` on it there. On the chief it cannot be advanced."""

    def __init__(self, dataset: PerWorkerDataset) -> None:
        self.dataset = dataset
        self.iterator_id = f"iterator-{next(_ids)}"

    def __next__(self) -> Any:
        raise RuntimeError(
            "A per-worker iterator is advanced on the workers, inside a scheduled function. "
            "HINT: coordinator.schedule(step_fn, args=(iterator,)) and call next(iterator) in step_fn."
        )

    def __iter__(self) -> PerWorkerIterator:
        return self


# ---------------------------------------------------------------------- on a worker
def make_dataset(dataset_fn: Callable[..., Any], num_workers: int, worker_index: int) -> Any:
    """Calls ``dataset_fn`` on worker ``worker_index``: with an `InputContext` (one input
    pipeline per worker) if it takes an argument, else without."""
    try:
        wants_context = len(inspect.signature(dataset_fn).parameters) >= 1
    except (TypeError, ValueError):
        wants_context = False
    if not wants_context:
        return dataset_fn()
    return dataset_fn(InputContext(num_input_pipelines=num_workers, input_pipeline_id=worker_index))


class WorkerIterator:
    """A worker's iterator of a per-worker dataset; exhaustion raises `OutOfRangeError`.

    Args:
        iterator: The iterator over the worker's dataset.
        worker_index: This worker, for the error message.
    """

    def __init__(self, iterator: Iterator[Any], worker_index: int) -> None:
        self._iterator, self._worker = iterator, worker_index

    def __iter__(self) -> WorkerIterator:
        return self

    def __next__(self) -> Any:
        try:
            return next(self._iterator)
        except StopIteration:
            raise OutOfRangeError(
                f"The per-worker dataset of worker {self._worker} is exhausted. HINT: repeat the "
                "dataset (dataset.repeat()) and schedule a fixed number of steps per epoch, as with TF."
            ) from None

    def get_next(self) -> Any:
        """The next element (TF's spelling)."""
        return next(self)
