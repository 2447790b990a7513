"""Keras' loss functions: unreduced values, the class (last) axis averaged or summed away.

Each returns what the Keras function of the same name returns for inputs of rank >= 2
(``[batch, d]`` -> ``[batch]``, ``[batch, t, d]`` -> ``[batch, t]``). One difference:
rank-1 inputs are one value per example, so ``[batch]`` gives ``[batch]`` where Keras would
average to a scalar — per-example values are what the distributed loss needs.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from phalanx.losses._utils import EPSILON, as_float, float_pair

__all__ = [
    "binary_crossentropy",
    "categorical_crossentropy",
    "huber",
    "mean_absolute_error",
    "mean_squared_error",
    "sparse_categorical_crossentropy",
]


def _mean_last(values: torch.Tensor) -> torch.Tensor:
    return values if values.dim() <= 1 else values.mean(dim=-1)


def _check_same_shape(fn: str, true: torch.Tensor, pred: torch.Tensor, hint: str) -> None:
    if true.shape != pred.shape:
        raise ValueError(
            f"{fn} needs y_true and y_pred of the same shape. Received: y_true.shape="
            f"{tuple(true.shape)}, y_pred.shape={tuple(pred.shape)}. HINT: {hint}"
        )


def _check_label_smoothing(label_smoothing: float) -> None:
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(
            f"label_smoothing must be in [0, 1]. Received: label_smoothing={label_smoothing}. "
            "HINT: 0.1 is a common value; 0 disables smoothing."
        )


def _log_probs(pred: torch.Tensor, from_logits: bool) -> torch.Tensor:
    if from_logits:
        return F.log_softmax(pred, dim=-1)
    # Keras renormalises probabilities to sum to 1, then clips by epsilon.
    probs = pred / pred.sum(dim=-1, keepdim=True)
    return torch.log(probs.clamp(EPSILON, 1.0 - EPSILON))


def mean_squared_error(y_true: Any, y_pred: Any) -> torch.Tensor:
    """Mean of squared errors over the last axis."""
    true, pred = float_pair(y_true, y_pred)
    return _mean_last((pred - true) ** 2)


def mean_absolute_error(y_true: Any, y_pred: Any) -> torch.Tensor:
    """Mean of absolute errors over the last axis."""
    true, pred = float_pair(y_true, y_pred)
    return _mean_last((pred - true).abs())


def huber(y_true: Any, y_pred: Any, delta: float = 1.0) -> torch.Tensor:
    """Huber loss: ``0.5 e²`` for ``|e| <= delta``, else ``delta |e| - 0.5 delta²`` (last axis averaged)."""
    true, pred = float_pair(y_true, y_pred)
    error = pred - true
    abs_error = error.abs()
    quadratic = 0.5 * error**2
    linear = delta * abs_error - 0.5 * delta**2
    return _mean_last(torch.where(abs_error <= delta, quadratic, linear))


def binary_crossentropy(
    y_true: Any, y_pred: Any, from_logits: bool = False, label_smoothing: float = 0.0
) -> torch.Tensor:
    """Binary cross-entropy, last axis averaged; probabilities are clipped to [1e-7, 1 - 1e-7].

    Raises:
        ValueError: Shapes differ (after Keras' ``[batch]`` vs ``[batch, 1]`` rule), or
            ``label_smoothing`` is outside [0, 1].
    """
    _check_label_smoothing(label_smoothing)
    true, pred = float_pair(y_true, y_pred)
    _check_same_shape("binary_crossentropy", true, pred, "give one 0/1 target per predicted probability.")
    if label_smoothing:
        true = true * (1.0 - label_smoothing) + 0.5 * label_smoothing
    if from_logits:
        values = F.binary_cross_entropy_with_logits(pred, true, reduction="none")
    else:
        values = F.binary_cross_entropy(pred.clamp(EPSILON, 1.0 - EPSILON), true, reduction="none")
    return _mean_last(values)


def categorical_crossentropy(
    y_true: Any, y_pred: Any, from_logits: bool = False, label_smoothing: float = 0.0
) -> torch.Tensor:
    """Cross-entropy against one-hot (or soft) targets; the class axis is last and summed.

    Raises:
        ValueError: ``y_true`` and ``y_pred`` shapes differ, or ``label_smoothing`` is
            outside [0, 1].
    """
    _check_label_smoothing(label_smoothing)
    pred = as_float(y_pred)
    true = as_float(y_true, pred)
    _check_same_shape(
        "categorical_crossentropy",
        true,
        pred,
        "for integer class ids use sparse_categorical_crossentropy.",
    )
    if label_smoothing:
        true = true * (1.0 - label_smoothing) + label_smoothing / pred.shape[-1]
    return -(true * _log_probs(pred, from_logits)).sum(dim=-1)


def sparse_categorical_crossentropy(
    y_true: Any, y_pred: Any, from_logits: bool = False, ignore_class: int | None = None
) -> torch.Tensor:
    """Cross-entropy against integer class ids (``[batch]`` or ``[batch, 1]``); class axis last.

    Entries whose target is ``ignore_class`` get the value 0 (the Loss class also leaves
    them out of the average, as Keras does).

    Raises:
        ValueError: ``y_true``'s shape is not ``y_pred``'s without its class axis.
    """
    pred = as_float(y_pred)
    true = torch.as_tensor(y_true, device=pred.device).long()
    if true.dim() == pred.dim() > 0 and true.shape[-1] == 1:
        true = true.squeeze(-1)
    if pred.dim() == 0 or true.shape != pred.shape[:-1]:
        raise ValueError(
            "sparse_categorical_crossentropy needs y_true shaped like y_pred without its last "
            f"(class) axis. Received: y_true.shape={tuple(true.shape)}, y_pred.shape="
            f"{tuple(pred.shape)}. HINT: for one-hot targets use categorical_crossentropy."
        )
    valid = None if ignore_class is None else true != ignore_class
    if valid is not None:
        true = true.masked_fill(~valid, 0)
    values = -_log_probs(pred, from_logits).gather(-1, true.unsqueeze(-1)).squeeze(-1)
    return values if valid is None else values.masked_fill(~valid, 0.0)
