"""One gradient bucket of `phalanx.communication.bucketing.GradientBuckets`: a flat buffer
holding its parameters' gradients back to back, then two flags per parameter."""

from __future__ import annotations

from typing import Any

import torch

from phalanx.communication._sparse import SPARSE

__all__ = ["Bucket"]


class Bucket:
    """A flat buffer: the gradients of ``params`` back to back, then two flags per parameter.

    A parameter that died since it was tracked is a "meta" placeholder of its shape: it
    keeps its slot (zeros), so the layout stays the same on every worker whatever the
    garbage collector of each did, until the "dead" flags say it died on every worker.
    ``slots``: each parameter's index in the registration order.
    """

    def __init__(
        self, params: list[torch.Tensor], slots: list[int], dtype: torch.dtype, device: torch.device
    ) -> None:
        self.params, self.slots = params, slots
        self.offsets: list[int] = []
        numel = 0
        for p in params:
            self.offsets.append(numel)
            numel += p.numel()
        self.numel = numel
        n = len(params)
        self.buffer = torch.zeros(numel + 2 * n, dtype=dtype, device=device)
        self.flags = self.buffer[numel : numel + n]  # after the sum: how many workers had a gradient
        self.dead = self.buffer[numel + n :]  # after the sum: on how many workers it died
        self.dead_here = torch.tensor([float(p.device.type == "meta") for p in params], dtype=dtype)
        self.had = [0.0] * len(params)  # this worker's flags for the current round
        self.ready = [False] * len(params)
        self.work: Any = None  # the running all-reduce of the current round

    def view(self, i: int) -> torch.Tensor:
        p = self.params[i]
        return self.buffer[self.offsets[i] : self.offsets[i] + p.numel()].view(p.shape)

    def put(self, i: int, grad: torch.Tensor | None) -> None:
        view = self.view(i)
        if grad is None:
            view.zero_()
        elif view.data_ptr() != grad.data_ptr():
            view.copy_(grad)
        self.had[i] = 0.0 if grad is None else 1.0
        self.ready[i] = True

    def put_sparse(self, i: int) -> None:
        """A sparse delta: zeros here, and a flag that tells every worker it is sparse."""
        self.view(i).zero_()
        self.had[i] = SPARSE
        self.ready[i] = True

    def complete(self) -> bool:
        return all(self.ready)
