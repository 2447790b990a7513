"""TF's typed generators: ``Dataset.from_generator(gen, output_types=, output_shapes=)`` or
``output_signature=``. Each element is converted to tensors of the declared dtypes and checked
against the declared shapes (None: any size), as ``tf.data`` does when it reads a generator."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

__all__ = ["typed_generator"]


@dataclass(frozen=True)
class _Declared:
    """One tensor of an element: its dtype and shape (None: any shape; a None size: any size)."""

    dtype: torch.dtype
    shape: tuple[int | None, ...] | None


def _dtype(declared: Any) -> torch.dtype:
    """A torch dtype from what a TF program passes: a torch dtype, a name, or a NumPy dtype."""
    if isinstance(declared, torch.dtype):
        return declared
    name = getattr(declared, "name", declared)  # tf.float32.name, np.dtype("float32").name
    found = getattr(torch, str(name), None) if isinstance(name, str) else None
    if not isinstance(found, torch.dtype):
        try:
            found = torch.from_numpy(np.zeros(0, dtype=np.dtype(declared))).dtype
        except TypeError:
            found = None
    if not isinstance(found, torch.dtype):
        raise TypeError(
            f"from_generator's output_types must be dtypes. Received: {declared!r}. "
            "HINT: torch.float32, 'float32' or np.float32."
        )
    return found


def _shape(declared: Any) -> tuple[int | None, ...] | None:
    if declared is None:
        return None
    dims = getattr(declared, "as_list", lambda: declared)()  # a tf.TensorShape-like object
    return tuple(None if d is None else int(d) for d in dims)


def _zip_structure(values: Any, spec: Any, what: str) -> list[tuple[Any, Any]]:
    """Pairs each leaf of ``values`` with its declaration in ``spec`` (same nesting)."""
    if isinstance(spec, dict):
        if not isinstance(values, dict) or set(values) != set(spec):
            raise ValueError(f"from_generator: an element does not match {what}. Received: {values!r}.")
        return [pair for key in spec for pair in _zip_structure(values[key], spec[key], what)]
    if isinstance(spec, tuple):
        if not isinstance(values, (tuple, list)) or len(values) != len(spec):
            raise ValueError(f"from_generator: an element does not match {what}. Received: {values!r}.")
        return [pair for v, s in zip(values, spec, strict=True) for pair in _zip_structure(v, s, what)]
    return [(values, spec)]


def _rebuild(spec: Any, leaves: Iterator[Any]) -> Any:
    if isinstance(spec, dict):
        return {key: _rebuild(spec[key], leaves) for key in spec}
    if isinstance(spec, tuple):
        return tuple(_rebuild(s, leaves) for s in spec)
    return next(leaves)


def _leaf(value: Any, declared: _Declared) -> torch.Tensor:
    tensor = torch.as_tensor(value if isinstance(value, torch.Tensor) else np.asarray(value)).to(
        declared.dtype
    )
    shape = declared.shape
    if shape is not None and (
        tensor.dim() != len(shape)
        or any(want is not None and want != got for want, got in zip(shape, tensor.shape, strict=True))
    ):
        raise ValueError(
            f"from_generator: an element has shape {tuple(tensor.shape)}, but output_shapes declares "
            f"{shape} (None: any size). HINT: yield elements of the declared shape, or declare None."
        )
    return tensor


def typed_generator(
    generator: Callable[[], Iterable[Any]],
    output_types: Any = None,
    output_shapes: Any = None,
    output_signature: Any = None,
) -> Callable[[], Iterator[Any]]:
    """``generator`` whose elements become tensors of the declared dtypes and shapes.

    Raises:
        ValueError: Both ``output_signature`` and ``output_types`` are given, or
            ``output_shapes`` comes without ``output_types`` (TF's rules); at iteration, an
            element whose structure or shape differs from the declaration.
        TypeError: A declared type is not a dtype.
    """
    if output_signature is not None and (output_types is not None or output_shapes is not None):
        raise ValueError(
            "from_generator takes output_signature or output_types/output_shapes, not both "
            "(TF's rule). HINT: pass output_signature only."
        )
    if output_shapes is not None and output_types is None:
        raise ValueError(
            "from_generator's output_shapes needs output_types (TF's rule). HINT: add output_types."
        )
    if output_signature is not None:
        spec = _map_spec(output_signature, lambda s: _Declared(_dtype(s.dtype), _shape(s.shape)))
    else:
        spec = _declared(output_types, output_shapes)

    def elements() -> Iterator[Any]:
        for element in generator():
            pairs = _zip_structure(element, spec, "the declared types")
            yield _rebuild(spec, iter(_leaf(value, declared) for value, declared in pairs))

    return elements


def _declared(types: Any, shapes: Any) -> Any:
    """(dtype, shape) per leaf of ``types``; ``shapes`` follows ``types``' nesting down to each
    leaf, where it is one shape (TF's ``map_structure_up_to(output_types, ...)``)."""
    if isinstance(types, dict):
        return {
            key: _declared(value, None if shapes is None else shapes[key]) for key, value in types.items()
        }
    if isinstance(types, tuple):
        if shapes is not None and (not isinstance(shapes, (tuple, list)) or len(shapes) != len(types)):
            raise ValueError(
                f"from_generator's output_shapes must follow output_types' structure. Received: "
                f"output_types={types!r}, output_shapes={shapes!r}."
            )
        parts = [None] * len(types) if shapes is None else list(shapes)
        return tuple(_declared(t, s) for t, s in zip(types, parts, strict=True))
    return _Declared(_dtype(types), _shape(shapes))


def _map_spec(spec: Any, fn: Callable[[Any], Any]) -> Any:
    if isinstance(spec, dict):
        return {key: _map_spec(value, fn) for key, value in spec.items()}
    if isinstance(spec, tuple):
        return tuple(_map_spec(value, fn) for value in spec)
    return fn(spec)
