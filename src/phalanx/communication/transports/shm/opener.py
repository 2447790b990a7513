"""The shared-memory transport behind the group seam (`phalanx.communication.transports.base`):
opened when every worker of a group runs on this machine and allows it."""

from __future__ import annotations

import secrets
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from phalanx import settings
from phalanx.communication.checks.collective_check import Signed
from phalanx.communication.transports.base import OpenRequest
from phalanx.communication.transports.shm.shared_memory import SharedMemoryAllReduce

__all__ = ["SharedMemoryTransport", "open_shared_memory"]


class SharedMemoryTransport:
    """`SharedMemoryAllReduce` and the gloo group its thread agrees on segments with."""

    name = "shm"
    closes_before_leaving = True  # its thread stops before the group's goodbye on the store

    def __init__(self, engine: SharedMemoryAllReduce, group: Any, world_size: int) -> None:
        self.engine, self._group, self._world = engine, group, world_size

    def all_reduce_async(self, tensor: torch.Tensor, op: Any, signed: Signed) -> Any:
        return self.engine.all_reduce_async(tensor, op, signed)

    def all_reduce_may_block_async(self, tensor: torch.Tensor, op: Any, signed: Signed) -> Any:
        return self.engine.all_reduce_async(tensor, op, signed, may_block=True)

    def broadcast_async(self, tensor: torch.Tensor, src: int, signed: Signed) -> Any:
        return self.engine.broadcast_async(tensor, src, signed)

    def all_gather_async(self, tensor: torch.Tensor, signed: Signed) -> tuple[Any, list[torch.Tensor]]:
        return self.engine.all_gather_async(tensor, signed)

    def can_reduce_scatter(self, tensor: torch.Tensor, output: torch.Tensor, op: Any) -> bool:
        return (
            self.engine.handles(tensor, op)
            and output.is_contiguous()
            and output.dtype == tensor.dtype
            and tensor.numel() == self._world * output.numel()
        )

    def reduce_scatter_async(
        self, tensor: torch.Tensor, output: torch.Tensor, op: Any, signed: Signed
    ) -> Any:
        return self.engine.reduce_scatter_async(tensor, output, op, signed)

    def can_all_gather_into(self, tensor: torch.Tensor, output: torch.Tensor) -> bool:
        return (
            output.is_contiguous()
            and output.dtype == tensor.dtype
            and output.numel() == self._world * tensor.numel()
        )

    def all_gather_into_async(self, tensor: torch.Tensor, output: torch.Tensor, signed: Signed) -> Any:
        rows = list(output.view(self._world, -1))  # (world, numel): one row per worker
        work, _ = self.engine.all_gather_async(tensor.contiguous().view(-1), signed, out=rows)
        return work

    def close(self) -> None:
        self.engine.close()

    def release(self) -> None:
        self._group = None  # a gloo backend of its own: dropping it joins its threads


def open_shared_memory(request: OpenRequest) -> SharedMemoryTransport | None:
    """The transport when every worker is on this machine and allows shared memory, and the job
    did not ask for the TLS ring (``PHALANX_COLLECTIVES=tls``); else None (all workers)."""
    if not request.same_machine or not request.shared_memory_allowed or request.world_size < 2:
        return None  # (an elastic job's group may have one worker)
    if settings.current().collectives == "tls":
        return None
    assert request.pids is not None
    # its own gloo group: the transport's thread agrees on segments without interleaving with
    # the collectives of the training thread (made before the job's process group, on the
    # store: a gloo backend of its own, in no torch.distributed registry)
    group = dist.ProcessGroupGloo(
        dist.PrefixStore("phalanx-shm/", request.store),
        request.rank,
        request.world_size,
        timedelta(seconds=request.collective_timeout),
    )
    engine = SharedMemoryAllReduce(
        f"{request.chief[1]}-{request.pids[0]}-{_group_nonce(request.store, request.rank)}",
        request.rank,
        request.world_size,
        request.pids,
        group,
        request.failure,
        request.task_name,
        request.collective_timeout,
        request.keep,
        request.mismatch,
    )
    return SharedMemoryTransport(engine, group, request.world_size)


def _group_nonce(store: Any, rank: int) -> str:
    """A random name of this group, the same on its workers (rank 0 draws it). An elastic job's
    groups share the store's port and often the chief: without it, a worker taken for lost that
    removes its files late could remove a segment of the next group while its members open it."""
    if rank == 0:
        store.set("shm-nonce", secrets.token_hex(4))
    return bytes(store.get("shm-nonce")).decode()
