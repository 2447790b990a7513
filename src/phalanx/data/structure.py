"""Nested elements (tensors, tuples, dicts): conversion, indexing and stacking."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

__all__ = ["index", "leading_size", "map_leaves", "stack", "to_tensors", "unstack_len"]


def map_leaves(fn: Callable[[Any], Any], s: Any) -> Any:
    if isinstance(s, tuple) and hasattr(s, "_fields"):
        return type(s)(*(map_leaves(fn, v) for v in s))
    if isinstance(s, (tuple, list)):
        return type(s)(map_leaves(fn, v) for v in s)
    if isinstance(s, dict):
        return {k: map_leaves(fn, v) for k, v in s.items()}
    return fn(s)


def _leaves(s: Any) -> list[Any]:
    if isinstance(s, (tuple, list)):
        return [x for v in s for x in _leaves(v)]
    if isinstance(s, dict):
        return [x for v in s.values() for x in _leaves(v)]
    return [s]


def to_tensors(s: Any) -> Any:
    """NumPy arrays and Python numbers become tensors (dtypes kept: float64 stays float64)."""

    def convert(v: Any) -> Any:
        if isinstance(v, np.ndarray):
            return torch.from_numpy(v)
        if isinstance(v, (int, float, bool)) or (isinstance(v, list) and v and not isinstance(v[0], str)):
            return torch.as_tensor(v)
        return v

    return map_leaves(convert, s)


def leading_size(s: Any) -> int:
    """The common first dimension of every leaf.

    Raises:
        ValueError: Leaves disagree, or a leaf has no first dimension.
    """
    sizes = []
    for leaf in _leaves(s):
        if not hasattr(leaf, "shape") or len(leaf.shape) == 0:
            raise ValueError(f"from_tensor_slices needs tensors with a first dimension. Received: {leaf!r}.")
        sizes.append(int(leaf.shape[0]))
    if len(set(sizes)) > 1:
        raise ValueError(
            f"Every component must have the same first dimension. Received shapes' first dims {sizes}."
        )
    return sizes[0]


def index(s: Any, i: Any) -> Any:
    """Element (or slice) ``i`` of every leaf."""
    return map_leaves(lambda v: v[i], s)


def stack(elements: list[Any]) -> Any:
    """Stacks a list of same-structured elements into one batched structure."""
    first = elements[0]
    if isinstance(first, tuple) and hasattr(first, "_fields"):
        return type(first)(*(stack([e[i] for e in elements]) for i in range(len(first))))
    if isinstance(first, (tuple, list)):
        return type(first)(stack([e[i] for e in elements]) for i in range(len(first)))
    if isinstance(first, dict):
        return {k: stack([e[k] for e in elements]) for k in first}
    if isinstance(first, torch.Tensor):
        return torch.stack(elements)
    if isinstance(first, (int, float, bool)):
        return torch.as_tensor(elements)
    return list(elements)


def unstack_len(s: Any) -> int:
    """The batch size of a batched element."""
    return leading_size(s)
