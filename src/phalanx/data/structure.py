"""Nested elements: tensors (or strings) in tuples and dicts, as tf.data nests them.

A *structure* is a tuple (named tuples included) or a dict; anything else is a *leaf*.
Like tf.data, a Python list is a leaf: it becomes one tensor (or, for strings, stays a list
of strings), never a structure of several components.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch

__all__ = [
    "apply_unpacked",
    "index",
    "leading_size",
    "leaves",
    "map_leaves",
    "stack",
    "to_tensors",
    "unstack",
]

_SCALARS = (bool, int, float, complex)
_STRINGS = (str, bytes)


def map_leaves(fn: Callable[[Any], Any], s: Any) -> Any:
    """``s`` with ``fn`` applied to every leaf, its tuples and dicts rebuilt."""
    if isinstance(s, tuple):
        values = [map_leaves(fn, v) for v in s]
        return type(s)(*values) if hasattr(s, "_fields") else tuple(values)
    if isinstance(s, dict):
        return {k: map_leaves(fn, v) for k, v in s.items()}
    return fn(s)


def leaves(s: Any) -> list[Any]:
    """The leaves of ``s`` in order (dicts in insertion order)."""
    if isinstance(s, tuple):
        return [x for v in s for x in leaves(v)]
    if isinstance(s, dict):
        return [x for v in s.values() for x in leaves(v)]
    return [s]


def apply_unpacked(fn: Callable[..., Any], element: Any) -> Any:
    """Calls ``fn`` as tf.data does: a plain tuple is unpacked into arguments."""
    return fn(*element) if type(element) is tuple else fn(element)


def to_tensors(s: Any) -> Any:
    """``s`` with NumPy arrays, numbers and numeric lists turned into tensors.

    Dtypes are kept (float64 arrays stay float64; Python floats become float32, as in
    tf.data). Strings, and lists or arrays of strings, stay strings.

    Raises:
        TypeError: A leaf is not a tensor, array, number, string or list of them.
    """
    return map_leaves(_to_leaf, s)


def _to_leaf(v: Any) -> Any:
    if isinstance(v, (torch.Tensor, *_STRINGS)):
        return v
    if isinstance(v, np.ndarray):
        return _from_array(v)
    if isinstance(v, (*_SCALARS, np.generic)):
        return _from_array(np.asarray(v)) if isinstance(v, np.generic) else torch.tensor(v)
    if isinstance(v, list):
        return _from_list(v)
    raise TypeError(
        "Dataset elements must be tensors, NumPy arrays, numbers or strings, nested in tuples "
        f"and dicts. Received a leaf of type {type(v).__name__}: {v!r:.80}. HINT: convert it "
        "with torch.as_tensor, or return a tuple instead of a custom object."
    )


def _from_array(a: np.ndarray) -> Any:
    if a.dtype.kind in "US":
        return a.item() if a.ndim == 0 else a.tolist()
    if a.dtype.kind == "O":
        raise TypeError(
            "Dataset elements cannot be NumPy object arrays. Received an array of dtype object "
            f"with shape {a.shape}. HINT: give it a numeric dtype (np.stack ragged rows first)."
        )
    # torch.from_numpy shares memory and warns on read-only arrays; copy those.
    return torch.from_numpy(a if a.flags.writeable else a.copy())


def _from_list(v: list[Any]) -> Any:
    if v and all(isinstance(x, _STRINGS) for x in v):
        return list(v)
    if v and all(isinstance(x, torch.Tensor) for x in v):
        return torch.stack(v)
    try:
        return torch.as_tensor(v)
    except (TypeError, ValueError, RuntimeError) as e:
        raise TypeError(
            "A list in a dataset element must convert to one tensor (same-length numeric rows) "
            f"or be a list of strings. Received: {v!r:.80}. HINT: use a tuple to hold "
            f"components of different shapes. ({e})"
        ) from e


def _leaf_size(leaf: Any) -> int | None:
    if isinstance(leaf, list):
        return len(leaf)
    shape = getattr(leaf, "shape", None)
    return int(shape[0]) if shape is not None and len(shape) > 0 else None


def leading_size(s: Any, what: str) -> int:
    """The first dimension shared by every leaf of ``s``.

    Args:
        s: A structure of tensors or lists of strings.
        what: The operation, for error messages (``"from_tensor_slices"``).

    Raises:
        ValueError: A leaf has no first dimension, or the leaves disagree on it.
    """
    parts = leaves(s)
    sizes = [_leaf_size(leaf) for leaf in parts]
    for leaf, size in zip(parts, sizes, strict=True):
        if size is None:
            raise ValueError(
                f"{what} needs every component to have a first dimension. Received a scalar: "
                f"{leaf!r:.80}. HINT: use Dataset.from_tensors for a single element."
            )
    if len(set(sizes)) > 1:
        shapes = [tuple(getattr(leaf, "shape", (len(leaf),))) for leaf in parts]
        raise ValueError(
            f"{what} needs every component to have the same first dimension. Received shapes "
            f"{shapes}. HINT: give every component the same number of rows."
        )
    return int(sizes[0])  # type: ignore[arg-type]


def index(s: Any, i: int | slice | torch.Tensor) -> Any:
    """Row ``i`` (an int), rows ``i`` (a slice) or the rows listed in ``i`` (a 1-D tensor)."""
    return map_leaves(lambda leaf: _index_leaf(leaf, i), s)


def _index_leaf(leaf: Any, i: int | slice | torch.Tensor) -> Any:
    if isinstance(i, torch.Tensor):
        if isinstance(leaf, list):
            return [leaf[j] for j in i.tolist()]
        return leaf.index_select(0, i.to(leaf.device))
    return leaf[i]


def stack(elements: Sequence[Any]) -> Any:
    """Same-structured elements stacked into one batched element.

    Tensors are stacked along a new first dimension; strings gather into a list.

    Raises:
        ValueError: The elements differ in structure, or their tensors in shape.
    """
    first = elements[0]
    if isinstance(first, tuple):
        _require_same(elements, lambda e: isinstance(e, tuple) and len(e) == len(first), first)
        values = [stack([e[i] for e in elements]) for i in range(len(first))]
        return type(first)(*values) if hasattr(first, "_fields") else tuple(values)
    if isinstance(first, dict):
        _require_same(elements, lambda e: isinstance(e, dict) and e.keys() == first.keys(), first)
        return {k: stack([e[k] for e in elements]) for k in first}
    return _stack_leaves(elements)


def _require_same(elements: Sequence[Any], same: Callable[[Any], bool], first: Any) -> None:
    for e in elements:
        if not same(e):
            raise ValueError(
                "batch needs every element to have the same structure. Received "
                f"{_outline(first)} and {_outline(e)}. HINT: make the source or map function "
                "return the same tuple/dict layout for every element."
            )


def _outline(s: Any) -> str:
    if isinstance(s, dict):
        return "dict with keys " + str(sorted(map(str, s)))
    if isinstance(s, tuple):
        return f"tuple of {len(s)}"
    return type(s).__name__


def _stack_leaves(elements: Sequence[Any]) -> Any:
    if all(isinstance(e, _STRINGS) for e in elements):
        return list(elements)
    if all(isinstance(e, torch.Tensor) for e in elements):
        shapes = {tuple(e.shape) for e in elements}
        if len(shapes) > 1:
            raise ValueError(
                "batch needs tensors of one shape to stack. Received shapes "
                f"{sorted(shapes)}. HINT: resize or pad elements in a map() before batch()."
            )
        return torch.stack(list(elements))
    kinds = sorted({type(e).__name__ for e in elements})
    raise ValueError(
        f"batch cannot stack leaves of different kinds. Received: {kinds}. HINT: make every "
        "element's component a tensor (or every one a string)."
    )


def unstack(batch: Any) -> Iterator[Any]:
    """The rows of a batched element, in order.

    Raises:
        ValueError: A component has no first dimension, or components disagree on it.
    """
    for i in range(leading_size(batch, "unbatch")):
        yield index(batch, i)
