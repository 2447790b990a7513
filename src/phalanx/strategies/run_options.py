"""tf.distribute.RunOptions: options of `Strategy.run`."""

from __future__ import annotations

from typing import Any, NamedTuple

__all__ = ["RunOptions", "check_run_options"]


class RunOptions(NamedTuple):
    """Options of `Strategy.run` (tf.distribute.RunOptions).

    TensorFlow reads all three on TPUs only (XLA compilation of the replicated function);
    its CPU and GPU strategies accept and ignore them, and so does phalanx, whose ``run``
    calls the function eagerly with batches of any shape.

    Args:
        experimental_enable_dynamic_batch_size: TPU: whether batch sizes may vary.
        experimental_bucketizing_dynamic_shape: TPU: pad dynamic shapes into buckets.
        experimental_xla_options: TPU: ``tf.tpu.XLAOptions``.
    """

    experimental_enable_dynamic_batch_size: bool = True
    experimental_bucketizing_dynamic_shape: bool = False
    experimental_xla_options: Any = None


def check_run_options(options: Any) -> None:
    """Refuses anything but a `RunOptions` or None (TF raises for other values too).

    Raises:
        TypeError: ``options`` is another type.
    """
    if options is not None and not isinstance(options, RunOptions):
        raise TypeError(
            "Strategy.run's options must be a phalanx.RunOptions or None. "
            f"Received: {type(options).__name__}."
        )
