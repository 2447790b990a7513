"""tf.distribute.Strategy's input members: datasets and values distributed over replicas.

`Strategy` inherits these from `StrategyInput`. They only read what every strategy has (its
local replicas, its place among the workers) and hand the work to `phalanx.input`; a strategy
changes where input goes through its ``_fetch_devices`` hook, not here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

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
        """A dataset of the rows of ``numpy_input`` (tf.distribute.Strategy's method of that
        name); see `phalanx.data.numpy_dataset.make_numpy_dataset`, which it calls."""
        from phalanx.data.numpy_dataset import make_numpy_dataset

        return make_numpy_dataset(numpy_input)

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
