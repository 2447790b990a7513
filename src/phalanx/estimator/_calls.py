"""Calling user functions the way tf.estimator does: with the arguments they name."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

__all__ = ["batch_size", "call_with", "input_batches", "split_batch"]


def call_with(fn: Callable[..., Any], **available: Any) -> Any:
    """``fn`` called with those of ``available`` its signature names (TF passes ``params``,
    ``config``, ``mode``... only to a function that asks for them)."""
    parameters = inspect.signature(fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return fn(**available)
    return fn(**{name: value for name, value in available.items() if name in parameters})


def input_batches(input_fn: Callable[..., Any], **available: Any) -> Iterator[Any]:
    """The batches of ``input_fn()``: an iterable of ``(features, labels)`` or of features.

    Raises:
        TypeError: ``input_fn`` returned something that is not iterable.
    """
    batches = call_with(input_fn, **available)
    try:
        return iter(batches)
    except TypeError:
        raise TypeError(
            "An input_fn returns an iterable of (features, labels) batches (a generator, a list, a "
            f"DataLoader). Received: {type(batches).__name__}. HINT: `def input_fn(): return "
            "torch.utils.data.DataLoader(dataset, batch_size=32)`."
        ) from None


def split_batch(batch: Any) -> tuple[Any, Any]:
    """``(features, labels)`` of a batch; a batch of features alone has labels None."""
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[0], batch[1]
    return batch, None


def batch_size(value: Any) -> int:
    """The number of examples in a tensor or in the first tensor of a dict."""
    if isinstance(value, Mapping):
        value = next(iter(value.values()))
    return int(torch.as_tensor(value).shape[0]) if torch.as_tensor(value).dim() else 1
