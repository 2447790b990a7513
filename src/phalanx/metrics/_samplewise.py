"""Keras' reduce_to_samplewise_values: values and weights down to one per example."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from phalanx.losses._utils import squeeze_or_expand_to_same_rank

__all__ = ["mean_over", "reduce_to_samplewise_values", "sum_over"]

Reducer = Callable[[torch.Tensor, tuple[int, ...]], torch.Tensor]


def mean_over(t: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    return t.mean(dim=dims)


def sum_over(t: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    return t.sum(dim=dims)


def reduce_to_samplewise_values(
    values: Any, sample_weight: Any, reduce_fn: Reducer, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Weighted values ``[batch]`` (or a scalar) and weights ``[batch]`` (or None), as Keras.

    Axes of ``values`` beyond the weights' rank are reduced first, the weights applied, then
    the remaining trailing axes reduced; weights of rank > 1 are reduced the same way. A
    scalar weight applies to every example.

    Raises:
        ValueError: The weights have more axes than the values, or do not broadcast.
    """
    values = torch.as_tensor(values).detach().to(dtype)
    weights = None
    if sample_weight is not None:
        weights = torch.as_tensor(sample_weight, device=values.device).detach().to(dtype)
        if weights.dim() == 0 and values.dim() > 0:
            # One weight for every example (Keras would weigh the whole batch as one sample,
            # which makes the result depend on how a batch is split).
            weights = weights.expand(values.shape[0])
        values, weights = squeeze_or_expand_to_same_rank(values, weights)
        if weights.dim() > values.dim() or not _broadcastable(weights, values):
            raise ValueError(
                "sample_weight must broadcast to the metric's values, leading axes first. Received: "
                f"sample_weight.shape={tuple(weights.shape)} for values of shape {tuple(values.shape)}. "
                "HINT: pass one weight per example (shape [batch])."
            )
        if values.dim() > weights.dim():
            values = reduce_fn(values, tuple(range(weights.dim(), values.dim())))
        weights = torch.broadcast_to(weights, values.shape)
        values = values * weights
        if weights.dim() > 1:
            weights = reduce_fn(weights, tuple(range(1, weights.dim())))
    if values.dim() > 1:
        values = reduce_fn(values, tuple(range(1, values.dim())))
    return values, weights


def _broadcastable(weights: torch.Tensor, values: torch.Tensor) -> bool:
    prefix = values.shape[: weights.dim()]
    return all(w in (1, v) for w, v in zip(weights.shape, prefix, strict=True))
