"""``phalanx.metrics.get``: a Metric from a Keras name (``"accuracy"`` read from the loss), a config,
a Metric, or a plain function."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from phalanx import losses
from phalanx.losses._resolve import BY_NAME as LOSS_NAMES
from phalanx.losses._utils import to_snake_case
from phalanx.metrics import accuracy as acc
from phalanx.metrics._functions import FUNCTIONS, accuracy_by_shapes
from phalanx.metrics.auc import AUC
from phalanx.metrics.metric import Metric
from phalanx.metrics.precision_recall import Precision, Recall
from phalanx.metrics.reduction import Mean, MeanMetricWrapper, Sum
from phalanx.metrics.regression import MeanAbsoluteError, MeanSquaredError, RootMeanSquaredError
from phalanx.metrics.torch_metric import TorchMetric, is_torchmetrics_metric

__all__ = ["BY_NAME", "FUNCTIONS", "accuracy_by_shapes", "accuracy_for", "get"]

_CLASSES: list[type[Metric]] = [
    AUC,
    acc.Accuracy,
    acc.BinaryAccuracy,
    acc.CategoricalAccuracy,
    Mean,
    MeanAbsoluteError,
    MeanSquaredError,
    Precision,
    Recall,
    RootMeanSquaredError,
    acc.SparseCategoricalAccuracy,
    acc.SparseTopKCategoricalAccuracy,
    Sum,
    acc.TopKCategoricalAccuracy,
]
# Names that compile(metrics=[...]) takes; Mean and Sum take values, not (y_true, y_pred).
_COMPILABLE = [c for c in _CLASSES if c not in (Mean, Sum)]
_ALIASES = {"mse": MeanSquaredError, "mae": MeanAbsoluteError}


def _by_name() -> dict[str, type[Metric]]:
    table: dict[str, type[Metric]] = {}
    for cls in _COMPILABLE:
        table[cls.__name__] = table[to_snake_case(cls.__name__)] = cls
    for alias, cls in _ALIASES.items():
        table[alias] = table[alias.upper()] = cls
    return table


BY_NAME = _by_name()

_ACCURACY_FOR_LOSS: list[tuple[type[losses.Loss], Callable[..., torch.Tensor], type[Metric]]] = [
    (
        losses.SparseCategoricalCrossentropy,
        losses.sparse_categorical_crossentropy,
        acc.SparseCategoricalAccuracy,
    ),
    (losses.CategoricalCrossentropy, losses.categorical_crossentropy, acc.CategoricalAccuracy),
    (losses.BinaryCrossentropy, losses.binary_crossentropy, acc.BinaryAccuracy),
]


def accuracy_for(loss: Any, name: str = "accuracy") -> Metric:
    """The accuracy Keras pairs with ``loss``; by the shapes of each batch for other losses.

    Sparse categorical cross-entropy gives SparseCategoricalAccuracy, categorical gives
    CategoricalAccuracy, binary gives BinaryAccuracy (names, Loss objects and the loss
    functions all count). Otherwise the kind is read from the shapes, as Keras 3 does.
    """
    if isinstance(loss, str):
        loss = LOSS_NAMES.get(loss) or LOSS_NAMES.get(loss.lower())
    for cls, fn, metric in _ACCURACY_FOR_LOSS:
        if loss is cls or isinstance(loss, cls) or loss is fn or getattr(loss, "fn", None) is fn:
            return metric(name=name)
    return MeanMetricWrapper(accuracy_by_shapes, name=name)


def get(identifier: Any, loss: Any = None) -> Metric:
    """A Metric from any of Keras' ways to name one.

    Args:
        identifier: A name — "accuracy"/"acc" (the accuracy that matches ``loss``), a
            function name ("sparse_categorical_accuracy", "mae", "mean_squared_error", ...)
            or a class name ("AUC", "Precision", "TopKCategoricalAccuracy") — a
            ``{"class_name": ..., "config": {...}}`` dict, a Metric (returned as is), a
            Metric class (instantiated), or a function ``fn(y_true, y_pred)`` returning
            per-example values (wrapped in MeanMetricWrapper), or a ``torchmetrics.Metric``
            (wrapped in `TorchMetric`: its own update/compute, called ``(y_pred, y_true)``,
            its states summed over replicas and workers). A name becomes the metric's name in
            the logs, as in Keras' compile.
        loss: The compiled loss, to resolve "accuracy".

    Raises:
        ValueError: Unknown name or class, or an identifier of another kind.
    """
    if isinstance(identifier, Metric):
        return identifier
    if is_torchmetrics_metric(identifier):
        return TorchMetric(identifier)
    if isinstance(identifier, str):
        if identifier.lower() in ("accuracy", "acc"):
            return accuracy_for(loss, name=identifier)
        return _class_named(identifier)(name=identifier)
    if isinstance(identifier, dict) and "class_name" in identifier:
        return _class_named(identifier["class_name"]).from_config(identifier.get("config", {}))
    if isinstance(identifier, type) and issubclass(identifier, Metric):
        return identifier()
    if callable(identifier):
        return MeanMetricWrapper(identifier)
    raise ValueError(
        "A metric must be a name, a config dict, a phalanx.metrics.Metric or a function "
        f"fn(y_true, y_pred). Received: {identifier!r}. HINT: e.g. metrics=['accuracy']."
    )


def _class_named(name: str) -> type[Metric]:
    cls = BY_NAME.get(name) or BY_NAME.get(name.lower())
    if cls is None:
        raise ValueError(
            f"Unknown metric {name!r}. Known names: ['accuracy', 'acc', *{sorted(BY_NAME)}]. HINT: "
            "pass a phalanx.metrics.Metric or a function fn(y_true, y_pred) for other metrics."
        )
    return cls
