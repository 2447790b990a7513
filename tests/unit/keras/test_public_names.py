"""The public names of phalanx.losses, phalanx.metrics and phalanx.callbacks are frozen here."""

from __future__ import annotations

import subprocess
import sys

import pytest

from phalanx import callbacks, losses, metrics

EXPECTED = {
    losses: [
        "BinaryCrossentropy",
        "CategoricalCrossentropy",
        "Huber",
        "Loss",
        "LossFunctionWrapper",
        "MeanAbsoluteError",
        "MeanSquaredError",
        "SparseCategoricalCrossentropy",
        "TorchLoss",
        "binary_crossentropy",
        "categorical_crossentropy",
        "compute_average_loss",
        "get",
        "huber",
        "mean_absolute_error",
        "mean_squared_error",
        "scale_regularization_loss",
        "sparse_categorical_crossentropy",
    ],
    metrics: [
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
    ],
    callbacks: [
        "BackupAndRestore",
        "CSVLogger",
        "Callback",
        "CallbackList",
        "EarlyStopping",
        "History",
        "LambdaCallback",
        "LearningRateScheduler",
        "ModelCheckpoint",
        "MonitorCallback",
        "ProgbarLogger",
        "ReduceLROnPlateau",
        "TensorBoard",
        "TerminateOnNaN",
    ],
}


@pytest.mark.parametrize("module", list(EXPECTED), ids=lambda m: m.__name__)
def test_public_names_are_frozen(module):
    assert sorted(module.__all__) == sorted(EXPECTED[module])
    for name in module.__all__:
        assert hasattr(module, name), name


def test_importing_them_does_not_load_tensorboard():
    code = (
        "import sys, phalanx.losses, phalanx.metrics, phalanx.callbacks; "
        "print('torch.utils.tensorboard' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False"]
