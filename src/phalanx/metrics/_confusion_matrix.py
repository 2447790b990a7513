"""Thresholded confusion counts, as Keras' update_confusion_matrix_variables defines them.

For every threshold t: a prediction is positive when ``y_pred > t``; a label is positive
when ``y_true`` is non-zero. Counts are weighted sums. They are computed by bucketing each
prediction between the sorted thresholds (``searchsorted``) and taking cumulative sums —
O(n log T) time and O(n + T) memory, where Keras' generic path tiles an n × T matrix.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from phalanx.losses._utils import broadcast_weights, squeeze_or_expand_to_same_rank

__all__ = ["NEG_INF", "Counts", "confusion_counts", "filter_top_k", "prepare", "validate_thresholds"]

NEG_INF = -1e10  # Keras' threshold below every prediction (top_k metrics)


class Counts(NamedTuple):
    """Weighted counts per threshold (and label): each ``[T]`` or ``[T, labels]``."""

    true_positives: torch.Tensor
    false_positives: torch.Tensor
    true_negatives: torch.Tensor
    false_negatives: torch.Tensor


def validate_thresholds(thresholds: list[float]) -> list[float]:
    """Raises unless every threshold is in [0, 1] (Keras' rule).

    Raises:
        ValueError: A threshold outside [0, 1].
    """
    bad = [t for t in thresholds if not 0.0 <= t <= 1.0]
    if bad:
        raise ValueError(
            f"Threshold values must be in [0, 1]. Received: {bad}. HINT: thresholds apply to "
            "probabilities; pass from_logits=True (AUC) or apply a sigmoid first."
        )
    return thresholds


def filter_top_k(pred: torch.Tensor, k: int) -> torch.Tensor:
    """Keeps the ``k`` largest predictions of the last axis; the others become NEG_INF.

    Ties go to the lower index, as TensorFlow's top_k (a stable sort; torch.topk does not say).
    """
    top = pred.sort(dim=-1, descending=True, stable=True).indices[..., :k]
    keep = torch.zeros_like(pred, dtype=torch.bool).scatter_(-1, top, True)
    return torch.where(keep, pred, torch.full_like(pred, NEG_INF))


def prepare(
    y_true: Any,
    y_pred: Any,
    sample_weight: Any,
    dtype: torch.dtype,
    top_k: int | None = None,
    class_id: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(positive labels, predictions, weights or None), aligned and of the same shape.

    Raises:
        ValueError: Shapes differ, or ``class_id`` does not index the last axis.
    """
    pred = torch.as_tensor(y_pred).detach().to(dtype)
    true = torch.as_tensor(y_true, device=pred.device).detach()
    pred, true = squeeze_or_expand_to_same_rank(pred, true)
    if true.shape != pred.shape:
        raise ValueError(
            "Confusion metrics need y_true and y_pred of the same shape. Received: y_true.shape="
            f"{tuple(true.shape)}, y_pred.shape={tuple(pred.shape)}. HINT: one-hot encode integer "
            "targets (torch.nn.functional.one_hot) or use class_id."
        )
    weights = None if sample_weight is None else broadcast_weights(sample_weight, pred)
    if top_k is not None:
        pred = filter_top_k(pred, top_k)
    if class_id is not None:
        if pred.dim() < 2 or not 0 <= class_id < pred.shape[-1]:
            raise ValueError(
                f"class_id must index the last axis of y_pred. Received: class_id={class_id} for "
                f"y_pred.shape={tuple(pred.shape)}. HINT: y_pred must be [batch, num_classes]."
            )
        pred, true = pred[..., class_id], true[..., class_id]
        weights = None if weights is None else weights[..., class_id]
    return true != 0, pred, weights


def confusion_counts(
    labels: torch.Tensor, pred: torch.Tensor, weights: torch.Tensor | None, thresholds: torch.Tensor
) -> Counts:
    """Counts for ``[n, labels]`` inputs at ascending ``thresholds`` ``[T]``: ``[T, labels]`` each."""
    num_labels = pred.shape[1]
    num_buckets = thresholds.numel() + 1
    # bucket j: exactly j thresholds lie strictly below the prediction
    bucket = torch.searchsorted(thresholds.to(pred.dtype), pred.contiguous())
    index = (bucket * num_labels + torch.arange(num_labels, device=pred.device)).flatten()
    w = torch.ones_like(pred) if weights is None else weights.to(pred.dtype)

    def histogram(mass: torch.Tensor) -> torch.Tensor:
        flat = torch.zeros(num_buckets * num_labels, dtype=pred.dtype, device=pred.device)
        return flat.index_add_(0, index, mass.flatten()).view(num_buckets, num_labels)

    positive, negative = histogram(w * labels), histogram(w * ~labels)

    def above(hist: torch.Tensor) -> torch.Tensor:  # weight with pred > thresholds[i]
        return hist.flip(0).cumsum(0).flip(0)[1:]

    def at_or_below(hist: torch.Tensor) -> torch.Tensor:  # weight with pred <= thresholds[i]
        return hist.cumsum(0)[:-1]

    return Counts(above(positive), above(negative), at_or_below(negative), at_or_below(positive))
