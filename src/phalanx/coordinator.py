"""The coordinator of a parameter-server cluster (tf.distribute.coordinator).

`ClusterCoordinator` schedules functions on the workers and returns `RemoteValue`\\ s;
`PerWorkerValues` (TF 2.21's ``PerWorkerValue``) and per-worker datasets give each worker its
own copy of a value; `experimental_get_current_worker_index` tells a scheduled function which
worker runs it. The code
lives in `phalanx.ps` (the coordinator in `phalanx.ps.coordinator`) and `phalanx.input.per_worker`;
this module is its public face.
"""

from phalanx.input.per_worker import OutOfRangeError, PerWorkerDataset, PerWorkerIterator, PerWorkerValues
from phalanx.ps.coordinator.closure import ClosureAbortedError
from phalanx.ps.coordinator.cluster_coordinator import ClusterCoordinator
from phalanx.ps.coordinator.remote_value import RemoteValue, RemoteValueStatus
from phalanx.ps.coordinator.worker_loss import NoWorkerAvailableError
from phalanx.ps.worker import context as _worker_context

__all__ = [
    "ClosureAbortedError",
    "ClusterCoordinator",
    "NoWorkerAvailableError",
    "OutOfRangeError",
    "PerWorkerDataset",
    "PerWorkerIterator",
    "PerWorkerValue",
    "PerWorkerValues",
    "RemoteValue",
    "RemoteValueStatus",
    "experimental_get_current_worker_index",
]

PerWorkerValue = PerWorkerValues  # TF 2.21's name (tf.distribute.coordinator.PerWorkerValue)


def experimental_get_current_worker_index() -> int:
    """The index of the worker running the current scheduled function.

    Raises:
        RuntimeError: Called outside a function run by `ClusterCoordinator.schedule`.
    """
    env = _worker_context.current()
    if env is None:
        raise RuntimeError(
            "experimental_get_current_worker_index() answers inside a function scheduled with "
            "ClusterCoordinator.schedule, on the worker that runs it; this thread runs none. "
            "HINT: call it inside the scheduled function."
        )
    return env.worker_index
