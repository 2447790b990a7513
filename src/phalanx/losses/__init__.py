"""Keras losses (``phalanx.losses``) that also give per-example values for distributed training.

Every loss reduces like Keras when called (``sum_over_batch_size`` by default: the mean
over the batch) and exposes ``per_example(y_true, y_pred, sample_weight)`` — weighted
losses of shape ``[batch]`` — which `Model.fit` sums and divides by the *global* batch
size, TensorFlow's distributed convention (see ``phalanx.compute_average_loss``). PyTorch's
own losses (``torch.nn.CrossEntropyLoss()``, ``torch.nn.functional.cross_entropy``) are taken
as they are (`TorchLoss`): torch's argument order and reduction, on the global batch.
"""

from phalanx.losses._resolve import get
from phalanx.losses.averaging import compute_average_loss, scale_regularization_loss
from phalanx.losses.builtin import (
    BinaryCrossentropy,
    CategoricalCrossentropy,
    Huber,
    LossFunctionWrapper,
    MeanAbsoluteError,
    MeanSquaredError,
    SparseCategoricalCrossentropy,
)
from phalanx.losses.functions import (
    binary_crossentropy,
    categorical_crossentropy,
    huber,
    mean_absolute_error,
    mean_squared_error,
    sparse_categorical_crossentropy,
)
from phalanx.losses.loss import Loss
from phalanx.losses.torch_loss import TorchLoss

__all__ = [
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
]
