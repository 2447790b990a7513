"""A transport that moves every collective's bytes through the job's rendezvous store: the
whole of what a new transport needs (one module with an opener, and one `register` line in the
program, `transport_training.py`). Each worker writes its tensor under the collective's number
and reads every peer's; all-reduce sums in rank order, so every worker ends with the same bits.
It checks the peers' signature codes as the real transports do."""

from __future__ import annotations

import io
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from phalanx.communication.checks.collective_check import Signed
from phalanx.communication.group.work import Lane
from phalanx.communication.transports.base import CollectivesDifferError, OpenRequest

_OPS = {dist.ReduceOp.SUM: torch.add, dist.ReduceOp.MAX: torch.maximum, dist.ReduceOp.MIN: torch.minimum}
calls: dict[str, int] = {}  # collective kind -> how many this worker made (the test reads it)


class StoreTransport:
    name = "store"
    closes_before_leaving = True

    def __init__(self, request: OpenRequest) -> None:
        self._store = dist.PrefixStore("store-transport/", request.store)
        self._rank, self._world = request.rank, request.world_size
        self._store.set_timeout(timedelta(seconds=request.collective_timeout))
        self._lane = Lane("store-transport")
        self._count = 0

    def _exchange(self, kind: str, tensor: torch.Tensor, signed: Signed) -> list[torch.Tensor]:
        calls[kind] = calls.get(kind, 0) + 1
        self._count += 1
        buffer = io.BytesIO()
        torch.save((signed.code, tensor.detach().clone()), buffer)
        self._store.set(f"{self._count}/{self._rank}", buffer.getvalue())
        found = []
        for peer in range(self._world):
            code, value = torch.load(io.BytesIO(self._store.get(f"{self._count}/{peer}")), weights_only=True)
            if code != signed.code:
                what = f"#{self._count} ({kind})"
                raise CollectivesDifferError(f"worker {peer} made another collective than {what}")
            found.append(value)
        return found

    def all_reduce_async(self, tensor: torch.Tensor, op: Any, signed: Signed) -> Any:
        def run() -> None:
            parts = self._exchange("all_reduce", tensor, signed)
            total = parts[0].clone()
            for part in parts[1:]:
                total = _OPS[op](total, part)
            tensor.copy_(total)

        return self._lane.submit("store all_reduce", run)

    def broadcast_async(self, tensor: torch.Tensor, src: int, signed: Signed) -> Any:
        return self._lane.submit(
            "store broadcast", lambda: tensor.copy_(self._exchange("broadcast", tensor, signed)[src])
        )

    def all_gather_async(self, tensor: torch.Tensor, signed: Signed) -> tuple[Any, list[torch.Tensor]]:
        out = [torch.empty_like(tensor) for _ in range(self._world)]

        def run() -> None:
            for target, part in zip(out, self._exchange("all_gather", tensor, signed), strict=True):
                target.copy_(part)

        return self._lane.submit("store all_gather", run), out

    def can_reduce_scatter(self, tensor: torch.Tensor, output: torch.Tensor, op: Any) -> bool:
        return False

    def reduce_scatter_async(self, tensor: torch.Tensor, output: torch.Tensor, op: Any, signed: Any) -> Any:
        raise NotImplementedError

    def can_all_gather_into(self, tensor: torch.Tensor, output: torch.Tensor) -> bool:
        return False

    def all_gather_into_async(self, tensor: torch.Tensor, output: torch.Tensor, signed: Signed) -> Any:
        raise NotImplementedError

    def close(self) -> None:
        self._lane.close()

    def release(self) -> None:
        pass


def open_store_transport(request: OpenRequest) -> StoreTransport | None:
    return StoreTransport(request) if request.world_size > 1 else None
