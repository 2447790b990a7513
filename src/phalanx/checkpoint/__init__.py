"""Checkpoints: atomic, chief-only, restorable under any strategy (tf.train.Checkpoint)."""

from phalanx.checkpoint.checkpoint import Checkpoint, Counter
from phalanx.checkpoint.manager import CheckpointManager, latest_checkpoint
from phalanx.checkpoint.options import CheckpointOptions

__all__ = ["Checkpoint", "CheckpointManager", "CheckpointOptions", "Counter", "latest_checkpoint"]
