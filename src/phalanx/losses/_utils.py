"""Shape, dtype and naming helpers shared by losses and metrics (Keras' rank rules)."""

from __future__ import annotations

import re
from typing import Any

import torch

__all__ = [
    "EPSILON",
    "as_float",
    "broadcast_weights",
    "divide_no_nan",
    "dtype_name",
    "float_pair",
    "mean_trailing",
    "resolve_dtype",
    "squeeze_or_expand_to_same_rank",
    "to_snake_case",
]

EPSILON = 1e-7  # Keras' backend.epsilon(): the clip for probabilities


def as_float(x: Any, like: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` as a floating tensor: ``like``'s dtype and device, else its own float dtype."""
    if like is not None:
        return torch.as_tensor(x, device=like.device).to(like.dtype)
    t = torch.as_tensor(x)
    return t if t.is_floating_point() else t.to(torch.get_default_dtype())


def float_pair(y_true: Any, y_pred: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y_true, y_pred)`` as floating tensors of ``y_pred``'s dtype, ranks aligned (Keras' rule)."""
    pred = as_float(y_pred)
    true, pred = squeeze_or_expand_to_same_rank(as_float(y_true, pred), pred)
    return true, pred


def squeeze_or_expand_to_same_rank(
    x1: torch.Tensor, x2: torch.Tensor, expand_rank_1: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keras' rule: when ranks differ by one and the longer ends in 1, make the ranks equal.

    ``[batch]`` against ``[batch, 1]`` becomes ``[batch, 1]`` twice (or ``[batch]`` twice
    when ``expand_rank_1`` is False); other shapes are returned unchanged.
    """
    if x1.dim() == x2.dim() + 1 and x1.shape[-1] == 1:
        if x2.dim() == 1 and expand_rank_1:
            return x1, x2.unsqueeze(-1)
        return x1.squeeze(-1), x2
    if x2.dim() == x1.dim() + 1 and x2.shape[-1] == 1:
        if x1.dim() == 1 and expand_rank_1:
            return x1.unsqueeze(-1), x2
        return x1, x2.squeeze(-1)
    return x1, x2


def mean_trailing(values: torch.Tensor) -> torch.Tensor:
    """``[batch, ...]`` -> ``[batch]`` by averaging every axis after the first."""
    if values.dim() <= 1:
        return values
    return values.mean(dim=tuple(range(1, values.dim())))


def broadcast_weights(weights: Any, values: torch.Tensor, what: str = "sample_weight") -> torch.Tensor:
    """Per-example (or per-element) weights broadcast to ``values``' shape.

    A scalar, ``[batch]``, ``[batch, 1]`` or any leading prefix of ``values``' shape is
    accepted; missing trailing axes are added, so ``[batch]`` weights scale whole examples.

    Raises:
        ValueError: The weights cannot be broadcast to ``values``.
    """
    w = torch.as_tensor(weights, device=values.device).to(values.dtype)
    if w.dim() == values.dim() + 1 and w.shape[-1] == 1:
        w = w.squeeze(-1)
    while 0 < w.dim() < values.dim():
        w = w.unsqueeze(-1)
    try:
        return torch.broadcast_to(w, values.shape)
    except RuntimeError as exc:
        raise ValueError(
            f"{what} must broadcast to the values it weights, leading axes first. Received: "
            f"{what}.shape={tuple(w.shape)} for values of shape {tuple(values.shape)}. "
            "HINT: pass one weight per example (shape [batch]) or one per element."
        ) from exc


def divide_no_nan(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a / b``, and 0 where ``b`` is 0 (how Keras gives empty metrics the value 0)."""
    quotient = a / torch.where(b != 0, b, torch.ones_like(b))
    return torch.where(b != 0, quotient, torch.zeros_like(quotient))


def resolve_dtype(dtype: torch.dtype | str | None, default: torch.dtype | None) -> torch.dtype | None:
    """A floating torch dtype from a dtype, its name ("float32", "torch.float64") or None.

    Raises:
        ValueError: Not a floating-point dtype.
    """
    if dtype is None:
        return default
    found = getattr(torch, dtype.removeprefix("torch."), None) if isinstance(dtype, str) else dtype
    if not isinstance(found, torch.dtype) or not found.is_floating_point:
        raise ValueError(
            f"dtype must be a floating-point torch dtype or its name. Received: dtype={dtype!r}. "
            "HINT: use torch.float32 (the default) or torch.float64."
        )
    return found


def dtype_name(dtype: torch.dtype | None) -> str | None:
    """``torch.float32`` -> ``"float32"`` (what get_config stores)."""
    return None if dtype is None else str(dtype).removeprefix("torch.")


def to_snake_case(name: str) -> str:
    """``"TopKCategoricalAccuracy"`` -> ``"top_k_categorical_accuracy"``, ``"AUC"`` -> ``"auc"``."""
    name = re.sub(r"\W+", "", name)
    name = re.sub(r"(.)([A-Z][a-z]+)", r"\1_\2", name)
    return re.sub(r"([a-z])([A-Z])", r"\1_\2", name).lower()
