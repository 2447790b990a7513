"""AUC: area under the ROC or precision-recall curve from thresholded confusion counts (Keras')."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from phalanx.losses._utils import divide_no_nan
from phalanx.metrics._confusion_matrix import confusion_counts, prepare, validate_thresholds
from phalanx.metrics.metric import Metric

__all__ = ["AUC"]

_CURVES = ("ROC", "PR")
_SUMMATIONS = ("interpolation", "minoring", "majoring")
_EPSILON = 1e-7  # Keras nudges the end thresholds just outside [0, 1]


def _thresholds(num_thresholds: int, thresholds: list[float] | None) -> tuple[list[float], bool]:
    """(all thresholds with the end points, whether they are evenly spaced)."""
    if thresholds is not None:
        inner = sorted(validate_thresholds([float(t) for t in thresholds]))
        full = [0.0, *inner, 1.0]
        even = len(full) >= 3 and bool(np.allclose(full, np.linspace(0.0, 1.0, len(full)), atol=_EPSILON))
    else:
        if isinstance(num_thresholds, bool) or not isinstance(num_thresholds, int) or num_thresholds <= 1:
            raise ValueError(
                f"num_thresholds must be an integer > 1. Received: num_thresholds={num_thresholds!r}. "
                "HINT: 200 (the default) approximates the area well."
            )
        inner = [(i + 1) / (num_thresholds - 1) for i in range(num_thresholds - 2)]
        even = True
    return [0.0 - _EPSILON, *inner, 1.0 + _EPSILON], even


def _choice(kind: str, value: str, allowed: tuple[str, ...]) -> str:
    found = next((a for a in allowed if a.lower() == str(value).lower()), None)
    if found is None:
        raise ValueError(f"{kind} must be one of {list(allowed)}. Received: {kind}={value!r}.")
    return found


def _riemann_area(x: torch.Tensor, y: torch.Tensor, summation: str) -> torch.Tensor:
    """Sum over threshold intervals of width x[i] - x[i+1] and a height from y (per label)."""
    if summation == "interpolation":
        heights = (y[:-1] + y[1:]) / 2.0
    elif summation == "minoring":
        heights = torch.minimum(y[:-1], y[1:])
    else:
        heights = torch.maximum(y[:-1], y[1:])
    return ((x[:-1] - x[1:]) * heights).sum(dim=0)


def _interpolated_pr_area(tp: torch.Tensor, fp: torch.Tensor, fn: torch.Tensor) -> torch.Tensor:
    """Davis & Goadrich's PR interpolation, Keras' closed form (per label)."""
    dtp = tp[:-1] - tp[1:]
    p = tp + fp
    dp = p[:-1] - p[1:]
    slope = divide_no_nan(dtp, dp.clamp(min=0))
    intercept = tp[1:] - slope * p[1:]
    both = (p[:-1] > 0) & (p[1:] > 0)
    ratio = torch.where(both, divide_no_nan(p[:-1], p[1:].clamp(min=0)), torch.ones_like(p[1:]))
    increments = divide_no_nan(slope * (dtp + intercept * torch.log(ratio)), (tp[1:] + fn[1:]).clamp(min=0))
    return increments.sum(dim=0)


class AUC(Metric):
    """Approximate area under the ROC or PR curve, from counts at fixed thresholds.

    Predictions are compared with ``num_thresholds`` thresholds spread evenly over [0, 1]
    (end points nudged by 1e-7), as Keras does; the counts are summed over every example,
    replica and worker, so the area is the global one. With the default interpolation, ROC
    areas are trapezoids and PR areas use Davis & Goadrich's interpolation.

    Args:
        num_thresholds: Number of thresholds (> 1); ignored when ``thresholds`` is given.
        curve: "ROC" or "PR".
        summation_method: "interpolation", "minoring" or "majoring".
        name: Name in logs.
        dtype: Dtype of the state.
        thresholds: Explicit thresholds in [0, 1] (the end points are added).
        multi_label: Treat the last axis as independent labels and average their AUCs.
            Needs ``num_labels``: the state is created before the first batch, inside the
            strategy scope (Keras would create it lazily).
        num_labels: Number of labels for ``multi_label``.
        label_weights: Non-negative weight per label (last axis of ``y_pred``).
        from_logits: Apply a sigmoid to ``y_pred`` first.

    Raises:
        ValueError: An invalid argument (each message names it).
    """

    direction = "up"
    true_positives: torch.Tensor
    false_positives: torch.Tensor
    true_negatives: torch.Tensor
    false_negatives: torch.Tensor

    def __init__(
        self,
        num_thresholds: int = 200,
        curve: str = "ROC",
        summation_method: str = "interpolation",
        name: str | None = None,
        dtype: torch.dtype | str | None = None,
        thresholds: list[float] | None = None,
        multi_label: bool = False,
        num_labels: int | None = None,
        label_weights: list[float] | None = None,
        from_logits: bool = False,
    ) -> None:
        super().__init__(dtype=dtype, name=name)
        self.curve = _choice("curve", curve, _CURVES)
        self.summation_method = _choice("summation_method", summation_method, _SUMMATIONS)
        self._thresholds, self._evenly_spaced = _thresholds(num_thresholds, thresholds)
        self._init_from_thresholds = thresholds is not None
        self.num_thresholds = len(self._thresholds)
        self.multi_label, self.num_labels = multi_label, _check_labels(multi_label, num_labels)
        self.label_weights = _check_label_weights(label_weights, num_labels if multi_label else None)
        self.from_logits = from_logits
        shape = (self.num_thresholds, num_labels) if multi_label and num_labels else (self.num_thresholds,)
        for state in ("true_positives", "false_positives", "true_negatives", "false_negatives"):
            self.add_state(state, shape)

    @property
    def thresholds(self) -> list[float]:
        """Every threshold, end points included."""
        return list(self._thresholds)

    @torch.no_grad()
    def update_state(self, y_true: Any, y_pred: Any, sample_weight: Any = None) -> None:
        """Adds a batch's confusion counts (``y_pred`` probabilities unless ``from_logits``)."""
        labels, pred, weights = prepare(y_true, y_pred, sample_weight, self.dtype)
        if self.from_logits:
            pred = torch.sigmoid(pred)
        if self._evenly_spaced:
            pred = pred.clamp(0.0, 1.0)  # Keras' bucketed path clips
        labels, pred, weights = self._as_columns(labels, pred, weights)
        thresholds = torch.tensor(self._thresholds, dtype=self.dtype, device=pred.device)
        counts = confusion_counts(labels, pred, weights, thresholds)
        for name, value in counts._asdict().items():
            self._add(getattr(self, name), value if self.multi_label else value[:, 0])

    def _as_columns(
        self, labels: torch.Tensor, pred: torch.Tensor, weights: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``[n, labels]`` (multi_label) or ``[n, 1]`` views, label weights folded in."""
        if self.multi_label:
            if pred.dim() != 2 or pred.shape[1] != self.num_labels:
                raise ValueError(
                    f"AUC(multi_label=True, num_labels={self.num_labels}) needs y_pred of shape "
                    f"[batch, {self.num_labels}]. Received: y_pred.shape={tuple(pred.shape)}."
                )
            return labels, pred, weights
        if self.label_weights is not None:
            per_label = torch.tensor(self.label_weights, dtype=pred.dtype, device=pred.device)
            try:
                scale = torch.broadcast_to(per_label, pred.shape)
            except RuntimeError as exc:
                raise ValueError(
                    f"label_weights needs one weight per entry of y_pred's last axis. Received: "
                    f"{len(self.label_weights)} weights for y_pred.shape={tuple(pred.shape)}."
                ) from exc
            weights = scale if weights is None else weights * scale
        return (
            labels.reshape(-1, 1),
            pred.reshape(-1, 1),
            None if weights is None else weights.reshape(-1, 1),
        )

    def result(self) -> torch.Tensor:
        """The area (the mean, or label-weighted mean, over labels for ``multi_label``)."""
        tp, fp, tn, fn = self._read("true_positives", "false_positives", "true_negatives", "false_negatives")
        if self.curve == "PR" and self.summation_method == "interpolation":
            area = _interpolated_pr_area(tp, fp, fn)
        else:
            recall = divide_no_nan(tp, tp + fn)
            if self.curve == "ROC":
                x, y = divide_no_nan(fp, fp + tn), recall
            else:
                x, y = recall, divide_no_nan(tp, tp + fp)
            area = _riemann_area(x, y, self.summation_method)
        if not self.multi_label:
            return area
        if self.label_weights is None:
            return area.mean()
        weights = torch.tensor(self.label_weights, dtype=area.dtype, device=area.device)
        return divide_no_nan((area * weights).sum(), weights.sum())

    def get_config(self) -> dict[str, Any]:
        """The constructor arguments."""
        config: dict[str, Any] = {
            **super().get_config(),
            "num_thresholds": self.num_thresholds,
            "curve": self.curve,
            "summation_method": self.summation_method,
            "multi_label": self.multi_label,
            "num_labels": self.num_labels,
            "label_weights": self.label_weights,
            "from_logits": self.from_logits,
        }
        if self._init_from_thresholds:
            config["thresholds"] = self._thresholds[1:-1]
        return config


def _check_labels(multi_label: bool, num_labels: int | None) -> int | None:
    if multi_label and not num_labels:
        raise ValueError(
            "AUC(multi_label=True) needs num_labels: metric state must exist before the first "
            "batch, inside the strategy scope. Received: num_labels=None. HINT: pass "
            "num_labels=y_pred.shape[-1]."
        )
    if num_labels and not multi_label:
        raise ValueError(
            f"num_labels is needed only when multi_label is True. Received: num_labels={num_labels}, "
            "multi_label=False. HINT: drop num_labels, or set multi_label=True."
        )
    return num_labels


def _check_label_weights(label_weights: list[float] | None, num_labels: int | None) -> list[float] | None:
    if label_weights is None:
        return None
    values = [float(w) for w in label_weights]
    if any(w < 0 for w in values) or (num_labels is not None and len(values) != num_labels):
        raise ValueError(
            f"label_weights must be {num_labels or 'one per label'} non-negative numbers. "
            f"Received: label_weights={label_weights}."
        )
    return values
