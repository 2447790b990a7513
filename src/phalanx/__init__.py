"""phalanx: tf.distribute's strategy system for PyTorch."""

__version__ = "0.1.0.dev0"
