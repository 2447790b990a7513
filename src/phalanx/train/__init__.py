"""``phalanx.train``: TF1's ``tf.train`` cluster names, for programs ported from TF1.

TF1's distributed training (the "Distributed TensorFlow" article) with these names:
``ClusterSpec`` and ``Server`` (every task), `replica_device_setter` (variables on the ps
tasks, between-graph replication: every worker runs its own loop), and
`MonitoredTrainingSession` with its hooks (chief-only initialisation, a global step,
checkpoints, summaries, recovery). docs/tf1_cluster_and_estimator.md walks through them.

A client outside the cluster that drives the workers (the article's session target) uses
``phalanx.ParameterServerStrategy(SimpleClusterResolver(cluster))`` with a
``ClusterCoordinator``.
"""

from phalanx.checkpoint import Checkpoint, CheckpointManager, latest_checkpoint
from phalanx.cluster.cluster_spec import ClusterSpec
from phalanx.server import Server
from phalanx.strategies.between_graph import BetweenGraphStrategy, replica_device_setter
from phalanx.train.hooks import (
    CheckpointSaverHook,
    CheckpointSaverListener,
    SessionRunContext,
    SessionRunHook,
    SessionRunValues,
    StepCounterHook,
    StopAtStepHook,
    SummarySaverHook,
)
from phalanx.train.session import USE_DEFAULT, MonitoredTrainingSession, Scaffold

__all__ = [
    "USE_DEFAULT",
    "BetweenGraphStrategy",
    "Checkpoint",
    "CheckpointManager",
    "CheckpointSaverHook",
    "CheckpointSaverListener",
    "ClusterSpec",
    "MonitoredTrainingSession",
    "Scaffold",
    "Server",
    "SessionRunContext",
    "SessionRunHook",
    "SessionRunValues",
    "StepCounterHook",
    "StopAtStepHook",
    "SummarySaverHook",
    "latest_checkpoint",
    "replica_device_setter",
]
