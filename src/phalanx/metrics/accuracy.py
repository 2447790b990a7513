"""Accuracy metrics, as Keras defines them: per-example match values averaged by `Mean`."""

from __future__ import annotations

import torch

from phalanx.metrics._functions import (
    accuracy,
    binary_accuracy,
    categorical_accuracy,
    sparse_categorical_accuracy,
    sparse_top_k_categorical_accuracy,
    top_k_categorical_accuracy,
)
from phalanx.metrics.reduction import MeanMetricWrapper

__all__ = [
    "Accuracy",
    "BinaryAccuracy",
    "CategoricalAccuracy",
    "SparseCategoricalAccuracy",
    "SparseTopKCategoricalAccuracy",
    "TopKCategoricalAccuracy",
    "accuracy",
    "binary_accuracy",
    "categorical_accuracy",
    "sparse_categorical_accuracy",
    "sparse_top_k_categorical_accuracy",
    "top_k_categorical_accuracy",
]


def _check_k(k: int) -> int:
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be a positive integer. Received: k={k!r}. HINT: k=5 is the default.")
    return k


class Accuracy(MeanMetricWrapper):
    """How often predictions equal targets exactly."""

    direction = "up"

    def __init__(self, name: str = "accuracy", dtype: torch.dtype | str | None = None) -> None:
        super().__init__(accuracy, name=name, dtype=dtype)


class BinaryAccuracy(MeanMetricWrapper):
    """How often ``y_pred > threshold`` matches a 0/1 target."""

    direction = "up"

    def __init__(
        self, name: str = "binary_accuracy", dtype: torch.dtype | str | None = None, threshold: float = 0.5
    ) -> None:
        super().__init__(binary_accuracy, name=name, dtype=dtype, threshold=threshold)


class CategoricalAccuracy(MeanMetricWrapper):
    """How often the arg-max matches a one-hot target."""

    direction = "up"

    def __init__(self, name: str = "categorical_accuracy", dtype: torch.dtype | str | None = None) -> None:
        super().__init__(categorical_accuracy, name=name, dtype=dtype)


class SparseCategoricalAccuracy(MeanMetricWrapper):
    """How often the arg-max matches an integer target."""

    direction = "up"

    def __init__(
        self, name: str = "sparse_categorical_accuracy", dtype: torch.dtype | str | None = None
    ) -> None:
        super().__init__(sparse_categorical_accuracy, name=name, dtype=dtype)


class TopKCategoricalAccuracy(MeanMetricWrapper):
    """How often a one-hot target is among the ``k`` highest predictions.

    Raises:
        ValueError: ``k`` is not a positive integer.
    """

    direction = "up"

    def __init__(
        self, k: int = 5, name: str = "top_k_categorical_accuracy", dtype: torch.dtype | str | None = None
    ) -> None:
        super().__init__(top_k_categorical_accuracy, name=name, dtype=dtype, k=_check_k(k))


class SparseTopKCategoricalAccuracy(MeanMetricWrapper):
    """How often an integer target is among the ``k`` highest predictions.

    Raises:
        ValueError: ``k`` is not a positive integer.
    """

    direction = "up"

    def __init__(
        self,
        k: int = 5,
        name: str = "sparse_top_k_categorical_accuracy",
        dtype: torch.dtype | str | None = None,
    ) -> None:
        super().__init__(sparse_top_k_categorical_accuracy, name=name, dtype=dtype, k=_check_k(k))
