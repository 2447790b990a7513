"""TensorBoard: scalar summaries of the logs, through ``torch.utils.tensorboard`` (optional extra)."""

from __future__ import annotations

import os
from typing import Any

import torch

from phalanx.callbacks._distributed_files import remove_temp_dir_with_filepath, strategy_of, write_filepath
from phalanx.callbacks.callback import Callback, Logs

__all__ = ["TensorBoard"]


def _summary_writer_class() -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as exc:  # the optional extra is missing
        raise ImportError(
            "phalanx.callbacks.TensorBoard needs the tensorboard package. HINT: "
            "pip install 'phalanx[tensorboard]'."
        ) from exc
    return SummaryWriter


def _scalar(value: Any) -> float | None:
    try:
        tensor = torch.as_tensor(value, dtype=torch.float64)
    except (TypeError, ValueError, RuntimeError):
        return None
    return float(tensor) if tensor.numel() == 1 else None


class TensorBoard(Callback):
    """Writes the logs as TensorBoard scalars, Keras' layout.

    ``<log_dir>/train`` gets ``epoch_<key>`` for every epoch (and ``batch_<key>`` every
    ``update_freq`` batches when it is an integer); ``<log_dir>/validation`` gets the
    ``val_`` keys without their prefix. Every worker runs it; the chief writes ``log_dir``,
    the others a temporary folder that is removed when training ends.

    Args:
        log_dir: Folder of the event files.
        update_freq: "epoch", "batch" (= 1) or a number of batches.

    Raises:
        ImportError: tensorboard is not installed (``pip install 'phalanx[tensorboard]'``).
        ValueError: ``update_freq`` is not "epoch", "batch" or a positive integer.
    """

    def __init__(self, log_dir: str = "logs", update_freq: str | int = "epoch") -> None:
        super().__init__()
        self._writer_class = _summary_writer_class()
        if update_freq == "batch":
            update_freq = 1
        if update_freq != "epoch" and (
            isinstance(update_freq, bool) or not isinstance(update_freq, int) or update_freq < 1
        ):
            raise ValueError(
                f"update_freq must be 'epoch', 'batch' or a positive integer. Received: {update_freq!r}. "
                "HINT: update_freq=100 writes batch summaries every 100 batches."
            )
        self.log_dir, self.update_freq = os.fspath(log_dir), update_freq
        self._writers: dict[str, Any] = {}
        self._write_dir = self.log_dir
        self._train_step = 0

    def _writer(self, kind: str) -> Any:
        if kind not in self._writers:
            self._writers[kind] = self._writer_class(os.path.join(self._write_dir, kind))
        return self._writers[kind]

    def on_train_begin(self, logs: Logs = None) -> None:
        self._write_dir = write_filepath(self.log_dir, strategy_of(self.model))
        self._train_step = 0

    def on_train_batch_end(self, batch: int, logs: Logs = None) -> None:
        self._train_step += 1
        if isinstance(self.update_freq, int) and self._train_step % self.update_freq == 0:
            self._write("train", "batch_", logs or {}, self._train_step)

    def on_epoch_end(self, epoch: int, logs: Logs = None) -> None:
        logs = logs or {}
        self._write("train", "epoch_", {k: v for k, v in logs.items() if not k.startswith("val_")}, epoch)
        validation = {k.removeprefix("val_"): v for k, v in logs.items() if k.startswith("val_")}
        if validation:
            self._write("validation", "epoch_", validation, epoch)

    def _write(self, kind: str, prefix: str, logs: dict[str, Any], step: int) -> None:
        writer = self._writer(kind)
        for key, value in logs.items():
            scalar = _scalar(value)
            if scalar is not None:
                writer.add_scalar(f"{prefix}{key}", scalar, step)
        writer.flush()

    def on_train_end(self, logs: Logs = None) -> None:
        for writer in self._writers.values():
            writer.close()
        self._writers = {}
        remove_temp_dir_with_filepath(self._write_dir, strategy_of(self.model))
