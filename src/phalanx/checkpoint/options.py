"""CheckpointOptions (tf.train.CheckpointOptions) and the background writer they enable.

With ``enable_async=True`` a save snapshots the state (tensors copied to the CPU) on the
calling thread, then writes the file on a background thread, so training continues while
the bytes go to disk; ``Checkpoint.sync()`` waits for it and raises its error if any. One
write is outstanding at a time: the next save waits for the previous one first (TF's rule).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from phalanx.checkpoint._files import atomic_save, chief_path

__all__ = ["CheckpointOptions", "CheckpointWriter"]

WRITE_TIMEOUT_SECONDS = 3600.0


@dataclass(frozen=True)
class CheckpointOptions:
    """Options of `Checkpoint.write`/``save``/``read``/``restore`` (tf.train.CheckpointOptions).

    Args:
        experimental_io_device: Where TF runs its file ops; phalanx writes through the host,
            so only None or a CPU device is accepted.
        experimental_enable_async_checkpoint: TF's older name of ``enable_async``.
        experimental_write_callbacks: Called with the written path after each write.
        enable_async: Write in the background (see the module doc).
        experimental_sharding_callback: TF's tensor-slicing policy for sharded files; phalanx
            writes one file, so only None is accepted.
        experimental_skip_slot_variables: On restore, leave optimizers' state (TF's slot
            variables) as it is.

    Raises:
        ValueError: A non-CPU ``experimental_io_device`` or a sharding callback.
    """

    experimental_io_device: str | None = None
    experimental_enable_async_checkpoint: bool = False
    experimental_write_callbacks: Sequence[Callable[[str], Any]] | None = None
    enable_async: bool = False
    experimental_sharding_callback: Any = None
    experimental_skip_slot_variables: bool = False

    def __post_init__(self) -> None:
        device = self.experimental_io_device
        if device is not None and "cpu" not in device.lower():
            raise ValueError(
                "experimental_io_device must be None or a CPU device: phalanx writes checkpoints "
                f"from host memory. Received: {device!r}. HINT: leave it None."
            )
        if self.experimental_sharding_callback is not None:
            raise ValueError(
                "experimental_sharding_callback shards TensorFlow's checkpoint files; phalanx's "
                "Checkpoint writes one file. HINT: for sharded checkpoints of large models use "
                "torch.distributed.checkpoint (DCP)."
            )

    @property
    def asynchronous(self) -> bool:
        """Whether writes go to the background."""
        return self.enable_async or self.experimental_enable_async_checkpoint


def _cpu_copy(state: Any) -> Any:
    return torch.utils._pytree.tree_map(
        lambda v: v.detach().to("cpu", copy=True) if isinstance(v, torch.Tensor) else v, state
    )


class CheckpointWriter:
    """Writes a checkpoint's payloads, in the foreground or on one background thread."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._path = ""
        self._error: BaseException | None = None

    def write(self, payload: Any, path: str, options: CheckpointOptions | None, strategy: Any) -> None:
        """Writes ``payload`` to ``path`` (the chief's file is kept; see `chief_path`)."""
        self.sync()
        options = options or CheckpointOptions()
        callbacks = list(options.experimental_write_callbacks or ())

        def write_now(state: Any) -> None:
            with chief_path(path, strategy) as target:
                atomic_save(state, target)
            for callback in callbacks:
                callback(path)

        if not options.asynchronous:
            write_now(payload)
            return
        snapshot = _cpu_copy(payload)  # training may change the tensors while the file is written

        def background() -> None:
            try:
                write_now(snapshot)
            except BaseException as error:  # handed to sync()
                self._error = error

        self._path = path
        self._thread = threading.Thread(target=background, name=f"phalanx-checkpoint {path}", daemon=True)
        self._thread.start()

    def sync(self, timeout: float = WRITE_TIMEOUT_SECONDS) -> None:
        """Waits for the background write, if any.

        Raises:
            TimeoutError: The write took longer than ``timeout`` seconds (it is named).
            Exception: The background write's error.
        """
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise TimeoutError(
                    f"The background write of checkpoint {self._path!r} did not finish in {timeout} s. "
                    "HINT: check the disk (full, or a slow network file system)."
                )
            self._thread = None
        error, self._error = self._error, None
        if error is not None:
            raise error
