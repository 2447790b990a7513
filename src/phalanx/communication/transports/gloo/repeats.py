"""Repeated all-reduces over gloo as one gloo call each plus a small code message beside it
(`phalanx.communication.transports.gloo.transport`).

An unannounced signed all-reduce larger than a first message is two gloo calls, the second
made only once the first message's codes matched (gloo aborts the process on a size
mismatch): two round trips, one after the other. A loop that all-reduces the same tensor
again and again (``strategy.reduce`` of a metric every step, a user's ``dist.all_reduce``,
the benchmark's section 1) pays that every time.

*Repeats.* Every worker makes the same prediction from the same history: once two signed
collectives in a row on the transport (four from 1 MiB) were all-reduces of the same kind,
dtype and element count needing two calls (#s-1 and #s), collective #s+1 is predicted to be
that all-reduce again. The history is the same on every worker because every collective in it was verified
(the codes carry the number, kind, dtype and size) before the next one was sent: the next
collective waits for the last one's codes first.

A predicted collective that comes as predicted goes as a *code message* (``PIECES`` elements
per worker, each worker's code in its own slots) and the whole tensor, all-reduced in place,
issued back to back: no copy, and no round trip between them. Its result is used only once
the code message verified. A worker whose next collective is anything else *breaks* the
prediction: it sends its own code in the code message and zeros of the predicted size (so
gloo meets equal sizes), then waits for the codes: the same on every worker (every worker
broke: a loop ended) and it goes on as usual; otherwise `CollectiveMismatchError`, on the
worker that kept to the prediction too (its code message shows the other code). After a
break that came after one hit at most, no prediction is made for the next 2, then 4, ...
1024 runs of repeats: a pattern that keeps breaking pays a wasted all-reduce rarely.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.distributed

from phalanx.communication.checks.collective_check import Signed, codes_after
from phalanx.communication.transports.gloo.signed import PIECES, put_code, sign_header

__all__ = ["PIPELINE_BYTES", "Predicted", "Repeats", "code_message", "repeat_messages"]

_MAX_SKIP = 1024
# from this size a predicted all-reduce goes in place beside a code message: copying it into a
# message with the codes would cost more than the second gloo call (measured at 256 KiB, 4 MiB)
PIPELINE_BYTES = 1 << 20
# a break costs a whole all-reduce of zeros and a hit saves one round trip of a small message:
# large all-reduces are predicted only after a longer run of repeats
_LARGE_STREAK = 4


class Predicted(NamedTuple):
    """The all-reduce predicted as the next collective."""

    code: int
    numel: int
    dtype: torch.dtype
    op: Any


def code_message(rank: int, world: int, code: int) -> torch.Tensor:
    """A SUM-reduced message of every worker's code (zeros in the other workers' slots)."""
    message = torch.zeros(PIECES * world, dtype=torch.float32)
    put_code(message, rank, code)
    return message


def repeat_messages(
    flat: torch.Tensor, op: Any, rank: int, world: int, code: int
) -> tuple[torch.Tensor, Any, torch.Tensor | None]:
    """The gloo calls of a predicted all-reduce of ``flat`` with ``op``: the message whose
    last ``PIECES * world`` elements carry every worker's code, its op, and the tensor
    all-reduced in place beside it (None: ``flat`` is staged in the message, before the codes)."""
    numel = flat.numel()
    if numel * flat.element_size() >= PIPELINE_BYTES:
        return code_message(rank, world, code), torch.distributed.ReduceOp.SUM, flat
    staged = torch.empty(numel + PIECES * world, dtype=flat.dtype)
    staged[:numel].copy_(flat)
    sign_header(staged[numel:], rank, code, op)
    return staged, op, None


class Repeats:
    """The prediction state of one gloo transport; every worker changes it alike (see the
    module doc). Not thread-safe: the transport holds its lock."""

    def __init__(self) -> None:
        self._last: tuple[int, tuple[Any, ...]] | None = None  # (#, key) of the last collective
        self.predicted: Predicted | None = None
        self._streak, self._skip, self._backoff, self._since = 0, 0, 1, 0

    def take(self) -> Predicted | None:
        """The prediction for the collective issued now (it is used up)."""
        predicted, self.predicted = self.predicted, None
        return predicted

    def all_reduce(self, signed: Signed, flat: torch.Tensor, op: Any) -> None:
        """A signed all-reduce of two gloo calls is issued (or its prediction came true)."""
        signature = signed.signature
        if signature is None:
            self._last = None
            return
        key = (signature.kind, flat.dtype, flat.numel(), op)
        self._streak = self._streak + 1 if self._last == (signed.seq - 1, key) else 1
        self._last = (signed.seq, key)
        large = flat.numel() * flat.element_size() >= PIPELINE_BYTES
        if self._streak < (_LARGE_STREAK if large else 2):
            return
        if self._skip:
            self._skip -= 1
            return
        code = codes_after(signed.seq, signature.kind, [(flat.numel(), flat.dtype)])[0]
        self.predicted = Predicted(code, flat.numel(), flat.dtype, op)
        self._since += 1

    def other(self) -> None:
        """Any other collective is issued (it ends a run of repeats)."""
        self._last = None

    def broke(self) -> None:
        """Every worker broke the prediction: predict none for a while, longer each time
        breaks come soon after each other."""
        if self._since < 3:  # it came true once at most since the last break: not worth it
            self._backoff = min(2 * self._backoff, _MAX_SKIP)
            self._skip = self._backoff
        else:
            self._backoff, self._skip = 1, 0
        self._since, self._last = 0, None

    def clear(self) -> None:
        """Forgets the history (the codes were switched, or the transport closed)."""
        self._last, self.predicted = None, None
