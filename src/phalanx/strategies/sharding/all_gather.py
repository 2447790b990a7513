"""FSDP2's parameter all-gather on CPUs, without the gathered buffer FSDP2 keeps in forward.

In forward FSDP2 keeps each unit's all-gather output (the whole unit's size) until the next
unit's parameters are copied out of theirs (``all_gather_state`` in
``torch.distributed.fsdp._fully_shard``): on a GPU the next all-gather runs on another stream
and overlaps that copy. On the CPU nothing overlaps (the all-gathers wait where they are
called), so a worker held three units at the forward's peak: the previous unit's buffer, and
the current unit's buffer and parameters. `FreeingAllGather`, installed on each unit with
FSDP2's public ``set_custom_all_gather`` by FullyShardedStrategy (with ``release_memory``, on
CPUs), releases a unit's buffer as soon as the unit's forward starts: by then FSDP2 has copied
the parameters out of it (its own forward pre-hook waits for that copy and runs first).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["FreeingAllGather"]


class FreeingAllGather:
    """FSDP2's ``AllGather`` comm (its ``allocate`` and ``__call__``) for one unit, whose
    `release` (the unit's forward pre-hook) frees the last buffer it allocated.

    It holds that buffer weakly: in backward FSDP2 drops the buffer right after the copy, and
    nothing here keeps it longer.
    """

    def __init__(self) -> None:
        self._last: weakref.ref[torch.Tensor] | None = None

    def allocate(
        self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """A new buffer, as FSDP2's default comm makes it (remembered on the CPU)."""
        buffer = torch.empty(size, dtype=dtype, device=device)
        self._last = weakref.ref(buffer) if buffer.device.type == "cpu" else None
        return buffer

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> Any:
        """Gathers every worker's ``input_tensor`` into ``output_tensor`` over ``group``."""
        return dist.all_gather_single(output_tensor, input_tensor, group=group, async_op=async_op)

    def release(self, module: nn.Module, args: Any) -> None:
        """The unit's forward pre-hook (after FSDP2's, which copied the parameters out): frees
        the memory of the unit's last all-gather buffer."""
        last = self._last() if self._last is not None else None
        self._last = None
        if last is not None:
            last.untyped_storage().resize_(0)
