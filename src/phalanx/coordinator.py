"""The coordinator of a parameter-server cluster (tf.distribute.coordinator).

`ClusterCoordinator` schedules functions on the workers and returns `RemoteValue`\\ s;
`PerWorkerValues` and per-worker datasets give each worker its own copy of a value. The code
lives in `phalanx.ps` (the coordinator in `phalanx.ps.coordinator`) and `phalanx.input.per_worker`;
this module is its public face.
"""

from phalanx.input.per_worker import OutOfRangeError, PerWorkerDataset, PerWorkerIterator, PerWorkerValues
from phalanx.ps.coordinator.closure import ClosureAbortedError
from phalanx.ps.coordinator.cluster_coordinator import ClusterCoordinator
from phalanx.ps.coordinator.remote_value import RemoteValue, RemoteValueStatus
from phalanx.ps.coordinator.worker_loss import NoWorkerAvailableError

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
