"""Precision and Recall at one or several thresholds (Keras' thresholded confusion counts)."""

from __future__ import annotations

from typing import Any

import torch

from phalanx.losses._utils import divide_no_nan
from phalanx.metrics._confusion_matrix import NEG_INF, confusion_counts, prepare, validate_thresholds
from phalanx.metrics.metric import Metric

__all__ = ["Precision", "Recall"]


class _ThresholdedRate(Metric):
    """Counts two confusion cells per threshold; the value is ``tp / (tp + other)``."""

    direction = "up"
    _other: str  # "false_positives" (precision) or "false_negatives" (recall)

    def __init__(
        self,
        thresholds: float | list[float] | None = None,
        top_k: int | None = None,
        class_id: int | None = None,
        name: str | None = None,
        dtype: torch.dtype | str | None = None,
    ) -> None:
        super().__init__(dtype=dtype, name=name)
        self.init_thresholds = thresholds
        if thresholds is None:
            self.thresholds = [NEG_INF if top_k is not None else 0.5]
        else:
            listed = list(thresholds) if isinstance(thresholds, (list, tuple)) else [thresholds]
            self.thresholds = validate_thresholds([float(t) for t in listed])
        self.top_k, self.class_id = top_k, class_id
        # counts are computed at ascending thresholds, then put back in the given order
        self._order = sorted(range(len(self.thresholds)), key=self.thresholds.__getitem__)
        self.add_state("true_positives", (len(self.thresholds),))
        self.add_state(self._other, (len(self.thresholds),))

    @torch.no_grad()
    def update_state(self, y_true: Any, y_pred: Any, sample_weight: Any = None) -> None:
        """Adds a batch's counts (``y_pred`` in [0, 1], ``y_true`` 0/1, the same shape)."""
        labels, pred, weights = prepare(y_true, y_pred, sample_weight, self.dtype, self.top_k, self.class_id)
        ascending = torch.tensor([self.thresholds[i] for i in self._order], dtype=self.dtype)
        counts = confusion_counts(
            labels.reshape(-1, 1),
            pred.reshape(-1, 1),
            None if weights is None else weights.reshape(-1, 1),
            ascending.to(pred.device),
        )._asdict()
        order = torch.tensor(self._order, device=pred.device)
        for name in ("true_positives", self._other):
            given_order = torch.empty_like(counts[name][:, 0]).index_copy_(0, order, counts[name][:, 0])
            self._add(getattr(self, name), given_order)

    def result(self) -> torch.Tensor:
        """One value per threshold; a scalar for a single threshold."""
        tp, other = self._read("true_positives", self._other)
        value = divide_no_nan(tp, tp + other)
        return value[0] if value.numel() == 1 else value

    def get_config(self) -> dict[str, Any]:
        """Name, dtype, thresholds, top_k and class_id."""
        return {
            **super().get_config(),
            "thresholds": self.init_thresholds,
            "top_k": self.top_k,
            "class_id": self.class_id,
        }


class Precision(_ThresholdedRate):
    """tp / (tp + fp): how many predicted positives are positive.

    Args:
        thresholds: A threshold or list of them in [0, 1] (``y_pred > t`` is positive);
            default 0.5, or "the top k" when ``top_k`` is set.
        top_k: Only the ``k`` highest predictions of each example count as positive.
        class_id: Only this class (last axis of ``y_pred``) is evaluated.
        name: Name in logs.
        dtype: Dtype of the state.

    Raises:
        ValueError: A threshold outside [0, 1].
    """

    _other = "false_positives"
    false_positives: torch.Tensor


class Recall(_ThresholdedRate):
    """tp / (tp + fn): how many positives are predicted positive.

    Args:
        thresholds: A threshold or list of them in [0, 1] (``y_pred > t`` is positive);
            default 0.5, or "the top k" when ``top_k`` is set.
        top_k: Only the ``k`` highest predictions of each example count as positive.
        class_id: Only this class (last axis of ``y_pred``) is evaluated.
        name: Name in logs.
        dtype: Dtype of the state.

    Raises:
        ValueError: A threshold outside [0, 1].
    """

    _other = "false_negatives"
    false_negatives: torch.Tensor
