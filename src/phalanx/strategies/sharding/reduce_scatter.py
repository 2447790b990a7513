"""FSDP2's gradient reduce-scatter on CPUs, without the input buffer FSDP2 keeps for its streams.

FSDP2 copies a unit's gradients into one reduce-scatter input (the whole unit's size),
reduce-scatters it, and keeps a reference to that input until the next unit's reduce-scatter
(``reduce_scatter_states`` in ``torch.distributed.fsdp._fully_shard``): on a GPU the collective
runs on another stream, and its input must outlive it. On the CPU the collective has finished
when FSDP2's call returns (it calls it without ``async_op``), so that input is dead weight: a
whole unit held through the next unit's backward, at the peak of a worker's memory (1 of the
4 unit-sized buffers that peak holds otherwise). `FreeingReduceScatter`, installed on each
unit with FSDP2's public ``set_custom_reduce_scatter`` by FullyShardedStrategy (with
``release_memory``, on CPUs), releases the input's memory as soon as the collective returns.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["FreeingReduceScatter"]


class FreeingReduceScatter:
    """FSDP2's ``ReduceScatter`` comm (its ``allocate`` and ``__call__``): torch's own
    reduce-scatter, then the input's storage is released (CPU tensors, synchronous calls only:
    an asynchronous one, or a GPU's, may still be reading it).

    FSDP2 calls `allocate` for the input and the output, then `__call__` once per unit per
    backward, on every worker of the unit's mesh, in the same order.
    """

    def allocate(
        self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """A new buffer, as FSDP2's default comm makes it."""
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: Any,
        async_op: bool = False,
    ) -> Any:
        """Reduce-scatters ``input_tensor`` into ``output_tensor`` over ``group`` (all its
        workers); when the call waited on a CPU tensor, frees the input's memory (FSDP2 keeps
        only a reference to it from here, see the module doc)."""
        work = dist.reduce_scatter_single(output_tensor, input_tensor, op=op, group=group, async_op=async_op)
        if not async_op and input_tensor.device.type == "cpu":
            input_tensor.untyped_storage().resize_(0)
        return work
