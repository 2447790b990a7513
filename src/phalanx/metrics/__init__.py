"""Keras metrics (``phalanx.metrics``) whose totals add up across replicas and workers.

Every metric keeps additive totals (registered with `Metric.add_state`). Created inside a
strategy scope they become SUM sync-on-read variables, so ``result()`` is the global,
count-weighted value however the batches were split over replicas and workers.
A ``torchmetrics.Metric`` is taken as it is (`TorchMetric`), its states summed the same way.
"""

from phalanx.metrics._resolve import get
from phalanx.metrics.accuracy import (
    Accuracy,
    BinaryAccuracy,
    CategoricalAccuracy,
    SparseCategoricalAccuracy,
    SparseTopKCategoricalAccuracy,
    TopKCategoricalAccuracy,
    accuracy,
    binary_accuracy,
    categorical_accuracy,
    sparse_categorical_accuracy,
    sparse_top_k_categorical_accuracy,
    top_k_categorical_accuracy,
)
from phalanx.metrics.auc import AUC
from phalanx.metrics.metric import Metric
from phalanx.metrics.precision_recall import Precision, Recall
from phalanx.metrics.reduction import Mean, MeanMetricWrapper, Sum
from phalanx.metrics.regression import MeanAbsoluteError, MeanSquaredError, RootMeanSquaredError
from phalanx.metrics.torch_metric import TorchMetric

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
    "TorchMetric",
    "accuracy",
    "binary_accuracy",
    "categorical_accuracy",
    "get",
    "sparse_categorical_accuracy",
    "sparse_top_k_categorical_accuracy",
    "top_k_categorical_accuracy",
]
