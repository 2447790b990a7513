"""Keras metrics whose totals add up across replicas and workers (phalanx.metrics)."""

from __future__ import annotations

from typing import Any

from phalanx.metrics.accuracy import (
    Accuracy,
    BinaryAccuracy,
    CategoricalAccuracy,
    MeanAbsoluteError,
    MeanSquaredError,
    RootMeanSquaredError,
    SparseCategoricalAccuracy,
    SparseTopKCategoricalAccuracy,
    TopKCategoricalAccuracy,
)
from phalanx.metrics.confusion import AUC, Precision, Recall
from phalanx.metrics.metric import Metric
from phalanx.metrics.reduction import Mean, MeanMetricWrapper, Sum

__all__ = [
    "AUC",
    "Accuracy",
    "BinaryAccuracy",
    "CategoricalAccuracy",
    "Mean",
    "MeanAbsoluteError",
    "MeanMetricWrapper",
    "MeanSquaredError",
    "Metric",
    "Precision",
    "Recall",
    "RootMeanSquaredError",
    "SparseCategoricalAccuracy",
    "SparseTopKCategoricalAccuracy",
    "Sum",
    "TopKCategoricalAccuracy",
    "get",
]

_BY_NAME: dict[str, Any] = {
    "sparse_categorical_accuracy": SparseCategoricalAccuracy,
    "categorical_accuracy": CategoricalAccuracy,
    "binary_accuracy": BinaryAccuracy,
    "top_k_categorical_accuracy": TopKCategoricalAccuracy,
    "sparse_top_k_categorical_accuracy": SparseTopKCategoricalAccuracy,
    "mae": MeanAbsoluteError,
    "mean_absolute_error": MeanAbsoluteError,
    "mse": MeanSquaredError,
    "mean_squared_error": MeanSquaredError,
    "root_mean_squared_error": RootMeanSquaredError,
    "auc": AUC,
    "precision": Precision,
    "recall": Recall,
}

_ACCURACY_FOR_LOSS = {
    "sparse_categorical_crossentropy": SparseCategoricalAccuracy,
    "categorical_crossentropy": CategoricalAccuracy,
    "binary_crossentropy": BinaryAccuracy,
}


def _loss_name(loss: Any) -> str | None:
    if isinstance(loss, str):
        return loss.lower()
    return getattr(loss, "name", None)


def get(identifier: Any, loss: Any = None) -> Metric:
    """A metric from a Keras name, a Metric object or a per-example callable.

    ``"accuracy"``/``"acc"`` is resolved from the loss as Keras does (sparse categorical
    cross-entropy → SparseCategoricalAccuracy, ...) and keeps the name "accuracy".

    Raises:
        ValueError: Unknown name or unsupported type.
    """
    if isinstance(identifier, Metric):
        return identifier
    if isinstance(identifier, str):
        key = identifier.lower()
        if key in ("accuracy", "acc"):
            cls = _ACCURACY_FOR_LOSS.get(_loss_name(loss) or "", Accuracy)
            return cls(name=identifier)
        if key in _BY_NAME:
            return _BY_NAME[key](name=identifier)
        raise ValueError(f"Unknown metric {identifier!r}. Known: ['accuracy', *{sorted(_BY_NAME)}].")
    if callable(identifier):
        return MeanMetricWrapper(identifier)
    raise ValueError(
        f"A metric must be a name, a phalanx.metrics.Metric or a callable. Received: {identifier!r}."
    )
