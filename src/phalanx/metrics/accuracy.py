"""Accuracy metrics and regression errors, as Keras defines them."""

from __future__ import annotations

from typing import Any

import torch

from phalanx.metrics.reduction import MeanMetricWrapper

__all__ = [
    "Accuracy",
    "BinaryAccuracy",
    "CategoricalAccuracy",
    "MeanAbsoluteError",
    "MeanSquaredError",
    "RootMeanSquaredError",
    "SparseCategoricalAccuracy",
    "SparseTopKCategoricalAccuracy",
    "TopKCategoricalAccuracy",
]


def _t(x: Any) -> torch.Tensor:
    return torch.as_tensor(x)


def accuracy(y_true: Any, y_pred: Any) -> torch.Tensor:
    """1 where prediction equals target exactly."""
    y_true, y_pred = _t(y_true), _t(y_pred)
    return (y_true.reshape(y_pred.shape) == y_pred).to(torch.float64)


def binary_accuracy(y_true: Any, y_pred: Any, threshold: float = 0.5) -> torch.Tensor:
    """1 where ``y_pred > threshold`` equals the 0/1 target."""
    y_true, y_pred = _t(y_true), _t(y_pred)
    return ((y_pred > threshold).to(torch.float64) == y_true.reshape(y_pred.shape).to(torch.float64)).to(
        torch.float64
    )


def categorical_accuracy(y_true: Any, y_pred: Any) -> torch.Tensor:
    """1 where the arg-max of the prediction is the arg-max of the one-hot target."""
    return (_t(y_true).argmax(-1) == _t(y_pred).argmax(-1)).to(torch.float64)


def sparse_categorical_accuracy(y_true: Any, y_pred: Any) -> torch.Tensor:
    """1 where the arg-max of the prediction is the integer target."""
    y_true, y_pred = _t(y_true), _t(y_pred)
    if y_true.dim() == y_pred.dim():
        y_true = y_true.squeeze(-1)
    return (y_pred.argmax(-1) == y_true.long()).to(torch.float64)


def top_k_categorical_accuracy(y_true: Any, y_pred: Any, k: int = 5) -> torch.Tensor:
    """1 where the one-hot target's class is among the k highest predictions."""
    return sparse_top_k_categorical_accuracy(_t(y_true).argmax(-1), y_pred, k)


def sparse_top_k_categorical_accuracy(y_true: Any, y_pred: Any, k: int = 5) -> torch.Tensor:
    """1 where the integer target is among the k highest predictions."""
    y_true, y_pred = _t(y_true).long(), _t(y_pred)
    if y_true.dim() == y_pred.dim():
        y_true = y_true.squeeze(-1)
    top = y_pred.topk(min(k, y_pred.shape[-1]), dim=-1).indices
    return (top == y_true.unsqueeze(-1)).any(-1).to(torch.float64)


def squared_error(y_true: Any, y_pred: Any) -> torch.Tensor:
    y_pred = _t(y_pred)
    return (y_pred - _t(y_true).to(y_pred.dtype).reshape(y_pred.shape)) ** 2


def absolute_error(y_true: Any, y_pred: Any) -> torch.Tensor:
    y_pred = _t(y_pred)
    return (y_pred - _t(y_true).to(y_pred.dtype).reshape(y_pred.shape)).abs()


class Accuracy(MeanMetricWrapper):
    """How often predictions equal targets."""

    def __init__(self, name: str = "accuracy") -> None:
        super().__init__(accuracy, name)


class BinaryAccuracy(MeanMetricWrapper):
    """How often ``y_pred > threshold`` matches a 0/1 target."""

    def __init__(self, name: str = "binary_accuracy", threshold: float = 0.5) -> None:
        super().__init__(binary_accuracy, name, threshold=threshold)


class CategoricalAccuracy(MeanMetricWrapper):
    """How often the arg-max matches a one-hot target."""

    def __init__(self, name: str = "categorical_accuracy") -> None:
        super().__init__(categorical_accuracy, name)


class SparseCategoricalAccuracy(MeanMetricWrapper):
    """How often the arg-max matches an integer target."""

    def __init__(self, name: str = "sparse_categorical_accuracy") -> None:
        super().__init__(sparse_categorical_accuracy, name)


class TopKCategoricalAccuracy(MeanMetricWrapper):
    """How often a one-hot target is in the top k predictions."""

    def __init__(self, k: int = 5, name: str = "top_k_categorical_accuracy") -> None:
        super().__init__(top_k_categorical_accuracy, name, k=k)


class SparseTopKCategoricalAccuracy(MeanMetricWrapper):
    """How often an integer target is in the top k predictions."""

    def __init__(self, k: int = 5, name: str = "sparse_top_k_categorical_accuracy") -> None:
        super().__init__(sparse_top_k_categorical_accuracy, name, k=k)


class MeanSquaredError(MeanMetricWrapper):
    """Mean of squared errors over every element."""

    def __init__(self, name: str = "mean_squared_error") -> None:
        super().__init__(squared_error, name)


class MeanAbsoluteError(MeanMetricWrapper):
    """Mean of absolute errors over every element."""

    def __init__(self, name: str = "mean_absolute_error") -> None:
        super().__init__(absolute_error, name)


class RootMeanSquaredError(MeanMetricWrapper):
    """Square root of the mean squared error over every example seen."""

    def __init__(self, name: str = "root_mean_squared_error") -> None:
        super().__init__(squared_error, name)

    def result(self) -> torch.Tensor:
        return super().result().sqrt()
