"""MonitorCallback: the shared "is this value an improvement?" of EarlyStopping and friends."""

from __future__ import annotations

import operator
import warnings
from collections.abc import Callable
from typing import Any

from phalanx.callbacks.callback import Callback, Logs

__all__ = ["MonitorCallback"]

_MODES = ("auto", "min", "max")
# Used when the model does not list the monitored metric (a custom loop, a plain module).
_HIGHER_IS_BETTER = ("acc", "auc", "precision", "recall", "fmeasure")
_LOWER_IS_BETTER = ("loss", "error", "mse", "mae")


class MonitorCallback(Callback):
    """Base of callbacks that watch one log value (Keras 3's MonitorCallback).

    In ``mode="auto"`` the direction comes from the model's metric of that name (each
    phalanx metric knows whether higher is better), then from the name ("loss" and errors
    are minimised; accuracy, AUC, precision and recall maximised).

    Args:
        monitor: Log key to watch (``val_`` prefix for validation values).
        mode: "auto", "min" or "max".
        baseline: Initial reference value (None: the first value seen).
        min_delta: Smallest change that counts as an improvement.

    Raises:
        ValueError: Unknown mode (Keras only warns), or an auto mode that cannot be inferred.
    """

    def __init__(
        self,
        monitor: str = "val_loss",
        mode: str = "auto",
        baseline: float | None = None,
        min_delta: float = 0.0,
    ) -> None:
        super().__init__()
        if mode not in _MODES:
            raise ValueError(
                f"mode must be one of {list(_MODES)}. Received: mode={mode!r}. HINT: 'min' for losses "
                "and errors, 'max' for accuracies; 'auto' infers it from the monitored name."
            )
        self.monitor, self.mode = monitor, mode
        self.best: float | None = baseline
        self.min_delta = abs(min_delta)
        self.monitor_op: Callable[[Any, Any], bool] | None = None

    def _set_monitor_op(self) -> None:
        direction = self.mode if self.mode != "auto" else self._infer_direction()
        self.monitor_op = operator.lt if direction == "min" else operator.gt
        if direction == "min":
            self.min_delta = -abs(self.min_delta)

    def _infer_direction(self) -> str:
        name = self.monitor.removeprefix("val_")
        if name == "loss":
            return "min"
        for metric in getattr(self.model, "metrics", None) or []:
            direction = getattr(metric, "direction", None)  # phalanx metrics say it
            if getattr(metric, "name", None) == name and direction in ("up", "down"):
                return "max" if direction == "up" else "min"
        if any(part in name for part in _HIGHER_IS_BETTER):
            return "max"
        if any(part in name for part in _LOWER_IS_BETTER):
            return "min"
        raise ValueError(
            f"{type(self).__name__} cannot tell whether monitor={self.monitor!r} should be maximised "
            "or minimised. HINT: pass mode='max' to keep the highest value or mode='min' for the lowest."
        )

    def _is_improvement(self, current: float, reference: float | None) -> bool:
        if reference is None:
            return True
        if self.monitor_op is None:
            self._set_monitor_op()
        assert self.monitor_op is not None
        return bool(self.monitor_op(current - self.min_delta, reference))

    def _monitor_value(self, logs: Logs, what: str) -> float | None:
        value = (logs or {}).get(self.monitor)
        if value is None:
            warnings.warn(
                f"{what} is conditioned on `{self.monitor}`, which is not in the logs. Available: "
                f"{', '.join(logs or {}) or 'none'}.",
                stacklevel=3,
            )
            return None
        return float(value)
