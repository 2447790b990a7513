"""tf.distribute.DistributedDataset's and DistributedIterator's ``element_spec`` and ``reduce``.

Both distributed datasets inherit `DistributedDatasetMembers`; the iterators they make are
given their dataset's spec (``spec_source``), so ``iterator.element_spec`` answers before any step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from phalanx.input.element_spec import spec_of
from phalanx.input.splitting import as_tensors

if TYPE_CHECKING:
    from phalanx.protocols import DistributionStrategy

__all__ = ["DistributedDatasetMembers", "DistributedIteratorMembers"]


class DistributedDatasetMembers:
    """``element_spec`` and ``reduce`` for a distributed dataset."""

    _strategy: DistributionStrategy
    _cached_spec: Any = None

    if TYPE_CHECKING:  # what each dataset provides

        def _first_replica_batch(self) -> Any:
            """One replica's first batch (from a fresh pass of the source); None if empty."""

        def __iter__(self) -> Iterator[Any]: ...

    @property
    def element_spec(self) -> Any:
        """The `TensorSpec` structure of one replica's batch (batch dimension None), or a
        `PerReplicaSpec` of them with several local replicas (tf.distribute's element_spec).

        The source declares no spec, so its first batch is read once, from a fresh pass.

        Raises:
            ValueError: The dataset is empty.
        """
        if self._cached_spec is None:
            batch = self._first_replica_batch()
            if batch is None:
                raise ValueError("The element_spec of an empty dataset is unknown: it has no element.")
            self._cached_spec = spec_of(as_tensors(batch), self._strategy.num_local_replicas)
        return self._cached_spec

    def _spec(self) -> Any:
        """`element_spec`, for the iterators this dataset makes (read when they are asked)."""
        return self.element_spec

    def reduce(self, initial_state: Any, reduce_func: Callable[[Any, Any], Any]) -> Any:
        """Folds ``reduce_func(state, element)`` over every distributed element (all workers).

        Each element is what the iterator yields (a `PerReplica` value with several local
        replicas); the final state is returned, as tf.distribute's DistributedDataset.reduce.
        """
        state = initial_state
        for element in self:
            state = reduce_func(state, element)
        return state


class DistributedIteratorMembers:
    """``element_spec`` for a distributed iterator: its dataset's (``_spec_source``, which the
    iterator's constructor sets)."""

    _spec_source: Callable[[], Any] | None = None

    @property
    def element_spec(self) -> Any:
        """The spec of the values this iterator yields (see `DistributedDataset.element_spec`)."""
        if self._spec_source is None:
            raise ValueError(
                "This iterator was not made by a distributed dataset, so its element_spec is unknown."
            )
        return self._spec_source()
