"""Reductions across the devices of one process (tf.distribute.CrossDeviceOps).

A cross-device op reduces one value per local replica into one result and broadcasts it
back. Who calls it: the strategy, from one thread, while every replica waits (cross-replica
context). `batch_reduce` packs many small tensors into few large transfers.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch

from phalanx.communication.local.packing import pack, spec_of, split_packs, unpack
from phalanx.values import DistributedValues, Mirrored, ReduceOp, local_results

__all__ = [
    "CrossDeviceOps",
    "HierarchicalCopyAllReduce",
    "NcclAllReduce",
    "ReductionToOneDevice",
    "select_cross_device_ops",
]

Destination = Any  # a torch.device, a device string, a tensor or a distributed value


def _add_n(tensors: list[torch.Tensor]) -> torch.Tensor:
    if len(tensors) == 1:
        return tensors[0].clone()
    return functools.reduce(torch.add, tensors)


def destination_devices(destinations: Destination) -> list[torch.device]:
    """The devices a destination names: a device, a tensor's device, a value's components."""
    if isinstance(destinations, DistributedValues):
        return [c.device for c in destinations.values]
    if isinstance(destinations, torch.Tensor):
        from phalanx.variables import DistributedVariable

        if isinstance(destinations, DistributedVariable):
            return [c.device for c in destinations.components]
        return [destinations.device]
    if isinstance(destinations, (list, tuple)):
        return [torch.device(d) for d in destinations]
    return [torch.device(destinations)]


class CrossDeviceOps:
    """Base of the in-process reductions. Subclasses implement `reduce_to` and `broadcast`."""

    def reduce_to(
        self, reduce_op: ReduceOp, tensors: Sequence[torch.Tensor], device: torch.device
    ) -> torch.Tensor:
        """Reduces one tensor per replica into a new tensor on ``device``."""
        raise NotImplementedError

    def broadcast(self, tensor: torch.Tensor, devices: Sequence[torch.device]) -> list[torch.Tensor]:
        """One copy of ``tensor`` per device (the same object where the device already matches)."""
        return [tensor if tensor.device == d else tensor.to(d, non_blocking=True) for d in devices]

    def broadcast_implementation(self, tensor: torch.Tensor, destinations: Destination) -> Any:
        """TF's broadcast of ``tensor`` to ``destinations`` (devices, a device, or a value whose
        devices are taken): a tensor for one device, else a `Mirrored` value of copies."""
        copies = self.broadcast(tensor, destination_devices(destinations))
        return copies[0] if len(copies) == 1 else Mirrored(copies)

    def can_sum_in_place(self, devices: Sequence[torch.device]) -> bool:
        """Whether replicas on ``devices`` may sum their gradients in place, in parallel.

        True means these ops would compute the plain element-wise sum in host memory that
        every replica thread can read and write: the gradient path then lets replica ``i``
        sum slice ``i`` of every gradient directly (no packing, no copies to one device).
        False (the default) keeps the reduction in these ops' `reduce_to`.

        Args:
            devices: The local replicas' devices.
        """
        return False

    def reduce(
        self,
        reduce_op: ReduceOp | str,
        per_replica_value: Any,
        destinations: Destination,
        options: Any = None,
    ) -> Any:
        """Reduces a per-replica value and places the result on ``destinations``.

        Calls `reduce_implementation` (TF's overridable hook; ``options`` are passed on).

        Returns:
            A tensor for one destination device, else a `Mirrored` value.
        """
        return self.reduce_implementation(
            ReduceOp.coerce(reduce_op), per_replica_value, destinations, options
        )

    def reduce_implementation(
        self, reduce_op: ReduceOp, per_replica_value: Any, destinations: Destination, options: Any = None
    ) -> Any:
        """What `reduce` does (override to change it, as in TF): `reduce_to` one device, then
        `broadcast` to the destinations. ``options`` (CommunicationOptions) do not apply in
        one process."""
        op = reduce_op
        devices = destination_devices(destinations)
        values = [torch.as_tensor(v) for v in local_results(per_replica_value)]
        result = self.reduce_to(op, values, devices[0])
        copies = self.broadcast(result, devices)
        return copies[0] if len(copies) == 1 else Mirrored(copies)

    def batch_reduce(
        self,
        reduce_op: ReduceOp | str,
        value_destination_pairs: Sequence[tuple[Any, Destination]],
        options: Any = None,
    ) -> list[Any]:
        """Reduces many per-replica values at once, packed into one buffer per dtype (calls
        `batch_reduce_implementation`, TF's overridable hook)."""
        return self.batch_reduce_implementation(ReduceOp.coerce(reduce_op), value_destination_pairs, options)

    def batch_reduce_implementation(
        self,
        reduce_op: ReduceOp,
        value_destination_pairs: Sequence[tuple[Any, Destination]],
        options: Any = None,
    ) -> list[Any]:
        """What `batch_reduce` does (override to change it, as in TF)."""
        op = reduce_op
        if not value_destination_pairs:
            return []
        per_value = [
            [torch.as_tensor(v) for v in local_results(value)] for value, _ in value_destination_pairs
        ]
        num_replicas = len(per_value[0])
        if any(len(v) != num_replicas for v in per_value):
            raise ValueError(
                "batch_reduce needs the same number of components in every value. Received: "
                f"{[len(v) for v in per_value]}."
            )
        like = [v[0] for v in per_value]
        spec = spec_of(like)
        replica_buffers = [pack([v[r] for v in per_value], like) for r in range(num_replicas)]
        device = destination_devices(value_destination_pairs[0][1])[0]
        reduced = {
            dtype: self.reduce_to(op, [b[dtype] for b in replica_buffers], device) for dtype in spec.dtypes
        }
        results = []
        for tensor, (_, dest) in zip(unpack(reduced, spec), value_destination_pairs, strict=True):
            copies = self.broadcast(tensor, destination_devices(dest))
            results.append(copies[0] if len(copies) == 1 else Mirrored(copies))
        return results


class ReductionToOneDevice(CrossDeviceOps):
    """Copies every replica's value to one device, accumulates there, and copies back.

    Args:
        reduce_to_device: Where to accumulate; default the destination's first device.
        accumulation_fn: ``fn(list_of_tensors) -> tensor``; default element-wise sum.
    """

    def __init__(
        self,
        reduce_to_device: str | torch.device | None = None,
        accumulation_fn: Callable[[list[torch.Tensor]], torch.Tensor] | None = None,
    ) -> None:
        self._device = None if reduce_to_device is None else torch.device(reduce_to_device)
        self._accumulate = accumulation_fn or _add_n

    def can_sum_in_place(self, devices: Sequence[torch.device]) -> bool:
        """True for the default element-wise sum, accumulated on the CPU (or on the
        destination, when it is the CPU), with every replica on the CPU: then summing slices
        in place gives the same numbers as `reduce_to`. A custom ``accumulation_fn``, an
        accelerator accumulation device or a subclass with its own `reduce_to` (which this
        answer cannot vouch for) keeps `reduce_to`."""
        return (
            type(self).reduce_to is ReductionToOneDevice.reduce_to
            and self._accumulate is _add_n
            and self._device in (None, torch.device("cpu"))
            and all(d.type == "cpu" for d in devices)
        )

    def reduce_to(
        self, reduce_op: ReduceOp, tensors: Sequence[torch.Tensor], device: torch.device
    ) -> torch.Tensor:
        where = self._device or device
        gathered = [t if t.device == where else t.to(where) for t in tensors]
        total = self._accumulate(gathered)
        if reduce_op is ReduceOp.MEAN:
            total = total / len(tensors)
        return total if total.device == device else total.to(device)


def _cuda_comm() -> Any:
    import torch.cuda.comm

    return torch.cuda.comm


def _require_cuda(devices: Sequence[torch.device], name: str) -> None:
    if not devices or any(d.type != "cuda" for d in devices):
        raise ValueError(
            f"{name} works across CUDA devices only. Received: {[str(d) for d in devices]}. "
            "HINT: use ReductionToOneDevice for CPU replicas."
        )


class _PackedGpuOps(CrossDeviceOps):
    """Base of the GPU reductions that split the packed buffer into ``num_packs`` chunks."""

    def __init__(self, num_packs: int = 1) -> None:
        if num_packs < 1:
            raise ValueError(f"num_packs must be >= 1. Received: {num_packs}.")
        self._num_packs = num_packs


class HierarchicalCopyAllReduce(_PackedGpuOps):
    """Reduces with device-to-device copies in chunks (TF's hierarchical copy for GPUs).

    Args:
        num_packs: Chunks the packed buffer is split into, so copies of one chunk overlap the
            additions of another.
    """

    def reduce_to(
        self, reduce_op: ReduceOp, tensors: Sequence[torch.Tensor], device: torch.device
    ) -> torch.Tensor:
        _require_cuda([t.device for t in tensors], type(self).__name__)
        chunks = [split_packs(t.reshape(-1), self._num_packs) for t in tensors]
        out = []
        for parts in zip(*chunks, strict=True):
            out.append(_cuda_comm().reduce_add(list(parts), destination=device.index))
        total = torch.cat(out).view(tensors[0].shape) if len(out) > 1 else out[0].view(tensors[0].shape)
        return total / len(tensors) if reduce_op is ReduceOp.MEAN else total


class NcclAllReduce(_PackedGpuOps):
    """Reduces across the GPUs of this process with NCCL (`torch.cuda.nccl`).

    Args:
        num_packs: Chunks the packed buffer is split into.

    Raises:
        ValueError: Used with CPU devices, or NCCL is not available in this torch build.
    """

    def reduce_to(
        self, reduce_op: ReduceOp, tensors: Sequence[torch.Tensor], device: torch.device
    ) -> torch.Tensor:
        devices = [t.device for t in tensors]
        _require_cuda(devices, type(self).__name__)
        inputs = [t.contiguous() for t in tensors]
        if not torch.cuda.nccl.is_available(inputs):
            raise ValueError(
                "NcclAllReduce needs NCCL, which this torch build or these tensors do not "
                "support. HINT: use HierarchicalCopyAllReduce or ReductionToOneDevice."
            )
        root = devices.index(device) if device in devices else 0
        output = torch.empty_like(inputs[root])
        for parts_in, part_out in zip(
            zip(*(split_packs(t.reshape(-1), self._num_packs) for t in inputs), strict=True),
            split_packs(output.reshape(-1), self._num_packs),
            strict=True,
        ):
            torch.cuda.nccl.reduce(list(parts_in), output=part_out, root=root)
        if reduce_op is ReduceOp.MEAN:
            output = output / len(tensors)
        return output if output.device == device else output.to(device)


def select_cross_device_ops(devices: Sequence[torch.device]) -> CrossDeviceOps:
    """TF's automatic choice: NCCL across several GPUs when available, else one-device reduction."""
    if len(devices) > 1 and all(d.type == "cuda" for d in devices):
        probe = [torch.empty(1, device=d) for d in devices]
        if torch.cuda.nccl.is_available(probe):
            return NcclAllReduce()
        return HierarchicalCopyAllReduce()
    return ReductionToOneDevice()
