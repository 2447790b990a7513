"""``phalanx.experimental``: tf.distribute.experimental's names, for programs ported from TF.

``phalanx.experimental.MultiWorkerMirroredStrategy`` *is* ``phalanx.MultiWorkerMirroredStrategy``
(and the same for the other names): TF moved these out of ``experimental`` over time, and both
spellings keep working. ``CollectiveCommunication`` is TF's deprecated name of
`CommunicationImplementation`; using it warns with a `DeprecationWarning` (it is left out of
``__all__`` so that a star import does not warn).
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

from phalanx.communication.communication_options import CommunicationImplementation, CommunicationOptions
from phalanx.strategies import CentralStorageStrategy, MultiWorkerMirroredStrategy, ParameterServerStrategy
from phalanx.strategies.fully_sharded import FullyShardedStrategy

if TYPE_CHECKING:
    CollectiveCommunication = CommunicationImplementation

__all__ = [
    "CentralStorageStrategy",
    "CommunicationImplementation",
    "CommunicationOptions",
    "FullyShardedStrategy",
    "MultiWorkerMirroredStrategy",
    "ParameterServerStrategy",
]

_DEPRECATED = {
    "CollectiveCommunication": (
        CommunicationImplementation,
        "phalanx.experimental.CollectiveCommunication is deprecated (as in TensorFlow): use "
        "phalanx.experimental.CommunicationImplementation (the same enum), e.g. "
        "CommunicationOptions(implementation=CommunicationImplementation.RING).",
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
