"""The errors a distributed program catches, in one place (as ``tf.errors``).

`CollectiveMismatchError`: workers (or replicas) called different collectives
(docs/multi_worker.md, "Mismatched collectives"). `PeerUnavailableError`: another worker died,
stopped answering or never joined (docs/multi_worker.md, "Failures"). `BelowMinimumWorkersError`
(a `PeerUnavailableError`): an elastic job lost workers below its ``--min-workers``
(docs/multi_worker.md, "Elastic training").
"""

from phalanx.communication.checks.health import PeerUnavailableError
from phalanx.communication.checks.stall_inspector import CollectiveMismatchError
from phalanx.communication.membership.membership import BelowMinimumWorkersError

__all__ = ["BelowMinimumWorkersError", "CollectiveMismatchError", "PeerUnavailableError"]
