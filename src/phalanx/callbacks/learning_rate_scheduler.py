"""LearningRateScheduler: set the learning rate from ``schedule(epoch, lr)`` at each epoch's start."""

from __future__ import annotations

import inspect
import math
import numbers
from collections.abc import Callable
from typing import Any

import torch

from phalanx.callbacks._optimizer_lr import get_lr, optimizer_of, set_lr
from phalanx.callbacks.callback import Callback, Logs
from phalanx.strategies.workers.distributed_files import chief_print

__all__ = ["LearningRateScheduler"]


def _takes_lr(schedule: Callable[..., Any]) -> bool:
    """Whether ``schedule`` takes (epoch, lr) — Keras also accepts the old ``schedule(epoch)``."""
    try:
        parameters = inspect.signature(schedule).parameters.values()
    except (TypeError, ValueError):
        return True
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 2 or any(p.kind is p.VAR_POSITIONAL for p in parameters)


def _as_lr(value: Any, epoch: int) -> float:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
        raise ValueError(
            f"The schedule must return a finite number (the learning rate). Received: {value!r} at "
            f"epoch {epoch}. HINT: schedule(epoch, lr) -> float, e.g. lambda epoch, lr: lr * 0.9."
        )
    return float(value)


class LearningRateScheduler(Callback):
    """Sets every parameter group's ``lr`` of ``model.optimizer`` to ``schedule(epoch, lr)``.

    The rate in use is logged as ``learning_rate`` at each epoch's end.

    Args:
        schedule: ``schedule(epoch, lr) -> new lr`` (0-based epoch); ``schedule(epoch)`` works too.
        verbose: 1 prints (on the chief) each change.

    Raises:
        ValueError: The schedule returned something other than a finite number, or the
            model has no torch optimizer.
    """

    def __init__(self, schedule: Callable[..., Any], verbose: int = 0) -> None:
        super().__init__()
        self.schedule, self.verbose = schedule, verbose

    def on_epoch_begin(self, epoch: int, logs: Logs = None) -> None:
        optimizer = optimizer_of(self.model, "LearningRateScheduler")
        args = (epoch, get_lr(optimizer)) if _takes_lr(self.schedule) else (epoch,)
        lr = _as_lr(self.schedule(*args), epoch)
        set_lr(optimizer, lr)
        if self.verbose > 0:
            chief_print(
                self.model, f"Epoch {epoch + 1}: LearningRateScheduler setting learning rate to {lr}."
            )

    def on_epoch_end(self, epoch: int, logs: Logs = None) -> None:
        if logs is not None:
            logs["learning_rate"] = get_lr(optimizer_of(self.model, "LearningRateScheduler"))
