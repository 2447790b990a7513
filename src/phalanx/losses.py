"""Keras losses (phalanx.losses): per-example values for the distributed convention.

Every loss computes *per-example* values (shape ``[batch]``, trailing axes averaged, as
Keras does); the fit loop divides their sum by the global batch size. Called directly, a
loss reduces like Keras: ``sum_over_batch_size`` (default), ``sum``, ``mean`` or ``none``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

__all__ = [
    "BinaryCrossentropy",
    "CategoricalCrossentropy",
    "Huber",
    "Loss",
    "LossFunctionWrapper",
    "MeanAbsoluteError",
    "MeanSquaredError",
    "SparseCategoricalCrossentropy",
    "binary_crossentropy",
    "categorical_crossentropy",
    "get",
    "huber",
    "mean_absolute_error",
    "mean_squared_error",
    "sparse_categorical_crossentropy",
]

EPSILON = 1e-7
_REDUCTIONS = ("sum_over_batch_size", "sum", "mean", "none")


def _as_float(y: Any, like: torch.Tensor) -> torch.Tensor:
    return torch.as_tensor(y, device=like.device).to(like.dtype)


def _per_example(values: torch.Tensor) -> torch.Tensor:
    if values.dim() <= 1:
        return values
    return values.reshape(values.shape[0], -1).mean(dim=1)


def mean_squared_error(y_true: Any, y_pred: torch.Tensor) -> torch.Tensor:
    """Per-example mean of squared errors over the last axes."""
    return _per_example((y_pred - _as_float(y_true, y_pred)) ** 2)


def mean_absolute_error(y_true: Any, y_pred: torch.Tensor) -> torch.Tensor:
    """Per-example mean of absolute errors over the last axes."""
    return _per_example((y_pred - _as_float(y_true, y_pred)).abs())


def huber(y_true: Any, y_pred: torch.Tensor, delta: float = 1.0) -> torch.Tensor:
    """Per-example Huber loss."""
    return _per_example(F.huber_loss(y_pred, _as_float(y_true, y_pred), reduction="none", delta=delta))


def binary_crossentropy(
    y_true: Any, y_pred: torch.Tensor, from_logits: bool = False, label_smoothing: float = 0.0
) -> torch.Tensor:
    """Per-example binary cross-entropy; probabilities are clipped to [1e-7, 1 - 1e-7]."""
    target = _as_float(y_true, y_pred).reshape(y_pred.shape)
    if label_smoothing:
        target = target * (1.0 - label_smoothing) + 0.5 * label_smoothing
    if from_logits:
        values = F.binary_cross_entropy_with_logits(y_pred, target, reduction="none")
    else:
        p = y_pred.clamp(EPSILON, 1.0 - EPSILON)
        values = -(target * torch.log(p) + (1.0 - target) * torch.log(1.0 - p))
    return _per_example(values)


def categorical_crossentropy(
    y_true: Any, y_pred: torch.Tensor, from_logits: bool = False, label_smoothing: float = 0.0
) -> torch.Tensor:
    """Per-example cross-entropy against one-hot targets (class axis last)."""
    target = _as_float(y_true, y_pred)
    if label_smoothing:
        target = target * (1.0 - label_smoothing) + label_smoothing / y_pred.shape[-1]
    if from_logits:
        log_p = F.log_softmax(y_pred, dim=-1)
    else:
        p = y_pred / y_pred.sum(dim=-1, keepdim=True)
        log_p = torch.log(p.clamp(EPSILON, 1.0 - EPSILON))
    return _per_example(-(target * log_p).sum(dim=-1))


def sparse_categorical_crossentropy(
    y_true: Any, y_pred: torch.Tensor, from_logits: bool = False, ignore_class: int | None = None
) -> torch.Tensor:
    """Per-example cross-entropy against integer class ids (class axis last)."""
    target = torch.as_tensor(y_true, device=y_pred.device).long()
    if target.dim() == y_pred.dim():  # [batch, 1] targets, as Keras accepts
        target = target.squeeze(-1)
    if from_logits:
        log_p = F.log_softmax(y_pred, dim=-1)
    else:
        p = y_pred / y_pred.sum(dim=-1, keepdim=True)
        log_p = torch.log(p.clamp(EPSILON, 1.0 - EPSILON))
    safe = target if ignore_class is None else target.masked_fill(target == ignore_class, 0)
    values = -log_p.gather(-1, safe.unsqueeze(-1)).squeeze(-1)
    if ignore_class is not None:
        values = values.masked_fill(target == ignore_class, 0.0)
    return _per_example(values)


class Loss:
    """Base of Keras losses: ``call`` gives per-example losses, ``__call__`` reduces them.

    Args:
        reduction: "sum_over_batch_size" (default), "sum", "mean" or "none".
        name: Name used in logs.

    Raises:
        ValueError: Unknown reduction.
    """

    def __init__(self, reduction: str = "sum_over_batch_size", name: str | None = None) -> None:
        if reduction not in _REDUCTIONS:
            raise ValueError(f"reduction must be one of {list(_REDUCTIONS)}. Received: {reduction!r}.")
        self.reduction = reduction
        self.name = name or _snake(type(self).__name__)

    def call(self, y_true: Any, y_pred: torch.Tensor) -> torch.Tensor:
        """Per-example losses, shape ``[batch]``."""
        raise NotImplementedError

    def per_example(self, y_true: Any, y_pred: torch.Tensor, sample_weight: Any = None) -> torch.Tensor:
        """Weighted per-example losses, shape ``[batch]`` (what the distributed loops use)."""
        values = self.call(y_true, y_pred)
        if sample_weight is not None:
            weight = torch.as_tensor(sample_weight, dtype=values.dtype, device=values.device)
            values = values * weight.reshape(values.shape[0], *([1] * (values.dim() - 1)))
        return values

    def __call__(self, y_true: Any, y_pred: torch.Tensor, sample_weight: Any = None) -> torch.Tensor:
        values = self.per_example(y_true, y_pred, sample_weight)
        if self.reduction == "none":
            return values
        total = values.sum()
        if self.reduction == "sum":
            return total
        count = values.shape[0] if values.dim() else 1
        return total / count if count else total * 0.0

    def get_config(self) -> dict[str, Any]:
        return {"reduction": self.reduction, "name": self.name}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Loss:
        return cls(**config)


def _snake(name: str) -> str:
    out = "".join(f"_{c.lower()}" if c.isupper() else c for c in name).lstrip("_")
    return out


class LossFunctionWrapper(Loss):
    """A Loss around a function ``fn(y_true, y_pred, **kwargs) -> per-example losses``."""

    def __init__(
        self,
        fn: Callable[..., torch.Tensor],
        reduction: str = "sum_over_batch_size",
        name: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(reduction, name or getattr(fn, "__name__", "loss"))
        self.fn = fn
        self._fn_kwargs = kwargs

    def call(self, y_true: Any, y_pred: torch.Tensor) -> torch.Tensor:
        values = torch.as_tensor(self.fn(y_true, y_pred, **self._fn_kwargs))
        if values.dim() == 0:
            raise ValueError(
                f"Loss function {self.name!r} must return per-example losses (shape [batch]); "
                "it returned a scalar. HINT: compute it with reduction='none'."
            )
        return _per_example(values)

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), **self._fn_kwargs}


class MeanSquaredError(LossFunctionWrapper):
    """Mean of squared errors ("mse")."""

    def __init__(self, reduction: str = "sum_over_batch_size", name: str = "mean_squared_error") -> None:
        super().__init__(mean_squared_error, reduction, name)


class MeanAbsoluteError(LossFunctionWrapper):
    """Mean of absolute errors ("mae")."""

    def __init__(self, reduction: str = "sum_over_batch_size", name: str = "mean_absolute_error") -> None:
        super().__init__(mean_absolute_error, reduction, name)


class Huber(LossFunctionWrapper):
    """Huber loss with threshold ``delta``."""

    def __init__(
        self, delta: float = 1.0, reduction: str = "sum_over_batch_size", name: str = "huber_loss"
    ) -> None:
        super().__init__(huber, reduction, name, delta=delta)


class BinaryCrossentropy(LossFunctionWrapper):
    """Binary cross-entropy; ``from_logits`` for raw scores."""

    def __init__(
        self,
        from_logits: bool = False,
        label_smoothing: float = 0.0,
        reduction: str = "sum_over_batch_size",
        name: str = "binary_crossentropy",
    ) -> None:
        super().__init__(
            binary_crossentropy, reduction, name, from_logits=from_logits, label_smoothing=label_smoothing
        )


class CategoricalCrossentropy(LossFunctionWrapper):
    """Cross-entropy against one-hot targets."""

    def __init__(
        self,
        from_logits: bool = False,
        label_smoothing: float = 0.0,
        reduction: str = "sum_over_batch_size",
        name: str = "categorical_crossentropy",
    ) -> None:
        super().__init__(
            categorical_crossentropy,
            reduction,
            name,
            from_logits=from_logits,
            label_smoothing=label_smoothing,
        )


class SparseCategoricalCrossentropy(LossFunctionWrapper):
    """Cross-entropy against integer class ids."""

    def __init__(
        self,
        from_logits: bool = False,
        ignore_class: int | None = None,
        reduction: str = "sum_over_batch_size",
        name: str = "sparse_categorical_crossentropy",
    ) -> None:
        super().__init__(
            sparse_categorical_crossentropy,
            reduction,
            name,
            from_logits=from_logits,
            ignore_class=ignore_class,
        )


_BY_NAME: dict[str, Callable[[], Loss]] = {
    "mse": MeanSquaredError,
    "mean_squared_error": MeanSquaredError,
    "mae": MeanAbsoluteError,
    "mean_absolute_error": MeanAbsoluteError,
    "huber": Huber,
    "binary_crossentropy": BinaryCrossentropy,
    "categorical_crossentropy": CategoricalCrossentropy,
    "sparse_categorical_crossentropy": SparseCategoricalCrossentropy,
}


def get(identifier: Any) -> Loss:
    """A Loss from a Keras name ("mse", "sparse_categorical_crossentropy", class names too),
    a Loss object, or a plain callable returning per-example losses.

    Raises:
        ValueError: Unknown name or unsupported type.
    """
    if isinstance(identifier, Loss):
        return identifier
    if isinstance(identifier, str):
        key = _snake(identifier) if any(c.isupper() for c in identifier) else identifier.lower()
        if key in _BY_NAME:
            return _BY_NAME[key]()
        raise ValueError(f"Unknown loss {identifier!r}. Known names: {sorted(_BY_NAME)}.")
    if callable(identifier):
        return LossFunctionWrapper(identifier)
    raise ValueError(f"A loss must be a name, a phalanx.losses.Loss or a callable. Received: {identifier!r}.")
