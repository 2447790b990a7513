"""Checkpoints: atomic, chief-only, restorable under any strategy (tf.train.Checkpoint)."""

from phalanx.checkpoint.checkpoint import Checkpoint, Counter
from phalanx.checkpoint.manager import CheckpointManager, latest_checkpoint

__all__ = ["Checkpoint", "CheckpointManager", "Counter", "latest_checkpoint"]
