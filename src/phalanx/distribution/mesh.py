"""`DeviceMesh`: the job's workers arranged in named axes (Keras 3's ``keras.distribution.DeviceMesh``).

A mesh is pure data, as in Keras: a shape and a name per axis (``DeviceMesh((2, 2), ("batch",
"model"))`` is four workers, two along each axis). Worker ``r`` sits at the row-major position
``r`` of the shape, as torch's ``init_device_mesh`` places ranks. `ModelParallelStrategy` turns
it into torch's ``DeviceMesh`` on the job's default process group (the ``"phalanx"`` backend
on CPUs, NCCL on GPUs) when it first needs it: `to_torch`. One axis is the batch axis (input
batches are split along it, and FSDP2 shards the model along it); the other, if any, is the
model axis that tensor parallelism splits weights along.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

__all__ = ["DeviceMesh"]


class DeviceMesh:
    """The job's workers in a grid of named axes.

    Args:
        shape: Workers along each axis; their product is the number of workers in the job.
        axis_names: One distinct name per axis (``"batch"``, ``"model"``).

    Raises:
        ValueError: ``shape`` and ``axis_names`` differ in length, an axis is not a positive
            size, or names repeat.
    """

    def __init__(self, shape: Sequence[int], axis_names: Sequence[str]) -> None:
        shape, axis_names = tuple(shape), tuple(axis_names)
        if len(shape) != len(axis_names) or not shape:
            raise ValueError(
                "DeviceMesh needs one name per axis, and at least one axis. Received: "
                f"shape={shape}, axis_names={axis_names}. HINT: DeviceMesh((2, 2), ('batch', 'model'))."
            )
        if any(not isinstance(n, int) or n < 1 for n in shape):
            raise ValueError(
                f"Every axis of a DeviceMesh is a positive number of workers. Received: {shape}."
            )
        if len(set(axis_names)) != len(axis_names) or not all(isinstance(a, str) and a for a in axis_names):
            raise ValueError(f"DeviceMesh axis names must be distinct strings. Received: {axis_names}.")
        self._shape = shape
        self._axis_names = axis_names

    @property
    def shape(self) -> tuple[int, ...]:
        """Workers along each axis."""
        return self._shape

    @property
    def axis_names(self) -> tuple[str, ...]:
        """The axes' names, in ``shape``'s order."""
        return self._axis_names

    @property
    def size(self) -> int:
        """Workers in the mesh (the product of ``shape``)."""
        return math.prod(self._shape)

    def axis_size(self, name: str) -> int:
        """Workers along axis ``name`` (1 for an axis the mesh lacks: nothing is split there)."""
        return self._shape[self._axis_names.index(name)] if name in self._axis_names else 1

    def coordinate(self, rank: int, name: str) -> int:
        """Worker ``rank``'s position along axis ``name`` (0 for an axis the mesh lacks)."""
        if name not in self._axis_names:
            return 0
        index = self._axis_names.index(name)
        stride = math.prod(self._shape[index + 1 :])
        return (rank // stride) % self._shape[index]

    def to_torch(self, device_type: str) -> Any:
        """torch's ``DeviceMesh`` of this shape and these names on the default process group
        (all workers call it, in the same order: it makes one subgroup per axis)."""
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(device_type, self._shape, mesh_dim_names=self._axis_names)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, DeviceMesh) and (self._shape, self._axis_names) == (
            other.shape,
            other.axis_names,
        )

    def __hash__(self) -> int:
        return hash((self._shape, self._axis_names))

    def __repr__(self) -> str:
        return f"DeviceMesh(shape={self._shape}, axis_names={self._axis_names})"
