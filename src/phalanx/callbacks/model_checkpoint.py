"""ModelCheckpoint: save the model (or its weights) every epoch or every N batches."""

from __future__ import annotations

import warnings
from typing import Any

from phalanx.callbacks._monitor import improvement
from phalanx.callbacks.callback import Callback, Logs

__all__ = ["ModelCheckpoint"]


class ModelCheckpoint(Callback):
    """Saves with ``model.save`` or ``model.save_weights`` (all workers; chief's file kept).

    ``filepath`` may contain ``{epoch}`` (1-based, format specs allowed: ``{epoch:02d}``) and
    any log key (``{val_loss:.2f}``).

    Raises:
        ValueError: ``save_freq`` is neither "epoch" nor a positive integer.
    """

    def __init__(
        self,
        filepath: str,
        monitor: str = "val_loss",
        verbose: int = 0,
        save_best_only: bool = False,
        save_weights_only: bool = False,
        mode: str = "auto",
        save_freq: str | int = "epoch",
        initial_value_threshold: float | None = None,
    ) -> None:
        super().__init__()
        if save_freq != "epoch" and (
            isinstance(save_freq, bool) or not isinstance(save_freq, int) or save_freq <= 0
        ):
            raise ValueError(f"save_freq must be 'epoch' or a positive integer. Received: {save_freq!r}.")
        self.filepath, self.monitor, self.verbose = filepath, monitor, verbose
        self.save_best_only, self.save_weights_only, self.save_freq = (
            save_best_only,
            save_weights_only,
            save_freq,
        )
        self._better, initial = improvement(monitor, mode)
        self.best = initial if initial_value_threshold is None else float(initial_value_threshold)
        self._batches = 0
        self._epoch = 0

    def on_epoch_begin(self, epoch: int, logs: Logs = None) -> None:
        self._epoch = epoch

    def on_train_batch_end(self, batch: int, logs: Logs = None) -> None:
        if self.save_freq != "epoch":
            self._batches += 1
            if self._batches % int(self.save_freq) == 0:
                self._save(self._epoch, logs)

    def on_epoch_end(self, epoch: int, logs: Logs = None) -> None:
        if self.save_freq == "epoch":
            self._save(epoch, logs)

    def _save(self, epoch: int, logs: Logs) -> None:
        logs = dict(logs or {})
        path = self.filepath.format(epoch=epoch + 1, **logs)
        if self.save_best_only:
            current = logs.get(self.monitor)
            if current is None:
                warnings.warn(
                    f"ModelCheckpoint: '{self.monitor}' is not in the logs; not saving.", stacklevel=2
                )
                return
            if not self._better(float(current), self.best):
                return
            if self.verbose:
                print(
                    f"Epoch {epoch + 1}: {self.monitor} improved from {self.best:.5f} to "
                    f"{float(current):.5f}, saving model to {path}"
                )
            self.best = float(current)
        self._write(path)

    def _write(self, path: str) -> Any:
        if self.save_weights_only:
            return self.model.save_weights(path)
        return self.model.save(path)
