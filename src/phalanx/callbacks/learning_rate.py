"""LearningRateScheduler and ReduceLROnPlateau: set the optimizer's learning rate between epochs."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

from phalanx.callbacks._monitor import improvement
from phalanx.callbacks.callback import Callback, Logs

__all__ = ["LearningRateScheduler", "ReduceLROnPlateau"]


def _get_lr(model: Any) -> float:
    return float(model.optimizer.param_groups[0]["lr"])


def _set_lr(model: Any, lr: float) -> None:
    for group in model.optimizer.param_groups:
        group["lr"] = float(lr)


class LearningRateScheduler(Callback):
    """Sets the learning rate to ``schedule(epoch, lr)`` at the start of every epoch.

    Raises:
        ValueError: The schedule returned something that is not a number.
    """

    def __init__(self, schedule: Callable[[int, float], float], verbose: int = 0) -> None:
        super().__init__()
        self.schedule, self.verbose = schedule, verbose

    def on_epoch_begin(self, epoch: int, logs: Logs = None) -> None:
        lr = self.schedule(epoch, _get_lr(self.model))
        if not isinstance(lr, (int, float)):
            raise ValueError(f"The schedule must return a number. Received: {lr!r} at epoch {epoch}.")
        _set_lr(self.model, lr)
        if self.verbose:
            print(f"Epoch {epoch + 1}: LearningRateScheduler setting learning rate to {lr}.")

    def on_epoch_end(self, epoch: int, logs: Logs = None) -> None:
        if logs is not None:
            logs["learning_rate"] = _get_lr(self.model)


class ReduceLROnPlateau(Callback):
    """Multiplies the learning rate by ``factor`` after ``patience`` epochs without improvement.

    Raises:
        ValueError: ``factor`` is not below 1.
    """

    def __init__(
        self,
        monitor: str = "val_loss",
        factor: float = 0.1,
        patience: int = 10,
        verbose: int = 0,
        mode: str = "auto",
        min_delta: float = 1e-4,
        cooldown: int = 0,
        min_lr: float = 0.0,
    ) -> None:
        super().__init__()
        if factor >= 1.0:
            raise ValueError(f"ReduceLROnPlateau does not support factor >= 1. Received: {factor}.")
        self.monitor, self.factor, self.patience, self.verbose = monitor, factor, patience, verbose
        self.min_delta, self.cooldown, self.min_lr = min_delta, cooldown, min_lr
        self._better, self._initial = improvement(monitor, mode)
        self._sign = 1.0 if self._initial == float("inf") else -1.0

    def on_train_begin(self, logs: Logs = None) -> None:
        self.best, self.wait, self.cooldown_counter = self._initial, 0, 0

    def on_epoch_end(self, epoch: int, logs: Logs = None) -> None:
        logs = logs if logs is not None else {}
        logs["learning_rate"] = _get_lr(self.model)
        current = logs.get(self.monitor)
        if current is None:
            warnings.warn(
                f"ReduceLROnPlateau: '{self.monitor}' is not in the logs ({sorted(logs)}).", stacklevel=2
            )
            return
        if self.cooldown_counter > 0:
            self.cooldown_counter -= 1
            self.wait = 0
        if self._better(float(current) + self._sign * self.min_delta, self.best):
            self.best, self.wait = float(current), 0
            return
        if self.cooldown_counter > 0:
            return
        self.wait += 1
        if self.wait >= self.patience:
            old = _get_lr(self.model)
            new = max(old * self.factor, self.min_lr)
            if new < old:
                _set_lr(self.model, new)
                if self.verbose:
                    print(f"Epoch {epoch + 1}: ReduceLROnPlateau reducing learning rate to {new}.")
            self.cooldown_counter, self.wait = self.cooldown, 0
