"""Gradient compression of the MultiWorkerMirrored engine's bucket all-reduces: the seam.

A `Compressor` is the per-engine, stateful side of what a user asks for with
``CommunicationOptions(compression=...)`` (``"fp16"``, ``"bf16"``, `PowerSGD`); `make_compressor`
turns the one into the other. The gradient buckets (`phalanx.communication.engine.bucketing`) hand
each bucket to `CompressedAllReduce.start` when it is complete and call ``finish`` on what it
returned when the round ends: the bucket's tensor then holds the (approximate) sum over workers,
as an uncompressed all-reduce would have left it.

What is never compressed, whatever was asked: the engine's bucket that carries its flags
(counts that must stay exact: the flags alone, or with the few gradients of a small last
bucket), buckets of a dtype the compressor does not narrow (`Compressor.applies`), and sparse
gradients (they never enter a bucket; `phalanx.communication.local.sparse`). Those go as they are.

Every compressed collective is an ordinary all-reduce on the group's transport (shared memory,
the TLS ring, gloo, NCCL), so the collective signature check signs its own dtype and shape.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Hashable, Sequence
from typing import Any, Protocol

import torch

__all__ = [
    "CompressedAllReduce",
    "Compressor",
    "Launch",
    "PlainAllReduce",
    "Started",
    "Wait",
    "checkpoint_restored",
    "nbytes",
]

Launch = Callable[[torch.Tensor], Any]  # starts an async in-place SUM all-reduce, returns its work
Wait = Callable[[Any, str], None]  # waits for that work (raises on failure)
WHAT = "the gradient all-reduce"


def nbytes(tensor: torch.Tensor) -> int:
    """The bytes of ``tensor``'s elements (what one worker hands the all-reduce)."""
    return tensor.numel() * tensor.element_size()


class Started(Protocol):
    """One bucket's all-reduce(s) in flight."""

    def finish(self, wait: Wait) -> None:
        """Waits (issuing any later all-reduce it needs) and leaves the sum in the bucket's
        tensor (all workers, buckets in the same order)."""


class Compressor(Protocol):
    """Compresses bucket all-reduces; holds whatever state that needs (error feedback).

    One per gradient engine: an elastic re-form makes a new engine, so a new compressor.

    Attributes:
        predictable: Each bucket goes as one all-reduce at its ``start``, of the bucket's size
            in `wire_dtype`: the engine can announce a pass's all-reduces before the first
            (the gloo transport then checks them all with one message). False: a pass's
            all-reduces are not known ahead; each is checked on its own.
    """

    predictable: bool

    def wire_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype a compressed bucket of ``dtype`` goes in (`predictable` compressors)."""

    def applies(self, dtype: torch.dtype) -> bool:
        """Whether buckets of ``dtype`` are compressed (else they go as they are)."""

    def begin_round(self) -> None:
        """A backward pass starts (all workers alike): counts iterations."""

    def start(
        self, key: Hashable, flat: torch.Tensor, views: Sequence[torch.Tensor], launch: Launch
    ) -> Started:
        """Starts the compressed sum of one bucket (all workers, same order).

        Args:
            key: The bucket's identity across rounds (its error feedback and warm start).
            flat: The bucket's tensor, one dimension: its sum goes here.
            views: Each parameter's gradient as a view of ``flat`` in its own shape.
            launch: Starts an async in-place SUM all-reduce (counted).
        """

    def reset(self) -> None:
        """Forgets error feedback and warm starts (a checkpoint restore, rebuilt buckets)."""


class PlainAllReduce:
    """An uncompressed all-reduce in flight."""

    def __init__(self, work: Any) -> None:
        self._work = work

    def finish(self, wait: Wait) -> None:
        wait(self._work, WHAT)


class CompressedAllReduce:
    """The engine's side: runs each bucket through the compressor (or not) and counts bytes.

    Args:
        launch: Starts an async in-place SUM all-reduce on the group (all workers).
        compressor: None: every bucket goes as it is.

    Attributes:
        bytes_sent: Bytes this worker handed to all-reduces (compressed payloads, flags).
        bytes_uncompressed: What the same rounds hand over without compression.
    """

    def __init__(self, launch: Launch, compressor: Compressor | None = None) -> None:
        self._launch, self.compressor = launch, compressor
        self.bytes_sent = 0
        self.bytes_uncompressed = 0
        if compressor is not None:
            _LIVE.add(self)

    def _counted(self, tensor: torch.Tensor) -> Any:
        self.bytes_sent += nbytes(tensor)
        return self._launch(tensor)

    def begin_round(self) -> None:
        """A backward pass starts (all workers)."""
        if self.compressor is not None:
            self.compressor.begin_round()

    def start(
        self, key: Hashable, flat: torch.Tensor, views: Sequence[torch.Tensor], compressible: bool
    ) -> Started:
        """Starts one bucket's sum (all workers, same order); ``compressible`` is False for the
        bucket that carries the flags. Pass what it returns to ``finish``."""
        self.bytes_uncompressed += nbytes(flat)
        if self.compressor is None or not compressible or not self.compressor.applies(flat.dtype):
            return PlainAllReduce(self._counted(flat))
        return self.compressor.start(key, flat, views, self._counted)

    def plan(self, buckets: Sequence[tuple[int, torch.dtype, bool]]) -> list[tuple[int, torch.dtype]]:
        """The all-reduces (element count, dtype) of a pass whose buckets are ``buckets``
        ((size, dtype, compressible) in launch order), for the engine's announcement; only
        without a compressor or with a `Compressor.predictable` one."""
        compressor = self.compressor
        if compressor is None:
            return [(n, d) for n, d, _ in buckets]
        assert compressor.predictable, "only a predictable compressor's passes are announced"
        return [
            (n, compressor.wire_dtype(d) if can and compressor.applies(d) else d) for n, d, can in buckets
        ]

    def reset(self) -> None:
        """Forgets the compressor's state (error feedback, warm starts)."""
        if self.compressor is not None:
            self.compressor.reset()


_LIVE: weakref.WeakSet[CompressedAllReduce] = weakref.WeakSet()  # this process's engines that compress


def checkpoint_restored() -> None:
    """Resets the compression state of every gradient engine of this process (a checkpoint
    was restored; every worker restores it, so every worker resets at the same point).

    Error feedback and warm starts were accumulated against the weights before the restore and
    describe that trajectory, not the restored one; they are never saved (they differ on every
    worker, and a checkpoint holds what the workers agree on). Called by
    `phalanx.checkpoint.Checkpoint.read`, in scope or not.
    """
    for engine in list(_LIVE):
        engine.reset()
