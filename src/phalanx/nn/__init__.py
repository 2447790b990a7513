"""Layers and loss helpers that know about distribution (mirrors tf.nn)."""

from phalanx.nn.losses import compute_average_loss, scale_regularization_loss

__all__ = ["compute_average_loss", "scale_regularization_loss"]
