"""Canned estimators: `DNNClassifier` and `LinearClassifier` over numeric feature columns
(tf.estimator's canned models, tf.feature_column.numeric_column).

Of TF's feature columns only ``numeric_column`` is here; categorical, bucketized, crossed,
embedding and indicator columns are not (one-hot or embed such features in the input_fn, or
write a model_fn). Classes are integer ids (no ``label_vocabulary``); no ``weight_column``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from phalanx.estimator.estimator import Estimator
from phalanx.estimator.graph import get_module, get_optimizer
from phalanx.estimator.run_config import RunConfig
from phalanx.estimator.specs import EstimatorSpec, ModeKeys

__all__ = ["DNNClassifier", "LinearClassifier", "NumericColumn", "numeric_column"]

_OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "adagrad": torch.optim.Adagrad,
    "adam": torch.optim.Adam,
    "rmsprop": torch.optim.RMSprop,
    "sgd": torch.optim.SGD,
}


@dataclass(frozen=True)
class NumericColumn:
    """A dense float feature (tf.feature_column.numeric_column)."""

    key: str
    shape: tuple[int, ...] = (1,)
    normalizer_fn: Callable[[torch.Tensor], torch.Tensor] | None = None

    @property
    def width(self) -> int:
        return math.prod(self.shape)

    def transform(self, features: Mapping[str, Any]) -> torch.Tensor:
        """This column's values as ``[batch, width]`` floats.

        Raises:
            KeyError: The features have no ``key``.
        """
        if self.key not in features:
            raise KeyError(
                f"The features have no column {self.key!r}. Received: keys {sorted(features)}. "
                "HINT: the input_fn's features dict names every feature column's key."
            )
        value = torch.as_tensor(features[self.key], dtype=torch.float32)
        value = value.reshape(value.shape[0], self.width)
        return self.normalizer_fn(value) if self.normalizer_fn is not None else value


def numeric_column(
    key: str,
    shape: int | Sequence[int] = (1,),
    normalizer_fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> NumericColumn:
    """A dense float feature named ``key`` of ``shape`` per example (tf.feature_column.numeric_column)."""
    return NumericColumn(key, (shape,) if isinstance(shape, int) else tuple(shape), normalizer_fn)


def _check_columns(columns: Sequence[Any]) -> list[NumericColumn]:
    columns = list(columns)
    if not columns or not all(isinstance(c, NumericColumn) for c in columns):
        raise ValueError(
            "The canned estimators take numeric feature columns. Received: "
            f"{[type(c).__name__ for c in columns]}. HINT: phalanx.estimator.numeric_column(key, "
            "shape); one-hot or embed categorical features in the input_fn (categorical, bucketized, "
            "crossed and embedding columns are not available)."
        )
    return [c for c in columns if isinstance(c, NumericColumn)]


def _optimizer(spec: Any, params: Any, default_lr: float) -> torch.optim.Optimizer:
    """TF's optimizer argument: a name ('Adagrad'), an optimizer class, or a callable of the params."""
    if isinstance(spec, str):
        name = spec.lower()
        if name not in _OPTIMIZERS:
            raise ValueError(
                f"Unknown optimizer name. Received: {spec!r}. HINT: one of {sorted(_OPTIMIZERS)} "
                "(TF's 'Ftrl' has no torch counterpart), or a callable params -> torch optimizer."
            )
        return _OPTIMIZERS[name](params, lr=default_lr)
    optimizer = spec(params)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer(params) returns a torch optimizer. Received: {type(optimizer).__name__}.")
    return optimizer


class _Classifier(Estimator):
    """A classifier over numeric feature columns: logits from a network, TF's heads."""

    def __init__(
        self,
        columns: Sequence[Any],
        n_classes: int,
        optimizer: Any,
        default_lr: float,
        model_dir: str | None,
        config: RunConfig | None,
    ) -> None:
        if n_classes < 2:
            raise ValueError(f"n_classes must be >= 2. Received: {n_classes}.")
        self.feature_columns = _check_columns(columns)
        self.n_classes = n_classes
        self._optimizer_spec, self._default_lr = optimizer, default_lr
        super().__init__(self._model_fn_of_classifier, model_dir=model_dir, config=config)

    def _network(self, width: int, outputs: int) -> nn.Module:
        raise NotImplementedError  # each canned estimator builds its own

    def _model_fn_of_classifier(self, features: Any, labels: Any, mode: str) -> EstimatorSpec:
        inputs = torch.cat([c.transform(features) for c in self.feature_columns], dim=1)
        outputs = 1 if self.n_classes == 2 else self.n_classes  # TF: one logit for binary
        width = sum(c.width for c in self.feature_columns)
        net = get_module("classifier", lambda: self._network(width, outputs))
        logits = net(inputs)
        if outputs == 1:
            probabilities = torch.cat([1 - torch.sigmoid(logits), torch.sigmoid(logits)], dim=1)
        else:
            probabilities = torch.softmax(logits, dim=1)
        class_ids = probabilities.argmax(dim=1)
        predictions = {"logits": logits, "probabilities": probabilities, "class_ids": class_ids}
        if mode == ModeKeys.PREDICT:
            return EstimatorSpec(mode, predictions=predictions)
        labels = torch.as_tensor(labels).reshape(-1).long()
        if outputs == 1:
            loss = nn.functional.binary_cross_entropy_with_logits(logits.reshape(-1), labels.float())
        else:
            loss = nn.functional.cross_entropy(logits, labels)
        if mode == ModeKeys.EVAL:
            accuracy = (class_ids == labels).float().mean()
            return EstimatorSpec(
                mode, loss=loss, eval_metric_ops={"accuracy": accuracy, "average_loss": loss}
            )
        optimizer = get_optimizer(
            lambda: _optimizer(self._optimizer_spec, net.parameters(), self._default_lr)
        )
        return EstimatorSpec(mode, predictions=predictions, loss=loss, train_op=optimizer)


class DNNClassifier(_Classifier):
    """A feed-forward classifier (tf.estimator.DNNClassifier).

    Args:
        hidden_units: Units of each hidden layer, e.g. ``[64, 32]``.
        feature_columns: `numeric_column`\\ s.
        model_dir: Checkpoints and summaries.
        n_classes: Classes (labels are ids in ``[0, n_classes)``); 2 uses one logit (sigmoid).
        optimizer: 'Adagrad' (default, learning rate 0.05 as TF), 'Adam', 'RMSProp', 'SGD', or a
            callable ``params -> torch optimizer``.
        activation_fn: The hidden layers' activation module class (default ReLU).
        dropout: Dropout probability after each hidden layer (None: none).
        batch_norm: BatchNorm after each hidden layer.
        config: A `RunConfig`.
    """

    def __init__(
        self,
        hidden_units: Sequence[int],
        feature_columns: Sequence[Any],
        model_dir: str | None = None,
        n_classes: int = 2,
        optimizer: Any = "Adagrad",
        activation_fn: type[nn.Module] = nn.ReLU,
        dropout: float | None = None,
        config: RunConfig | None = None,
        batch_norm: bool = False,
    ) -> None:
        self.hidden_units = list(hidden_units)
        self._activation, self._dropout, self._batch_norm = activation_fn, dropout, batch_norm
        super().__init__(feature_columns, n_classes, optimizer, 0.05, model_dir, config)

    def _network(self, width: int, outputs: int) -> nn.Module:
        layers: list[nn.Module] = []
        for units in self.hidden_units:
            layers += [nn.Linear(width, units), self._activation()]
            if self._batch_norm:
                layers.append(nn.BatchNorm1d(units))
            if self._dropout:
                layers.append(nn.Dropout(self._dropout))
            width = units
        return nn.Sequential(*layers, nn.Linear(width, outputs))


class LinearClassifier(_Classifier):
    """A linear classifier (tf.estimator.LinearClassifier).

    Args:
        feature_columns: `numeric_column`\\ s.
        model_dir: Checkpoints and summaries.
        n_classes: Classes (labels are ids in ``[0, n_classes)``); 2 uses one logit (sigmoid).
        optimizer: As `DNNClassifier`'s; default 'Adagrad' with learning rate 0.2 (TF's
            default, FTRL, has no torch counterpart; without regularisation FTRL's
            per-coordinate steps are Adagrad's).
        config: A `RunConfig`.
    """

    def __init__(
        self,
        feature_columns: Sequence[Any],
        model_dir: str | None = None,
        n_classes: int = 2,
        optimizer: Any = "Adagrad",
        config: RunConfig | None = None,
    ) -> None:
        super().__init__(feature_columns, n_classes, optimizer, 0.2, model_dir, config)

    def _network(self, width: int, outputs: int) -> nn.Module:
        return nn.Linear(width, outputs)
