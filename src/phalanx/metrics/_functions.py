"""The metric functions (per-example values) that a plain `MeanMetricWrapper` can be rebuilt
from by name (``FUNCTIONS``), with Keras' accuracy functions themselves.

Below `reduction` (whose ``MeanMetricWrapper.from_config`` reads ``FUNCTIONS``) and the
metric classes (`accuracy` re-exports the functions), so none of them imports another back.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from phalanx.losses._utils import as_float, float_pair
from phalanx.losses.functions import mean_absolute_error, mean_squared_error

__all__ = [
    "FUNCTIONS",
    "accuracy",
    "accuracy_by_shapes",
    "binary_accuracy",
    "categorical_accuracy",
    "sparse_categorical_accuracy",
    "sparse_top_k_categorical_accuracy",
    "top_k_categorical_accuracy",
]


def _matches(condition: torch.Tensor) -> torch.Tensor:
    return condition.to(torch.get_default_dtype())


def _sparse_targets(fn: str, y_true: Any, pred: torch.Tensor) -> torch.Tensor:
    """Integer targets shaped like ``pred`` without its class axis (``[batch, 1]`` squeezed)."""
    true = torch.as_tensor(y_true, device=pred.device)
    if true.dim() == pred.dim() > 0 and true.shape[-1] == 1:
        true = true.squeeze(-1)
    if pred.dim() == 0 or true.shape != pred.shape[:-1]:
        raise ValueError(
            f"{fn} needs integer targets shaped like y_pred without its last (class) axis. "
            f"Received: y_true.shape={tuple(true.shape)}, y_pred.shape={tuple(pred.shape)}. "
            f"HINT: for one-hot targets use {fn.removeprefix('sparse_')}."
        )
    return true


def _one_hot_targets(fn: str, y_true: Any, pred: torch.Tensor) -> torch.Tensor:
    """Class ids from one-hot targets shaped like ``pred``."""
    true = torch.as_tensor(y_true, device=pred.device)
    if true.shape != pred.shape or pred.dim() == 0:
        raise ValueError(
            f"{fn} needs one-hot targets shaped like y_pred. Received: y_true.shape="
            f"{tuple(true.shape)}, y_pred.shape={tuple(pred.shape)}. HINT: for integer class ids "
            f"use sparse_{fn}."
        )
    return true.argmax(dim=-1)


def accuracy(y_true: Any, y_pred: Any) -> torch.Tensor:
    """1 where the prediction equals the target exactly, else 0 (element by element)."""
    true, pred = float_pair(y_true, y_pred)
    return _matches(true == pred)


def binary_accuracy(y_true: Any, y_pred: Any, threshold: float = 0.5) -> torch.Tensor:
    """1 where ``y_pred > threshold`` agrees with the 0/1 target (element by element)."""
    true, pred = float_pair(y_true, y_pred)
    return _matches((pred > threshold).to(true.dtype) == true)


def categorical_accuracy(y_true: Any, y_pred: Any) -> torch.Tensor:
    """1 where the arg-max of ``y_pred`` is the arg-max of the one-hot target.

    Raises:
        ValueError: ``y_true`` is not shaped like ``y_pred``.
    """
    pred = torch.as_tensor(y_pred)
    return _matches(_one_hot_targets("categorical_accuracy", y_true, pred) == pred.argmax(dim=-1))


def sparse_categorical_accuracy(y_true: Any, y_pred: Any) -> torch.Tensor:
    """1 where the arg-max of ``y_pred`` is the integer target.

    Raises:
        ValueError: ``y_true`` is not ``y_pred``'s shape without the class axis.
    """
    pred = torch.as_tensor(y_pred)
    return _matches(_sparse_targets("sparse_categorical_accuracy", y_true, pred) == pred.argmax(dim=-1))


def _in_top_k(targets: torch.Tensor, pred: torch.Tensor, k: int) -> torch.Tensor:
    # Keras' in_top_k: the target's score is at least the k-th largest (ties count as in).
    kth = pred.topk(min(k, pred.shape[-1]), dim=-1).values[..., -1:]
    return _matches((pred.gather(-1, targets.long().unsqueeze(-1)) >= kth).squeeze(-1))


def top_k_categorical_accuracy(y_true: Any, y_pred: Any, k: int = 5) -> torch.Tensor:
    """1 where the one-hot target's class is among the ``k`` highest predictions.

    Raises:
        ValueError: ``y_true`` is not shaped like ``y_pred``.
    """
    pred = as_float(y_pred)
    return _in_top_k(_one_hot_targets("top_k_categorical_accuracy", y_true, pred), pred, k)


def sparse_top_k_categorical_accuracy(y_true: Any, y_pred: Any, k: int = 5) -> torch.Tensor:
    """1 where the integer target is among the ``k`` highest predictions.

    Raises:
        ValueError: ``y_true`` is not ``y_pred``'s shape without the class axis.
    """
    pred = as_float(y_pred)
    return _in_top_k(_sparse_targets("sparse_top_k_categorical_accuracy", y_true, pred), pred, k)


def accuracy_by_shapes(y_true: Any, y_pred: Any) -> torch.Tensor:
    """Keras 3's rule: one output column (or rank 1) is binary; fewer target axes is sparse."""
    true, pred = torch.as_tensor(y_true), torch.as_tensor(y_pred)
    if pred.dim() <= 1 or pred.shape[-1] == 1:
        return binary_accuracy(true, pred)
    if true.dim() < pred.dim() or true.shape[-1] == 1:
        return sparse_categorical_accuracy(true, pred)
    return categorical_accuracy(true, pred)


FUNCTIONS: dict[str, Callable[..., torch.Tensor]] = {
    fn.__name__: fn
    for fn in (
        accuracy,
        binary_accuracy,
        categorical_accuracy,
        sparse_categorical_accuracy,
        top_k_categorical_accuracy,
        sparse_top_k_categorical_accuracy,
        mean_squared_error,
        mean_absolute_error,
        accuracy_by_shapes,
    )
}
