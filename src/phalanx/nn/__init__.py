"""Layers and loss helpers that know about distribution (mirrors tf.nn)."""

from phalanx.nn.losses import compute_average_loss, scale_regularization_loss
from phalanx.nn.sync_batch_norm import SyncBatchNorm

__all__ = ["SyncBatchNorm", "compute_average_loss", "scale_regularization_loss"]
