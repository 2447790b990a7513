"""The Loss base: per-example values for the distributed fit loop, Keras reductions when called.

A loss has two faces. ``per_example(y_true, y_pred, sample_weight)`` gives weighted
per-example losses (shape ``[batch]``); the fit loop sums them and divides by the *global*
batch size, TensorFlow's distributed convention. ``loss(y_true, y_pred, sample_weight)``
reduces them the way Keras does for a single process.
"""

from __future__ import annotations

from typing import Any

import torch

from phalanx.losses._utils import (
    as_float,
    broadcast_weights,
    divide_no_nan,
    dtype_name,
    mean_trailing,
    resolve_dtype,
    to_snake_case,
)

__all__ = ["REDUCTIONS", "Loss", "reduce_values", "standardize_reduction"]

REDUCTIONS = ("sum_over_batch_size", "sum", "mean", "mean_with_sample_weight", "none")
_MASK_RESCALED = ("sum_over_batch_size", "mean")


def standardize_reduction(reduction: str | None) -> str:
    """The reduction's canonical name (``None`` is ``"none"``, as in Keras).

    Raises:
        ValueError: Unknown reduction.
    """
    if reduction is None:
        return "none"
    if reduction not in REDUCTIONS:
        raise ValueError(
            f"reduction must be one of {list(REDUCTIONS)} or None. Received: reduction={reduction!r}. "
            "HINT: 'sum_over_batch_size' (the default) averages over the examples."
        )
    return reduction


def reduce_values(values: torch.Tensor, weights: torch.Tensor | None, reduction: str) -> torch.Tensor:
    """Reduces weighted per-example losses ``[batch]``; an empty batch gives 0, not NaN."""
    if reduction == "none":
        return values
    total = values.sum()
    if reduction == "sum":
        return total
    if reduction == "mean_with_sample_weight" and weights is not None:
        return divide_no_nan(total, weights.sum())
    count = values.shape[0] if values.dim() else 1
    return total / count if count else total * 0.0


class Loss:
    """Base of Keras-style losses. Subclasses implement `call`.

    Args:
        name: Name (default: the class name in snake case).
        reduction: "sum_over_batch_size" (default: the mean over examples), "sum", "mean"
            (the same as sum_over_batch_size), "mean_with_sample_weight" (divides by the sum
            of the weights), or "none"/None (per-example values).
        dtype: Floating dtype ``y_pred`` is cast to. Default: ``y_pred``'s own floating
            dtype (Keras would cast to float32).

    Raises:
        ValueError: Unknown reduction or non-floating dtype.
    """

    def __init__(
        self,
        name: str | None = None,
        reduction: str | None = "sum_over_batch_size",
        dtype: torch.dtype | str | None = None,
    ) -> None:
        self.name = name or to_snake_case(type(self).__name__)
        self.reduction = standardize_reduction(reduction)
        self._dtype = resolve_dtype(dtype, None)

    @property
    def dtype(self) -> torch.dtype | None:
        """The dtype ``y_pred`` is cast to (None: keep its own)."""
        return self._dtype

    def call(self, y_true: Any, y_pred: torch.Tensor) -> torch.Tensor:
        """Per-example losses, shape ``[batch]`` (or ``[batch, ...]``: trailing axes are averaged).

        Raises:
            NotImplementedError: The subclass does not implement it.
        """
        raise NotImplementedError(
            f"{type(self).__name__} must implement call(y_true, y_pred) returning per-example "
            "losses of shape [batch]."
        )

    def _unreduced(self, y_true: Any, y_pred: torch.Tensor) -> torch.Tensor:
        """Values before the trailing axes are averaged (weights of that shape apply)."""
        return self.call(y_true, y_pred)

    def _mask(self, y_true: Any, y_pred: torch.Tensor) -> torch.Tensor | None:
        """Which unreduced entries count (None: all); masked entries leave the average."""
        return None

    def per_example(self, y_true: Any, y_pred: Any, sample_weight: Any = None) -> torch.Tensor:
        """Weighted per-example losses, shape ``[batch]``: what the distributed loops sum.

        Raises:
            ValueError: The loss is a scalar, or ``sample_weight`` does not fit.
        """
        return self._weighted(y_true, y_pred, sample_weight)[0]

    def __call__(self, y_true: Any, y_pred: Any, sample_weight: Any = None) -> torch.Tensor:
        """The loss reduced by ``self.reduction`` (the mean over the batch by default)."""
        values, weights = self._weighted(y_true, y_pred, sample_weight)
        return reduce_values(values, weights, self.reduction)

    def _weighted(
        self, y_true: Any, y_pred: Any, sample_weight: Any
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        pred = as_float(y_pred)
        if self._dtype is not None:
            pred = pred.to(self._dtype)
        values = torch.as_tensor(self._unreduced(y_true, pred))
        if values.dim() == 0:
            raise ValueError(
                f"Loss {self.name!r} must give per-example losses (shape [batch]); it gave a scalar. "
                "HINT: return the unreduced values (reduction='none' in torch.nn.functional)."
            )
        weights = self._weights(sample_weight, self._mask(y_true, pred), values)
        if weights is None:
            return mean_trailing(values), None
        return mean_trailing(values * weights), mean_trailing(weights)

    def _weights(self, sample_weight: Any, mask: torch.Tensor | None, values: torch.Tensor) -> Any:
        weights = None if sample_weight is None else broadcast_weights(sample_weight, values)
        if mask is None:
            return weights
        keep = broadcast_weights(mask, values, what="mask")
        if self.reduction in _MASK_RESCALED:
            # Keras' apply_mask: valid entries weigh total/valid, so the mean is over them.
            keep = keep * divide_no_nan(keep.new_tensor(float(keep.numel())), keep.sum())
        return keep if weights is None else weights * keep

    def get_config(self) -> dict[str, Any]:
        """The constructor arguments (JSON-able)."""
        return {"name": self.name, "reduction": self.reduction, "dtype": dtype_name(self._dtype)}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Loss:
        """The loss `get_config` describes."""
        return cls(**config)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, reduction={self.reduction!r})"
