"""ReduceLROnPlateau: multiply the learning rate by ``factor`` when a value stops improving."""

from __future__ import annotations

import numpy as np

from phalanx.callbacks._optimizer_lr import get_lr, optimizer_of, set_lr
from phalanx.callbacks.callback import Logs
from phalanx.callbacks.monitor_callback import MonitorCallback
from phalanx.strategies.workers.distributed_files import chief_print

__all__ = ["ReduceLROnPlateau"]


class ReduceLROnPlateau(MonitorCallback):
    """After ``patience`` epochs without improvement, sets ``lr = max(lr * factor, min_lr)``.

    Logs the rate used during the epoch as ``learning_rate``.

    Args:
        monitor: Log key to watch.
        factor: Multiplier of the learning rate (< 1).
        patience: Epochs without improvement before a reduction.
        verbose: 1 prints (on the chief) each reduction.
        mode: "auto", "min" or "max".
        min_delta: Smallest change that counts as an improvement.
        cooldown: Epochs to wait after a reduction before counting again.
        min_lr: Lower bound of the learning rate.

    Raises:
        ValueError: ``factor`` >= 1, or an unknown mode.
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
        super().__init__(monitor, mode, min_delta=min_delta)
        if factor >= 1.0:
            raise ValueError(
                f"ReduceLROnPlateau does not support a factor >= 1.0. Received: factor={factor}. "
                "HINT: 0.1 divides the learning rate by ten."
            )
        self.factor, self.patience, self.verbose = factor, patience, verbose
        self.cooldown, self.min_lr = cooldown, min_lr
        self.wait = self.cooldown_counter = 0

    def on_train_begin(self, logs: Logs = None) -> None:
        self.best, self.wait, self.cooldown_counter = None, 0, 0

    def in_cooldown(self) -> bool:
        """Whether a recent reduction still holds counting off."""
        return self.cooldown_counter > 0

    def on_epoch_end(self, epoch: int, logs: Logs = None) -> None:
        if self.monitor_op is None:
            self._set_monitor_op()
        optimizer = optimizer_of(self.model, "ReduceLROnPlateau")
        if logs is not None:
            logs["learning_rate"] = get_lr(optimizer)
        current = self._monitor_value(logs, "Learning rate reduction")
        if current is None:
            return
        if self.in_cooldown():
            self.cooldown_counter -= 1
            self.wait = 0
        if self._is_improvement(current, self.best):
            self.best, self.wait = current, 0
        elif not self.in_cooldown():
            self.wait += 1
            if self.wait >= self.patience and self._reduce(epoch):
                self.cooldown_counter, self.wait = self.cooldown, 0

    def _reduce(self, epoch: int) -> bool:
        optimizer = optimizer_of(self.model, "ReduceLROnPlateau")
        old = get_lr(optimizer)
        if old <= np.float32(self.min_lr):  # Keras compares in float32
            return False
        new = max(old * self.factor, self.min_lr)
        set_lr(optimizer, new)
        if self.verbose > 0:
            chief_print(self.model, f"Epoch {epoch + 1}: ReduceLROnPlateau reducing learning rate to {new}.")
        return True
