"""Distributed input: how batches reach replicas (``phalanx.input``).

* `distributed_dataset`: `Strategy.experimental_distribute_dataset` and
  `distribute_datasets_from_function` — global batches in, one slice per replica out, TF's
  split rule, the has-data agreement across workers.
* `input_options`: `InputOptions`, `InputContext`, `AutoShardPolicy`.
* `splitting`: how one global batch is cut into replica slices.
* `per_worker`: the per-worker datasets of parameter-server training
  (`ClusterCoordinator.create_per_worker_dataset`).
"""

from phalanx.input.distributed_dataset import (
    DistributedDataset,
    DistributedDatasetsFromFunction,
    DistributedIterator,
    Optional,
)
from phalanx.input.input_options import AutoShardPolicy, InputContext, InputOptions
from phalanx.input.per_worker import OutOfRangeError, PerWorkerDataset, PerWorkerIterator, PerWorkerValues

__all__ = [
    "AutoShardPolicy",
    "DistributedDataset",
    "DistributedDatasetsFromFunction",
    "DistributedIterator",
    "InputContext",
    "InputOptions",
    "Optional",
    "OutOfRangeError",
    "PerWorkerDataset",
    "PerWorkerIterator",
    "PerWorkerValues",
]
