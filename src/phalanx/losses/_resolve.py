"""``phalanx.losses.get``: a Loss from a Keras name, a config, a Loss or a plain function."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from phalanx.losses import builtin, functions
from phalanx.losses._utils import to_snake_case
from phalanx.losses.loss import Loss
from phalanx.losses.torch_loss import TorchLoss, is_torch_loss

__all__ = ["get"]

_CLASSES: list[type[Loss]] = [
    builtin.BinaryCrossentropy,
    builtin.CategoricalCrossentropy,
    builtin.Huber,
    builtin.MeanAbsoluteError,
    builtin.MeanSquaredError,
    builtin.SparseCategoricalCrossentropy,
]
_FUNCTION_CLASS: dict[Callable[..., Any], type[Loss]] = {
    functions.binary_crossentropy: builtin.BinaryCrossentropy,
    functions.categorical_crossentropy: builtin.CategoricalCrossentropy,
    functions.huber: builtin.Huber,
    functions.mean_absolute_error: builtin.MeanAbsoluteError,
    functions.mean_squared_error: builtin.MeanSquaredError,
    functions.sparse_categorical_crossentropy: builtin.SparseCategoricalCrossentropy,
}
_ALIASES = {"mse": "mean_squared_error", "mae": "mean_absolute_error", "bce": "binary_crossentropy"}


def _by_name() -> dict[str, type[Loss]]:
    table: dict[str, type[Loss]] = {}
    for cls in _CLASSES:
        table[cls.__name__] = cls
        table[to_snake_case(cls.__name__)] = cls
    for fn, cls in _FUNCTION_CLASS.items():
        table[fn.__name__] = cls
    for alias, target in _ALIASES.items():
        table[alias] = table[alias.upper()] = table[target]
    return table


BY_NAME = _by_name()


def get(identifier: Any) -> Loss | TorchLoss:
    """A Loss from any of Keras' ways to name one, or a PyTorch loss in torch's argument order.

    Args:
        identifier: A name ("mse", "mae", "bce", "huber", "binary_crossentropy",
            "categorical_crossentropy", "sparse_categorical_crossentropy", or a class name in
            CamelCase or snake_case), a ``{"class_name": ..., "config": {...}}`` dict, a Loss
            object (returned as is), a Loss class (instantiated), a PyTorch loss (a
            ``torch.nn`` loss module such as ``torch.nn.CrossEntropyLoss()``, or one of
            `phalanx.losses.torch_loss.TORCH_FUNCTIONAL_LOSSES` such as
            ``torch.nn.functional.cross_entropy``, possibly in a ``functools.partial``:
            wrapped in `TorchLoss`, called ``(y_pred, y_true)`` with its own reduction), or a
            plain function ``fn(y_true, y_pred)`` returning per-example values (wrapped).

    Raises:
        ValueError: Unknown name or class, or an identifier of another kind.
    """
    if isinstance(identifier, (Loss, TorchLoss)):
        return identifier
    if is_torch_loss(identifier):
        return TorchLoss(identifier)
    if isinstance(identifier, type) and issubclass(identifier, torch.nn.modules.loss._Loss):
        return TorchLoss(identifier())
    if isinstance(identifier, str):
        return _class_named(identifier)()
    if isinstance(identifier, dict) and "class_name" in identifier:
        return _class_named(identifier["class_name"]).from_config(identifier.get("config", {}))
    if isinstance(identifier, type) and issubclass(identifier, Loss):
        return identifier()
    if callable(identifier):
        cls = _FUNCTION_CLASS.get(identifier)
        return cls() if cls is not None else builtin.LossFunctionWrapper(identifier)
    raise ValueError(
        "A loss must be a name, a config dict, a phalanx.losses.Loss or a function "
        f"fn(y_true, y_pred). Received: {identifier!r}. HINT: e.g. loss='sparse_categorical_crossentropy'."
    )


def _class_named(name: str) -> type[Loss]:
    cls = BY_NAME.get(name) or BY_NAME.get(name.lower())
    if cls is None:
        raise ValueError(
            f"Unknown loss {name!r}. Known names: {sorted(BY_NAME)}. HINT: pass a "
            "phalanx.losses.Loss object or a function fn(y_true, y_pred) for other losses."
        )
    return cls
