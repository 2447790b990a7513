"""ModelCheckpoint: save the model (or its weights) every epoch or every N batches."""

from __future__ import annotations

import os
import warnings
from typing import Any

from phalanx.callbacks.callback import Logs
from phalanx.callbacks.monitor_callback import MonitorCallback
from phalanx.checkpoint._sharded_state import writes_sharded
from phalanx.strategies.workers.distributed_files import (
    chief_print,
    remove_temp_dir_with_filepath,
    strategy_of,
    write_filepath,
)

__all__ = ["ModelCheckpoint"]


class ModelCheckpoint(MonitorCallback):
    """Saves with ``model.save(path)`` or ``model.save_weights(path)`` (Keras 3 rules).

    ``filepath`` may hold ``{epoch}`` (1-based; format specs work: ``{epoch:02d}``),
    ``{batch}`` (1-based, with an integer ``save_freq``) and any log key
    (``{val_loss:.2f}``). Every worker runs it and calls the save — the logs are global, so
    every worker takes the same decision, and a save may be collective; the chief writes
    ``filepath``, the others a temporary copy that is removed at once. A sharded model
    (FullyShardedStrategy), or a path ending in ``.dcp``, is saved as a folder instead, each
    worker writing its own part of one copy (``torch.distributed.checkpoint``; `load_model` and
    ``load_weights`` read it under any strategy at any world size).

    Args:
        filepath: Where to save (a template).
        monitor: Log key compared for ``save_best_only``.
        verbose: 1 prints (on the chief) each save.
        save_best_only: Save only when ``monitor`` improves (a missing value saves, with a
            warning, as Keras).
        save_weights_only: ``model.save_weights`` instead of ``model.save``.
        mode: "auto", "min" or "max".
        save_freq: "epoch", or a number of batches between saves.
        initial_value_threshold: Value ``monitor`` must first beat.

    Raises:
        ValueError: ``save_freq`` is neither "epoch" nor a positive integer; unknown mode.
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
        super().__init__(monitor, mode, initial_value_threshold)
        if save_freq != "epoch" and (
            isinstance(save_freq, bool) or not isinstance(save_freq, int) or save_freq < 1
        ):
            raise ValueError(
                f"save_freq must be 'epoch' or a positive integer (batches). Received: {save_freq!r}. "
                "HINT: save_freq=500 saves every 500 batches."
            )
        self.filepath, self.verbose = os.fspath(filepath), verbose
        self.save_best_only, self.save_weights_only, self.save_freq = (
            save_best_only,
            save_weights_only,
            save_freq,
        )
        self._batches_since_save = 0
        self._last_batch: int | None = None
        self._current_epoch = 0

    def on_epoch_begin(self, epoch: int, logs: Logs = None) -> None:
        self._current_epoch = epoch

    def reads_batch_logs(self, mode: str = "train") -> bool:
        """Saving by steps reads the training step's logs (the monitored value, the file name)."""
        return super().reads_batch_logs(mode) and (mode != "train" or self.save_freq != "epoch")

    def on_train_batch_end(self, batch: int, logs: Logs = None) -> None:
        if self._should_save_on_batch(batch):
            self._save(self._current_epoch, batch, logs)

    def on_epoch_end(self, epoch: int, logs: Logs = None) -> None:
        if self.monitor_op is None:
            self._set_monitor_op()
        if self.save_freq == "epoch":
            self._save(epoch, None, logs)

    def _should_save_on_batch(self, batch: int) -> bool:
        if self.save_freq == "epoch":
            return False
        # A batch index that does not grow means a new epoch began.
        new_epoch = self._last_batch is None or batch <= self._last_batch
        self._batches_since_save += batch + 1 if new_epoch else batch - (self._last_batch or 0)
        self._last_batch = batch
        if self._batches_since_save >= int(self.save_freq):
            self._batches_since_save = 0
            return True
        return False

    def _file_path(self, epoch: int, batch: int | None, logs: dict[str, Any]) -> str:
        fields = {**logs, "epoch": epoch + 1}
        if batch is not None and "batch" not in logs:
            fields["batch"] = batch + 1
        try:
            return self.filepath.format(**fields)
        except KeyError as exc:
            raise KeyError(
                f"Failed to format the ModelCheckpoint filepath {self.filepath!r}: {exc} is not in the "
                f"logs ({', '.join(sorted(fields))}). HINT: use {{epoch}}, {{batch}} or a logged key."
            ) from exc

    def _should_save(self, epoch: int, logs: dict[str, Any], path: str) -> bool:
        if not self.save_best_only:
            if self.verbose > 0:
                chief_print(self.model, f"Epoch {epoch + 1}: saving model to {path}")
            return True
        current = logs.get(self.monitor)
        if current is None:
            warnings.warn(f"Can save best model only with {self.monitor} available.", stacklevel=3)
            return True
        best = "None" if self.best is None else f"{self.best:.5f}"
        if not self._is_improvement(float(current), self.best):
            if self.verbose > 0:
                chief_print(self.model, f"Epoch {epoch + 1}: {self.monitor} did not improve from {best}")
            return False
        if self.verbose > 0:
            chief_print(
                self.model,
                f"Epoch {epoch + 1}: {self.monitor} improved from {best} to {float(current):.5f}, "
                f"saving model to {path}",
            )
        self.best = float(current)
        return True

    def _save(self, epoch: int, batch: int | None, logs: Logs) -> None:
        logs = dict(logs or {})
        path = self._file_path(epoch, batch, logs)
        if not self._should_save(epoch, logs, path):
            return
        if writes_sharded(self.model, path):  # every worker writes its part into the one folder
            self._write(path)
            return
        strategy = strategy_of(self.model)
        target = write_filepath(path, strategy)
        if os.path.dirname(target):
            os.makedirs(os.path.dirname(target), exist_ok=True)
        try:
            self._write(target)
        finally:
            remove_temp_dir_with_filepath(target, strategy)

    def _write(self, target: str) -> None:
        if self.save_weights_only:
            self.model.save_weights(target)
        else:
            self.model.save(target)
