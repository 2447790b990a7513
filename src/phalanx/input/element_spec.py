"""What a distributed dataset's elements look like: `TensorSpec` and `PerReplicaSpec`.

TensorFlow reads a dataset's ``element_spec`` from its graph without running it; a PyTorch
source (a `DataLoader`, a generator, a `phalanx.data.Dataset`) declares none, so phalanx
reads one element and describes it. The batch dimension is reported as None, as TF does for
batches whose size varies (a distributed batch is split over replicas, the last one partial).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["PerReplicaSpec", "TensorSpec", "spec_of"]


@dataclass(frozen=True)
class TensorSpec:
    """The shape (None: varies) and dtype of one tensor of an element (tf.TensorSpec)."""

    shape: tuple[int | None, ...]
    dtype: torch.dtype | str
    name: str | None = None

    def is_compatible_with(self, value: Any) -> bool:
        """Whether a tensor has this dtype and, where the spec fixes them, these sizes."""
        if not isinstance(value, torch.Tensor) or value.dtype != self.dtype or value.dim() != len(self.shape):
            return False
        return all(want is None or want == got for want, got in zip(self.shape, value.shape, strict=True))


@dataclass(frozen=True)
class PerReplicaSpec:
    """The specs of the components of a per-replica value, one per local replica."""

    value_specs: tuple[Any, ...]


def _spec_tree(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        shape = (None, *value.shape[1:]) if value.dim() else ()
        return TensorSpec(tuple(shape), value.dtype)
    if isinstance(value, list) and all(isinstance(v, (str, bytes)) for v in value):
        return TensorSpec((None,), "string")
    if isinstance(value, tuple):
        specs = [_spec_tree(v) for v in value]
        return type(value)(*specs) if hasattr(value, "_fields") else tuple(specs)
    if isinstance(value, dict):
        return {k: _spec_tree(v) for k, v in value.items()}
    raise TypeError(
        "element_spec describes tensors (in tuples and dicts) and lists of strings. "
        f"Received: {type(value).__name__}."
    )


def spec_of(element: Any, num_local_replicas: int) -> Any:
    """The spec of one replica's batch ``element`` (its batch dimension None); a
    `PerReplicaSpec` of copies when the worker has several local replicas."""
    spec = _spec_tree(element)
    return spec if num_local_replicas == 1 else PerReplicaSpec((spec,) * num_local_replicas)
