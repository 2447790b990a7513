"""EarlyStopping: stop training when a monitored value stops improving."""

from __future__ import annotations

import copy
import warnings
from typing import Any

from phalanx.callbacks._monitor import improvement
from phalanx.callbacks.callback import Callback, Logs

__all__ = ["EarlyStopping"]


class EarlyStopping(Callback):
    """Stops `fit` after ``patience`` epochs without an improvement of ``min_delta``.

    Args:
        monitor: Log key to watch.
        min_delta: Smallest change that counts as an improvement.
        patience: Epochs without improvement before stopping.
        verbose: 1 prints when it stops.
        mode: "auto", "min" or "max".
        baseline: Value the monitor must beat.
        restore_best_weights: Load the weights of the best epoch when stopping or at the end.
        start_from_epoch: Epochs to wait before watching.
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
        super().__init__()
        self.monitor, self.patience, self.verbose = monitor, patience, verbose
        self.baseline, self.restore_best_weights, self.start_from_epoch = (
            baseline,
            restore_best_weights,
            start_from_epoch,
        )
        self._better, self._initial = improvement(monitor, mode)
        # An improvement must beat the best by min_delta: current + |min_delta| < best in min mode (Keras).
        self.min_delta = -abs(min_delta) if self._initial == float("inf") else abs(min_delta)
        self.stopped_epoch = 0

    def on_train_begin(self, logs: Logs = None) -> None:
        self.wait, self.stopped_epoch = 0, 0
        self.best = self._initial if self.baseline is None else self.baseline
        self.best_weights: dict[str, Any] | None = None
        self.best_epoch = 0

    def on_epoch_end(self, epoch: int, logs: Logs = None) -> None:
        current = (logs or {}).get(self.monitor)
        if current is None:
            warnings.warn(
                f"EarlyStopping: '{self.monitor}' is not in the logs ({sorted(logs or {})}).", stacklevel=2
            )
            return
        if epoch < self.start_from_epoch:
            return
        if self.restore_best_weights and self.best_weights is None:
            self.best_weights = _snapshot(self.model)
        self.wait += 1
        if self._better(float(current) - self.min_delta, self.best):
            self.best, self.best_epoch, self.wait = float(current), epoch, 0
            if self.restore_best_weights:
                self.best_weights = _snapshot(self.model)
            return
        if self.wait >= self.patience and epoch > 0:
            self.stopped_epoch = epoch
            self.model.stop_training = True

    def on_train_end(self, logs: Logs = None) -> None:
        if self.stopped_epoch > 0 and self.verbose:
            print(f"Epoch {self.stopped_epoch + 1}: early stopping")
        if self.restore_best_weights and self.best_weights is not None:
            self.model.load_state_dict(self.best_weights)


def _snapshot(model: Any) -> dict[str, Any]:
    return {k: copy.deepcopy(v.detach().cpu()) for k, v in model.state_dict().items()}
