"""tf.distribute.Strategy's input members: datasets and values distributed over replicas.

`Strategy` inherits these from `StrategyInput`. They only read what every strategy has (its
local replicas, its place among the workers) and hand the work to `phalanx.input`; a strategy
changes where input goes through its ``input_devices``, not here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from phalanx.values import PerReplica

if TYPE_CHECKING:
    from phalanx.input.input_options import InputContext, InputOptions
    from phalanx.protocols import DistributionStrategy

__all__ = ["StrategyInput", "ValueContext"]


class ValueContext:
    """What `experimental_distribute_values_from_function` passes to the value function."""

    replica_id_in_sync_group: int  # the replica the value is for, in [0, num_replicas_in_sync)
    num_replicas_in_sync: int

    def __init__(self, replica_id_in_sync_group: int = 0, num_replicas_in_sync: int = 1) -> None:
        self.replica_id_in_sync_group = replica_id_in_sync_group
        self.num_replicas_in_sync = num_replicas_in_sync

    def __repr__(self) -> str:
        return (
            f"ValueContext(replica_id_in_sync_group={self.replica_id_in_sync_group}, "
            f"num_replicas_in_sync={self.num_replicas_in_sync})"
        )


class StrategyInput:
    """The input members of tf.distribute.Strategy, over what `Strategy` provides."""

    if TYPE_CHECKING:  # what `Strategy` provides

        @property
        def num_replicas_in_sync(self) -> int: ...
        @property
        def num_local_replicas(self) -> int: ...
        @property
        def first_replica_id(self) -> int: ...

    def make_experimental_numpy_dataset(self, numpy_input: Any) -> Any:
        """A `phalanx.data.Dataset` with one element per row of ``numpy_input``
        (tf.distribute.Strategy's method of that name).

        TF copies the arrays once to each worker's host CPU instead of embedding them as graph
        constants. phalanx has no graph: the rows stay where NumPy put them, shared with the
        dataset's tensors (no copy). Batch it (``.batch(global_batch_size)``) and give it to
        `experimental_distribute_dataset` to split each batch across the replicas.

        Args:
            numpy_input: A NumPy array, or a tuple, list or dict of arrays with the same number
                of rows.

        Raises:
            ValueError: A leaf is not a NumPy array of rank >= 1, or the row counts differ.
        """
        from phalanx.data.dataset import Dataset

        _check_numpy_leaves(numpy_input, "numpy_input")
        return Dataset.from_tensor_slices(numpy_input)

    def experimental_distribute_dataset(self, dataset: Any, options: InputOptions | None = None) -> Any:
        """Splits each *global* batch of ``dataset`` across replicas (and workers).

        ``dataset`` yields global batches: a `DataLoader`, a `phalanx.data.Dataset`, or any
        iterable of batches (tensors, arrays, tuples or dicts of them).
        """
        from phalanx.input.distributed_dataset import DistributedDataset

        return DistributedDataset(cast("DistributionStrategy", self), dataset, options)

    def distribute_datasets_from_function(
        self, dataset_fn: Callable[[InputContext], Any], options: InputOptions | None = None
    ) -> Any:
        """Calls ``dataset_fn(InputContext)`` once per input pipeline (worker).

        The function's dataset yields *per-replica* batches; each step takes one batch per
        local replica.
        """
        from phalanx.input.distributed_dataset import DistributedDatasetsFromFunction

        return DistributedDatasetsFromFunction(cast("DistributionStrategy", self), dataset_fn, options)

    def experimental_distribute_values_from_function(self, value_fn: Callable[[ValueContext], Any]) -> Any:
        """Builds a per-replica value by calling ``value_fn(ValueContext)`` for each local replica."""
        base = self.first_replica_id
        values = [
            value_fn(ValueContext(base + i, self.num_replicas_in_sync))
            for i in range(self.num_local_replicas)
        ]
        return values[0] if len(values) == 1 else PerReplica(values)


def _check_numpy_leaves(value: Any, path: str) -> None:
    if isinstance(value, Mapping):
        for key, item in value.items():
            _check_numpy_leaves(item, f"{path}[{key!r}]")
    elif isinstance(value, (tuple, list)):
        for index, item in enumerate(value):
            _check_numpy_leaves(item, f"{path}[{index}]")
    elif not isinstance(value, np.ndarray) or value.ndim == 0:
        raise ValueError(
            "make_experimental_numpy_dataset takes NumPy arrays of rank >= 1, or tuples, lists or dicts "
            f"of them. Received: {path} = {type(value).__name__}"
            f"{' of rank 0' if isinstance(value, np.ndarray) else ''}. HINT: for tensors or other "
            "values use phalanx.data.Dataset.from_tensor_slices."
        )
