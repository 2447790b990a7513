"""EarlyStopping: stop training when a monitored value stops improving."""

from __future__ import annotations

from typing import Any

import torch

from phalanx.callbacks.callback import Logs
from phalanx.callbacks.monitor_callback import MonitorCallback
from phalanx.strategies.workers.distributed_files import chief_print

__all__ = ["EarlyStopping"]


def snapshot(model: Any) -> dict[str, Any]:
    """A deep copy of ``model.state_dict()``, tensors cloned to the CPU."""
    out: dict[str, Any] = {}
    for key, value in model.state_dict().items():
        out[key] = value.detach().to("cpu", copy=True) if isinstance(value, torch.Tensor) else value
    return out


class EarlyStopping(MonitorCallback):
    """Sets ``model.stop_training`` after ``patience`` epochs without improvement (Keras 3 rules).

    Every worker sees the same global logs, so every worker stops at the same epoch.

    Args:
        monitor: Log key to watch.
        min_delta: Smallest change that counts as an improvement.
        patience: Epochs without improvement before stopping.
        verbose: 1 prints (on the chief) when it stops and when it restores weights.
        mode: "auto", "min" or "max".
        baseline: A value to beat: the wait is reset only by epochs that beat it too.
        restore_best_weights: At the end of training, load the weights of the best epoch
            (a CPU copy of ``model.state_dict()`` kept while training).
        start_from_epoch: Epochs to wait before watching (warm-up).

    Raises:
        ValueError: Unknown mode.
    """

    def __init__(
        self,
        monitor: str = "val_loss",
        min_delta: float = 0.0,
        patience: int = 0,
        verbose: int = 0,
        mode: str = "auto",
        baseline: float | None = None,
        restore_best_weights: bool = False,
        start_from_epoch: int = 0,
    ) -> None:
        super().__init__(monitor, mode, min_delta=min_delta)
        self.patience, self.verbose, self.baseline = patience, verbose, baseline
        self.restore_best_weights, self.start_from_epoch = restore_best_weights, start_from_epoch
        self.wait = self.stopped_epoch = self.best_epoch = 0
        self.best_weights: dict[str, Any] | None = None

    def on_train_begin(self, logs: Logs = None) -> None:
        self.wait = self.stopped_epoch = self.best_epoch = 0
        self.best, self.best_weights = None, None

    def on_epoch_end(self, epoch: int, logs: Logs = None) -> None:
        if self.monitor_op is None:
            self._set_monitor_op()
        current = self._monitor_value(logs, "Early stopping")
        if current is None or epoch < self.start_from_epoch:
            return
        if self.restore_best_weights and self.best_weights is None:
            self.best_weights, self.best_epoch = snapshot(self.model), epoch
        self.wait += 1
        if self._is_improvement(current, self.best):
            self.best, self.best_epoch = current, epoch
            if self.restore_best_weights:
                self.best_weights = snapshot(self.model)
            # The wait restarts only when the baseline is beaten too.
            if self.baseline is None or self._is_improvement(current, self.baseline):
                self.wait = 0
            return
        if self.wait >= self.patience and epoch > 0:
            self.stopped_epoch = epoch
            self.model.stop_training = True

    def on_train_end(self, logs: Logs = None) -> None:
        if self.stopped_epoch > 0 and self.verbose > 0:
            chief_print(self.model, f"Epoch {self.stopped_epoch + 1}: early stopping")
        if self.restore_best_weights and self.best_weights is not None:
            if self.verbose > 0:
                chief_print(
                    self.model,
                    f"Restoring model weights from the end of the best epoch: {self.best_epoch + 1}.",
                )
            self.model.load_state_dict(self.best_weights)
