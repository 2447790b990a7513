"""Regression metrics: mean squared / absolute error and its root, per example then averaged."""

from __future__ import annotations

from typing import Any

import torch

from phalanx.losses._utils import float_pair
from phalanx.losses.functions import mean_absolute_error, mean_squared_error
from phalanx.metrics.reduction import Mean, MeanMetricWrapper

__all__ = ["MeanAbsoluteError", "MeanSquaredError", "RootMeanSquaredError"]


class MeanSquaredError(MeanMetricWrapper):
    """The mean over examples of the squared error (averaged over the last axis first)."""

    direction = "down"

    def __init__(self, name: str = "mean_squared_error", dtype: torch.dtype | str | None = None) -> None:
        super().__init__(mean_squared_error, name=name, dtype=dtype)


class MeanAbsoluteError(MeanMetricWrapper):
    """The mean over examples of the absolute error (averaged over the last axis first)."""

    direction = "down"

    def __init__(self, name: str = "mean_absolute_error", dtype: torch.dtype | str | None = None) -> None:
        super().__init__(mean_absolute_error, name=name, dtype=dtype)


class RootMeanSquaredError(Mean):
    """The square root of the mean squared error over every example seen.

    The root is taken of the global mean (from the summed totals), never per batch or replica.
    """

    direction = "down"

    def __init__(self, name: str = "root_mean_squared_error", dtype: torch.dtype | str | None = None) -> None:
        super().__init__(name=name, dtype=dtype)

    @torch.no_grad()
    def update_state(self, y_true: Any, y_pred: Any, sample_weight: Any = None) -> None:  # type: ignore[override]
        """Adds the squared errors of a batch."""
        true, pred = float_pair(y_true, y_pred)
        super().update_state((pred - true) ** 2, sample_weight)

    def result(self) -> torch.Tensor:
        """sqrt(total / count)."""
        return super().result().sqrt()
