"""Layers and loss helpers that know about distribution (mirrors tf.nn; the loss helpers live in
`phalanx.losses` and are re-exported here under their tf.nn names)."""

from phalanx.losses.averaging import compute_average_loss, scale_regularization_loss
from phalanx.nn.sync_batch_norm import SyncBatchNorm

__all__ = ["SyncBatchNorm", "compute_average_loss", "scale_regularization_loss"]
