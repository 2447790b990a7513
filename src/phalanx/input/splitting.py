"""How a global batch is cut into per-replica batches, exactly as tf.distribute rebatches.

Contiguous chunks in global replica order, larger chunks first: 26 over 2 replicas is
13 / 13, 25 is 13 / 12, and 1 over 2 is 1 / 0 (a replica may get an empty batch).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

__all__ = ["as_tensors", "batch_size_of", "slice_batch", "split_sizes", "usual_batch_size"]


def split_sizes(batch_size: int, num_parts: int) -> list[int]:
    """Sizes of ``num_parts`` contiguous chunks of ``batch_size``, larger chunks first."""
    if num_parts < 1:
        raise ValueError(f"num_parts must be >= 1. Received: {num_parts}.")
    base, extra = divmod(batch_size, num_parts)
    return [base + 1 if i < extra else base for i in range(num_parts)]


def as_tensors(structure: Any) -> Any:
    """Converts NumPy arrays (and nested tuples/lists/dicts of them) to tensors without copying."""
    if isinstance(structure, torch.Tensor):
        return structure
    if type(structure) is tuple:  # the usual batch, ``(x, y[, None])``: nothing to convert or rebuild
        for v in structure:
            if type(v) is not torch.Tensor and v is not None:
                break
        else:
            return structure
    if isinstance(structure, np.ndarray):
        return torch.from_numpy(structure)
    if isinstance(structure, tuple) and hasattr(structure, "_fields"):
        return type(structure)(*(as_tensors(v) for v in structure))
    if isinstance(structure, (list, tuple)):
        return type(structure)(as_tensors(v) for v in structure)
    if isinstance(structure, dict):
        return type(structure)((k, as_tensors(v)) for k, v in structure.items())
    return structure


def usual_batch_size(structure: Any, on_cpu: bool = False) -> int:
    """The batch size of the usual batch, a tuple of tensors (and Nones) with one batch size
    (all on the CPU, with ``on_cpu``); -1 for anything else (`as_tensors` and `batch_size_of`
    then decide). One cheap look: the distributed iterator asks it at every step."""
    size = -1
    if type(structure) is tuple:
        for v in structure:
            if v is None:
                continue
            if type(v) is not torch.Tensor:
                return -1
            shape = v.shape  # read once: each read makes a new torch.Size
            if not shape or (size >= 0 and shape[0] != size) or (on_cpu and not v.is_cpu):
                return -1
            size = shape[0]
    return size


def batch_size_of(structure: Any) -> int:
    """The leading dimension of the first tensor leaf.

    Raises:
        ValueError: The batch has no tensor, or its tensors disagree on the batch size.
    """
    size = usual_batch_size(structure)  # the usual batch, ``(x, y[, None])``: no walk, no set
    if size >= 0:
        return size
    sizes: set[int] = set()
    _collect_sizes(structure, sizes)
    if not sizes:
        raise ValueError(
            "A batch must contain at least one tensor or array with a batch dimension. "
            f"Received: {type(structure).__name__}."
        )
    if len(sizes) > 1:
        raise ValueError(
            f"Every tensor of a batch must have the same first dimension. Received sizes {sorted(sizes)}."
        )
    return sizes.pop()


def _collect_sizes(structure: Any, sizes: set[int]) -> None:
    if isinstance(structure, torch.Tensor):
        if structure.dim() == 0:
            raise ValueError(
                "Batched tensors need a batch dimension; received a scalar tensor. HINT: "
                "batch the dataset before distributing it."
            )
        sizes.add(structure.shape[0])
    elif isinstance(structure, (list, tuple)):
        for v in structure:
            _collect_sizes(v, sizes)
    elif isinstance(structure, dict):
        for v in structure.values():
            _collect_sizes(v, sizes)


def slice_batch(structure: Any, start: int, length: int) -> Any:
    """Rows ``[start, start + length)`` of every tensor leaf (views, no copies)."""
    if isinstance(structure, torch.Tensor):
        return structure.narrow(0, start, length)
    if isinstance(structure, tuple) and hasattr(structure, "_fields"):
        return type(structure)(*(slice_batch(v, start, length) for v in structure))
    if isinstance(structure, (list, tuple)):
        return type(structure)(slice_batch(v, start, length) for v in structure)
    if isinstance(structure, dict):
        return type(structure)((k, slice_batch(v, start, length)) for k, v in structure.items())
    return structure
