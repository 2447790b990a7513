"""``phalanx.experimental``: tf.distribute.experimental's names, for programs ported from TF.

``phalanx.experimental.MultiWorkerMirroredStrategy`` *is* ``phalanx.MultiWorkerMirroredStrategy``
(and the same for the other names): TF moved these out of ``experimental`` over time, and both
spellings keep working. ``CollectiveCommunication`` is TF's deprecated name of
`CommunicationImplementation`; using it warns with a `DeprecationWarning` (it is left out of
``__all__`` so that a star import does not warn); so is ``CollectiveHints``, TF's deprecated
form of `CommunicationOptions`.

The rest of tf.distribute.experimental: ``ValueContext``, the preemption handling
(``PreemptionCheckpointHandler``, ``TerminationConfig``, ``PreemptionWatcher``), and the
submodules ``coordinator`` (`phalanx.coordinator`), ``partitioners``
(`phalanx.partitioners`) and ``rpc`` (`phalanx.rpc`).
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

from phalanx import coordinator, partitioners, rpc
from phalanx.checkpoint.failure_handling import (
    PreemptionCheckpointHandler,
    PreemptionWatcher,
    TerminationConfig,
)
from phalanx.communication.local.options import CommunicationImplementation, CommunicationOptions
from phalanx.distribution import DeviceMesh, LayoutMap, TensorLayout
from phalanx.strategies import CentralStorageStrategy, MultiWorkerMirroredStrategy, ParameterServerStrategy
from phalanx.strategies.fully_sharded import FullyShardedStrategy
from phalanx.strategies.model_parallel import ModelParallelStrategy
from phalanx.strategies.strategy import ValueContext

if TYPE_CHECKING:
    CollectiveCommunication = CommunicationImplementation
    CollectiveHints = CommunicationOptions

__all__ = [
    "CentralStorageStrategy",
    "CommunicationImplementation",
    "CommunicationOptions",
    "DeviceMesh",
    "FullyShardedStrategy",
    "LayoutMap",
    "ModelParallelStrategy",
    "MultiWorkerMirroredStrategy",
    "ParameterServerStrategy",
    # tfsurface: the rest of tf.distribute.experimental
    "PreemptionCheckpointHandler",
    "PreemptionWatcher",
    "TensorLayout",
    "TerminationConfig",
    "ValueContext",
    "coordinator",
    "partitioners",
    "rpc",
]

_DEPRECATED = {
    "CollectiveCommunication": (
        CommunicationImplementation,
        "phalanx.experimental.CollectiveCommunication is deprecated (as in TensorFlow): use "
        "phalanx.experimental.CommunicationImplementation (the same enum), e.g. "
        "CommunicationOptions(implementation=CommunicationImplementation.RING).",
    ),
    "CollectiveHints": (
        CommunicationOptions,
        "phalanx.experimental.CollectiveHints is deprecated (as in TensorFlow): use "
        "phalanx.experimental.CommunicationOptions, which takes the same bytes_per_pack and "
        "timeout_seconds.",
    ),
}


def __getattr__(name: str) -> Any:
    """Returns a deprecated name's replacement, with a `DeprecationWarning` that names it.

    Raises:
        AttributeError: Not a name of this module.
    """
    if name in _DEPRECATED:
        value, message = _DEPRECATED[name]
        warnings.warn(message, DeprecationWarning, stacklevel=2)
        return value
    raise AttributeError(f"module 'phalanx.experimental' has no attribute {name!r}")
