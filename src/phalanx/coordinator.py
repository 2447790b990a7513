"""The coordinator of a parameter-server cluster (tf.distribute.coordinator).

`ClusterCoordinator` schedules functions on the workers and returns `RemoteValue`\\ s;
`PerWorkerValues` and per-worker datasets give each worker its own copy of a value.
"""

from phalanx.input.per_worker import PerWorkerDataset, PerWorkerIterator, PerWorkerValues
from phalanx.ps.coordinator.closure import ClosureAbortedError
from phalanx.ps.coordinator.cluster_coordinator import ClusterCoordinator, NoWorkerAvailableError
from phalanx.ps.coordinator.remote_value import RemoteValue, RemoteValueStatus
from phalanx.ps.worker.environment import OutOfRangeError

__all__ = [
    "ClosureAbortedError",
    "ClusterCoordinator",
    "NoWorkerAvailableError",
    "OutOfRangeError",
    "PerWorkerDataset",
    "PerWorkerIterator",
    "PerWorkerValues",
    "RemoteValue",
    "RemoteValueStatus",
]
