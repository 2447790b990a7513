"""Thresholded confusion-matrix metrics: Precision, Recall and AUC (Keras' algorithms)."""

from __future__ import annotations

from typing import Any

import torch

from phalanx.metrics.metric import Metric, divide_no_nan, weights_like

__all__ = ["AUC", "Precision", "Recall"]


def _flat_predictions(
    y_true: Any, y_pred: Any, top_k: int | None, class_id: int | None
) -> tuple[torch.Tensor, torch.Tensor]:
    y_pred = torch.as_tensor(y_pred).detach().to(torch.float64)
    y_true = torch.as_tensor(y_true).detach().to(torch.float64).reshape(y_pred.shape)
    if top_k is not None:
        kth = y_pred.topk(min(top_k, y_pred.shape[-1]), dim=-1).values[..., -1:]
        y_pred = torch.where(y_pred >= kth, y_pred, torch.full_like(y_pred, float("-inf")))
    if class_id is not None:
        y_pred, y_true = y_pred[..., class_id], y_true[..., class_id]
    return y_true, y_pred


class _Confusion(Metric):
    """Counts true/false positives/negatives at each threshold (prediction > threshold)."""

    true_positives: torch.Tensor
    false_positives: torch.Tensor
    true_negatives: torch.Tensor
    false_negatives: torch.Tensor
    thresholds: torch.Tensor

    def __init__(
        self, thresholds: list[float], name: str | None, top_k: int | None = None, class_id: int | None = None
    ) -> None:
        super().__init__(name)
        self.register_buffer("thresholds", torch.tensor(thresholds, dtype=torch.float64), persistent=False)
        self.top_k, self.class_id = top_k, class_id
        for state in ("true_positives", "false_positives", "true_negatives", "false_negatives"):
            self.add_state(state, (len(thresholds),))

    def reset_state(self) -> None:
        with torch.no_grad():
            for state in (
                self.true_positives,
                self.false_positives,
                self.true_negatives,
                self.false_negatives,
            ):
                state.zero_()

    @torch.no_grad()  # type: ignore[misc]
    def update_state(self, y_true: Any, y_pred: Any, sample_weight: Any = None) -> None:
        y_true, y_pred = _flat_predictions(y_true, y_pred, self.top_k, self.class_id)
        w = weights_like(y_pred, sample_weight).reshape(-1, 1)
        positive = (y_pred.reshape(-1, 1) > self.thresholds.reshape(1, -1)).to(torch.float64)
        label = (y_true.reshape(-1, 1) > 0.5).to(torch.float64)
        self.true_positives.add_((positive * label * w).sum(0).to(self.dtype))
        self.false_positives.add_((positive * (1 - label) * w).sum(0).to(self.dtype))
        self.true_negatives.add_(((1 - positive) * (1 - label) * w).sum(0).to(self.dtype))
        self.false_negatives.add_(((1 - positive) * label * w).sum(0).to(self.dtype))


def _thresholds(thresholds: float | list[float] | None, top_k: int | None) -> list[float]:
    if thresholds is None:
        return [float("-inf")] if top_k is not None else [0.5]
    values = [float(t) for t in (thresholds if isinstance(thresholds, (list, tuple)) else [thresholds])]
    if any(not 0.0 <= t <= 1.0 for t in values):
        raise ValueError(f"thresholds must be in [0, 1]. Received: {values}.")
    return values


class Precision(_Confusion):
    """tp / (tp + fp) at ``thresholds`` (one value per threshold; a scalar for one)."""

    def __init__(
        self,
        thresholds: float | list[float] | None = None,
        top_k: int | None = None,
        class_id: int | None = None,
        name: str = "precision",
    ) -> None:
        super().__init__(_thresholds(thresholds, top_k), name, top_k, class_id)

    def result(self) -> torch.Tensor:
        value = divide_no_nan(
            self.true_positives.clone(), (self.true_positives + self.false_positives).clone()
        )
        return value[0] if value.numel() == 1 else value


class Recall(_Confusion):
    """tp / (tp + fn) at ``thresholds``."""

    def __init__(
        self,
        thresholds: float | list[float] | None = None,
        top_k: int | None = None,
        class_id: int | None = None,
        name: str = "recall",
    ) -> None:
        super().__init__(_thresholds(thresholds, top_k), name, top_k, class_id)

    def result(self) -> torch.Tensor:
        value = divide_no_nan(
            self.true_positives.clone(), (self.true_positives + self.false_negatives).clone()
        )
        return value[0] if value.numel() == 1 else value


class AUC(_Confusion):
    """Area under the ROC or precision-recall curve from ``num_thresholds`` thresholds.

    Thresholds are spread evenly over [0, 1] with the end points nudged by 1e-7, as Keras
    does; the area is a trapezoidal sum over the (fpr, tpr) or (recall, precision) points.

    Raises:
        ValueError: ``num_thresholds`` < 2 or an unknown ``curve``.
    """

    def __init__(
        self, num_thresholds: int = 200, curve: str = "ROC", from_logits: bool = False, name: str = "auc"
    ) -> None:
        if num_thresholds < 2:
            raise ValueError(f"num_thresholds must be > 1. Received: {num_thresholds}.")
        if curve.upper() not in ("ROC", "PR"):
            raise ValueError(f"curve must be 'ROC' or 'PR'. Received: {curve!r}.")
        inner = [(i + 1) / (num_thresholds - 1) for i in range(num_thresholds - 2)]
        super().__init__([0.0 - 1e-7, *inner, 1.0 + 1e-7], name)
        self.curve = curve.upper()
        self.from_logits = from_logits

    @torch.no_grad()
    def update_state(self, y_true: Any, y_pred: Any, sample_weight: Any = None) -> None:
        y_pred = torch.as_tensor(y_pred)
        super().update_state(y_true, torch.sigmoid(y_pred) if self.from_logits else y_pred, sample_weight)

    def result(self) -> torch.Tensor:
        tp, fp, tn, fn = (
            s.clone()
            for s in (self.true_positives, self.false_positives, self.true_negatives, self.false_negatives)
        )
        recall = divide_no_nan(tp, tp + fn)
        if self.curve == "ROC":
            x, y = divide_no_nan(fp, fp + tn), recall
        else:
            x, y = recall, divide_no_nan(tp, tp + fp)
        return ((x[:-1] - x[1:]) * (y[:-1] + y[1:]) / 2).sum()

    def get_config(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "num_thresholds": len(self.thresholds),
            "curve": self.curve,
            "from_logits": self.from_logits,
        }
