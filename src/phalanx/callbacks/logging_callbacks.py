"""CSVLogger, TerminateOnNaN, LambdaCallback and TensorBoard."""

from __future__ import annotations

import csv
import math
import os
from collections.abc import Callable
from typing import Any

from phalanx.callbacks.callback import Callback, Logs

__all__ = ["CSVLogger", "LambdaCallback", "TensorBoard", "TerminateOnNaN"]


def _is_chief(model: Any) -> bool:
    strategy = getattr(model, "strategy", None)
    return strategy is None or bool(strategy.is_chief)


class CSVLogger(Callback):
    """Appends one row of epoch logs per epoch to a CSV file (chief only).

    Under several workers every worker computes the logs (reads may be collectives); only
    the chief writes the file.
    """

    def __init__(self, filename: str, separator: str = ",", append: bool = False) -> None:
        super().__init__()
        self.filename, self.sep, self.append = filename, separator, append
        self._keys: list[str] | None = None

    def on_train_begin(self, logs: Logs = None) -> None:
        self._keys = None
        if _is_chief(self.model) and not self.append and os.path.exists(self.filename):
            os.remove(self.filename)

    def on_epoch_end(self, epoch: int, logs: Logs = None) -> None:
        logs = dict(logs or {})
        if not _is_chief(self.model):
            return
        if self._keys is None:
            self._keys = sorted(logs)
        new_file = not os.path.exists(self.filename) or os.path.getsize(self.filename) == 0
        with open(self.filename, "a", newline="", encoding="utf-8") as f:
            writer = csv.writer(f, delimiter=self.sep)
            if new_file:
                writer.writerow(["epoch", *self._keys])
            writer.writerow([epoch, *(logs.get(k, "NA") for k in self._keys)])


class TerminateOnNaN(Callback):
    """Stops training when the loss becomes NaN or infinite."""

    def on_train_batch_end(self, batch: int, logs: Logs = None) -> None:
        loss = (logs or {}).get("loss")
        if loss is not None and (math.isnan(float(loss)) or math.isinf(float(loss))):
            print(f"Batch {batch}: Invalid loss, terminating training")
            self.model.stop_training = True


class LambdaCallback(Callback):
    """A callback from plain functions, e.g. ``LambdaCallback(on_epoch_end=lambda e, logs: ...)``."""

    def __init__(self, **hooks: Callable[..., Any]) -> None:
        super().__init__()
        for name, fn in hooks.items():
            if not name.startswith("on_") or not hasattr(Callback, name):
                raise ValueError(f"LambdaCallback got an unknown hook {name!r}.")
            setattr(self, name, fn)


class TensorBoard(Callback):
    """Writes epoch logs as TensorBoard scalars (chief only), via ``torch.utils.tensorboard``.

    Raises:
        ImportError: tensorboard is not installed (``pip install phalanx[tensorboard]``).
    """

    def __init__(self, log_dir: str = "logs", update_freq: str | int = "epoch") -> None:
        super().__init__()
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:  # the optional extra is missing
            raise ImportError(
                "TensorBoard needs the tensorboard package. HINT: pip install 'phalanx[tensorboard]'."
            ) from exc
        self._writer_cls = SummaryWriter
        self.log_dir, self.update_freq = log_dir, update_freq
        self._writer: Any = None
        self._step = 0

    def on_train_begin(self, logs: Logs = None) -> None:
        if _is_chief(self.model):
            self._writer = self._writer_cls(self.log_dir)

    def on_train_batch_end(self, batch: int, logs: Logs = None) -> None:
        self._step += 1
        if (
            self._writer is not None
            and isinstance(self.update_freq, int)
            and self._step % self.update_freq == 0
        ):
            for key, value in (logs or {}).items():
                self._writer.add_scalar(f"batch_{key}", float(value), self._step)

    def on_epoch_end(self, epoch: int, logs: Logs = None) -> None:
        if self._writer is not None:
            for key, value in (logs or {}).items():
                self._writer.add_scalar(f"epoch_{key}", float(value), epoch)
            self._writer.flush()

    def on_train_end(self, logs: Logs = None) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
