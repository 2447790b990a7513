"""The errors a distributed program catches, in one place (as ``tf.errors``).

`CollectiveMismatchError`: workers (or replicas) called different collectives
(docs/multi_worker.md, "Mismatched collectives"). `PeerUnavailableError`: another worker died,
stopped answering or never joined (docs/multi_worker.md, "Failures"). `BelowMinimumWorkersError`
(a `PeerUnavailableError`): an elastic job lost workers below its ``--min-workers``
(docs/multi_worker.md, "Elastic training").
"""

from phalanx.communication.health import PeerUnavailableError
from phalanx.communication.membership import BelowMinimumWorkersError
from phalanx.communication.stall_inspector import CollectiveMismatchError

__all__ = ["BelowMinimumWorkersError", "CollectiveMismatchError", "PeerUnavailableError"]
