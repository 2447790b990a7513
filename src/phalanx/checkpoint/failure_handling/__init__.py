"""Preemption handling: save at the same step on every worker before a termination, exit, and
resume (tf.distribute.experimental's PreemptionCheckpointHandler, TerminationConfig and
PreemptionWatcher; TF keeps them in tensorflow/python/checkpoint/failure_handling).

`TerminationConfig` (termination.py) says what the notice is and how to exit; the decision at
each step boundary is a state machine (policy.py) fed with flags agreed in one all-reduce
(coordination.py); errors, notices and exits travel between workers by name through the
rendezvous store (board.py).
"""

from phalanx.checkpoint.failure_handling.coordination import PeerFailedError
from phalanx.checkpoint.failure_handling.handler import PreemptionCheckpointHandler
from phalanx.checkpoint.failure_handling.termination import TerminationConfig
from phalanx.checkpoint.failure_handling.watcher import PreemptionWatcher

__all__ = ["PeerFailedError", "PreemptionCheckpointHandler", "PreemptionWatcher", "TerminationConfig"]
