"""One gradient bucket of `phalanx.communication.engine.bucketing.GradientBuckets`.

A *packed* bucket holds its parameters' gradients back to back in one flat buffer (the
last bucket of the launch order also carries every bucket's flags after them). A *solo*
bucket holds one large parameter whose gradient is all-reduced where autograd put it: no
copy into a buffer and none out of it (DDP's reducer always copies into its bucket).
"""

from __future__ import annotations

from typing import Any

import torch

from phalanx.communication.local.sparse import SPARSE

__all__ = ["Bucket"]


class Bucket:
    """The gradients of ``params`` as one all-reduce.

    A parameter that died since it was tracked is a "meta" placeholder of its shape: it
    keeps its slot (zeros), so the layout stays the same on every worker whatever the
    garbage collector of each did, until the "dead" flags say it died on every worker.

    Args:
        params: The parameters (a solo bucket: exactly one).
        slots: Each parameter's index in the registration order.
        dtype, device: Of every parameter.
        solo: All-reduce the one parameter's gradient in place (no buffer).
        flags: How many flag elements follow the gradients (packed buckets only).
        tail: How many elements after the flags the transport may use (the announced
            all-reduces' break mark, `phalanx.communication.transports.gloo.transport`).
    """

    def __init__(
        self,
        params: list[torch.Tensor],
        slots: list[int],
        dtype: torch.dtype,
        device: torch.device,
        solo: bool = False,
        flags: int = 0,
        tail: int = 0,
    ) -> None:
        self.params, self.slots = params, slots
        self.dtype, self.device, self.solo = dtype, device, solo
        self.offsets: list[int] = []
        numel = 0
        for p in params:
            self.offsets.append(numel)
            numel += p.numel()
        self.numel = numel
        # packed: the gradients, then ``flags`` elements; solo: zeros of the parameter, made
        # only when its gradient cannot be reduced in place (none here, strided, sparse)
        self.buffer: torch.Tensor | None = None
        if not solo:
            self.buffer = torch.zeros(numel + flags + tail, dtype=dtype, device=device)
        self.flags = None if self.buffer is None else self.buffer[numel : numel + flags]
        self.size = numel + flags + tail  # the elements each round all-reduces
        self.tensor: torch.Tensor | None = self.buffer  # what this round all-reduces
        self._views: list[torch.Tensor] | None = None  # a packed bucket's, of its buffer
        self.dead_here = [float(p.device.type == "meta") for p in params]
        self.had = [0.0] * len(params)  # this worker's flags for the current round
        self.summed_had = [0.0] * len(params)  # after the sum: how many workers had a gradient
        self.summed_dead = [0.0] * len(params)  # after the sum: on how many workers it died
        self.ready = [False] * len(params)
        # launched in order this round: some worker is predicted to write to it, or it
        # carries the flags (`GradientBuckets._expect`); one that is not goes at the round's
        # end if a flag says so
        self.expected = True
        self.history = 0  # whether some worker wrote to it in each of the last four rounds (bit 0: the last)
        self.work: Any = None  # the running all-reduce of the current round

    def owns(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` shares this bucket's buffer (a view of it)."""
        if self.buffer is None or tensor.layout != torch.strided:  # a sparse gradient has its own memory
            return False
        return tensor.untyped_storage().data_ptr() == self.buffer.untyped_storage().data_ptr()

    def view(self, i: int) -> torch.Tensor:
        """Parameter ``i``'s gradient in what the bucket all-reduces (its sum after the wait):
        for a packed bucket the same view of its buffer every round (made once)."""
        assert self.tensor is not None
        if self.solo:
            return self.tensor.view(self.params[i].shape)
        if self._views is None:
            pairs = zip(self.offsets, self.params, strict=True)
            self._views = [self.tensor[at : at + p.numel()].view(p.shape) for at, p in pairs]
        return self._views[i]

    def put(self, i: int, grad: torch.Tensor | None) -> None:
        """Parameter ``i``'s delta this round (None: this worker has none; zeros go)."""
        if self.solo and grad is not None and self._in_place(grad):
            self.tensor = grad
        else:
            if self.solo:
                self._own_zeros()
            view = self.view(i)
            if grad is None:
                view.zero_()
            elif view.data_ptr() != grad.data_ptr():
                view.copy_(grad)
        self.had[i] = 0.0 if grad is None else 1.0
        self.ready[i] = True

    def put_sparse(self, i: int) -> None:
        """A sparse delta: zeros here, and a flag that tells every worker it is sparse."""
        if self.solo:
            self._own_zeros()
        self.view(i).zero_()
        self.had[i] = SPARSE
        self.ready[i] = True

    def _in_place(self, grad: torch.Tensor) -> bool:
        return (
            grad.layout == torch.strided
            and not grad.requires_grad  # create_graph=True: a graph's tensor, not written in place
            and grad.is_contiguous()
            and grad.dtype == self.dtype
            and grad.device == self.device
        )

    def _own_zeros(self) -> None:
        if self.buffer is None:
            self.buffer = torch.zeros(self.numel, dtype=self.dtype, device=self.device)
        self.tensor = self.buffer

    def complete(self) -> bool:
        return all(self.ready)
