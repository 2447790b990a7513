"""Gloo collectives that verify their partner first (`phalanx.communication.checks.collective_check`).

gloo compares nothing but sizes, and a size mismatch aborts the process from gloo's own
thread ("Received data size doesn't match expected size"), so no collective may reach gloo
before its partner is known. Every signed collective therefore starts with the same *first
message*: an all-reduce of exactly ``first_bytes(W)`` bytes (4 KiB + 80 bytes per worker),
whatever the collective, dtype or size. Its last ``5 W`` elements are the header: worker r
writes its 31-bit code as five 7-bit pieces in its own five slots and the op's neutral value
(0 for SUM/MAX/BOR/BXOR, 1 for PRODUCT, 127 for MIN/BAND) in the others', so after the
reduction slot r holds worker r's code exactly in every dtype (bfloat16 holds integers up to
256). Every worker compares every code with its own before anything else happens:

* an all-reduce of at most the first message's payload capacity (1,024 float32) is carried
  whole in it: one gloo call, as before, plus a copy of at most 4 KiB each way;
* a larger all-reduce carries its first part in it and the rest in a second all-reduce, made
  only once the codes agree (so the sizes agree);
* a broadcast or all-gather sends a header-only first message (float32), then the collective.

A first message between workers that called different collectives still has the same size
on both (no abort) and shows the difference in its header: `CollectiveCheck.mismatch` names
both sides. The extra cost is one 4 KiB all-reduce for broadcasts, all-gathers and
all-reduces over 4 KiB, except the gradient all-reduces, which one first message announces
per backward pass, and repeated all-reduces, whose codes travel with them once every worker
predicted them (`phalanx.communication.transports.gloo.repeats`; docs/multi_worker.md, "Mismatched
collectives").

This module holds the message format and blocking versions of the three collectives (the
shared-memory transport's gloo fallbacks); `phalanx.communication.transports.gloo.transport` issues the
same messages without blocking, from the caller's thread.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from phalanx.communication.checks.collective_check import Signed

__all__ = [
    "PIECES",
    "code_pieces",
    "codes_from",
    "codes_in",
    "first_bytes",
    "first_message",
    "put_code",
    "sign_header",
    "signed_all_gather",
    "signed_all_reduce",
    "signed_broadcast",
    "verify_header",
]

PIECES = 5  # 7-bit pieces of a 31-bit code
_BASE_BYTES = 4096
_NEUTRAL = {
    dist.ReduceOp.SUM: 0,
    dist.ReduceOp.MAX: 0,
    dist.ReduceOp.BOR: 0,
    dist.ReduceOp.BXOR: 0,
    dist.ReduceOp.PRODUCT: 1,
    dist.ReduceOp.MIN: 127,
    dist.ReduceOp.BAND: 127,
}
Mismatch = Callable[[Signed, "int | None"], BaseException]


def first_bytes(world: int) -> int:
    """Bytes of every signed collective's first message (a multiple of every element size)."""
    return _BASE_BYTES + 16 * PIECES * world


def code_pieces(code: int) -> list[int]:
    """``code`` as the ``PIECES`` 7-bit values a header carries for one worker."""
    return [(code >> (7 * i)) & 0x7F for i in range(PIECES)]


def codes_from(values: list[float], world: int) -> list[int | None]:
    """Every worker's code from a reduced header's values (None: not a code, it was garbled)."""
    rounded = [round(v) for v in values]
    codes: list[int | None] = []
    for r in range(world):
        pieces = rounded[r * PIECES : (r + 1) * PIECES]
        if any(not 0 <= p <= 0x7F for p in pieces):
            codes.append(None)
        else:
            codes.append(sum(p << (7 * i) for i, p in enumerate(pieces)))
    return codes


def _codes(header: torch.Tensor, world: int) -> list[int | None]:
    return codes_from(header.tolist(), world)  # a few elements: Python, not torch ops


def put_code(header: torch.Tensor, rank: int, code: int) -> None:
    """Writes ``code`` into worker ``rank``'s slots of a SUM-reduced header (``PIECES`` per
    worker; the others' slots must hold 0)."""
    header.view(-1, PIECES)[rank] = torch.tensor(code_pieces(code), dtype=header.dtype)


def codes_in(header: torch.Tensor, world: int) -> list[int | None]:
    """Every worker's code from a reduced header (`put_code`; None: garbled)."""
    return _codes(header, world)


def _reduce_op(op: Any) -> Any:
    return getattr(op, "op", op)


def first_message(rank: int, world: int, signed: Signed, dtype: torch.dtype, op: Any) -> torch.Tensor:
    """An empty first message of ``dtype``, its header filled (the caller fills the payload;
    ``op``: the reduction, whose neutral value fills the other workers' header slots)."""
    total = first_bytes(world) // torch.empty((), dtype=dtype).element_size()
    message = torch.zeros(total, dtype=dtype)
    sign_header(message[total - PIECES * world :], rank, signed.code, op)
    return message


def sign_header(header: torch.Tensor, rank: int, code: int, op: Any) -> None:
    """Fills a header (``PIECES`` elements per worker) to be reduced with ``op``: ``code`` in
    worker ``rank``'s slots, the op's neutral value in the others'."""
    header.fill_(_NEUTRAL[op])
    put_code(header, rank, code)


def verify_header(message: torch.Tensor, world: int, signed: Signed, mismatch: Mismatch) -> None:
    """Raises the mismatch report if any worker's code differs from this one's."""
    codes = _codes(message[message.numel() - PIECES * world :], world)
    for peer, code in enumerate(codes):
        if code != signed.code:
            raise mismatch(signed, peer if code is not None else None)


def _all_reduce_once(group: Any, tensor: torch.Tensor, op: Any) -> None:
    options = dist.AllreduceOptions()
    options.reduceOp = op
    group.allreduce([tensor], options).wait()


def signed_all_reduce(
    group: Any, rank: int, world: int, tensor: torch.Tensor, op: Any, signed: Signed, mismatch: Mismatch
) -> None:
    """In-place all-reduce of a contiguous CPU tensor, verified first (all workers; blocks).

    Raises:
        CollectiveMismatchError: (from ``mismatch``) another worker's collective differs.
    """
    op = _reduce_op(op)
    flat = tensor.view(-1)
    if flat.dtype == torch.bool:  # gloo's bool reductions are logical: MAX is OR, MIN is AND
        staged = flat.to(torch.uint8)
        either = op in (dist.ReduceOp.SUM, dist.ReduceOp.MAX, dist.ReduceOp.BOR)
        signed_all_reduce(
            group, rank, world, staged, dist.ReduceOp.MAX if either else dist.ReduceOp.MIN, signed, mismatch
        )
        flat.copy_(staged.bool())
        return
    message = first_message(rank, world, signed, flat.dtype, op)
    capacity = message.numel() - PIECES * world
    head = min(flat.numel(), capacity)
    message[:head].copy_(flat[:head])
    _all_reduce_once(group, message, op)
    verify_header(message, world, signed, mismatch)
    flat[:head].copy_(message[:head])
    if flat.numel() > capacity:
        _all_reduce_once(group, flat[capacity:], op)


def _header_only(group: Any, rank: int, world: int, signed: Signed, mismatch: Mismatch) -> None:
    message = first_message(rank, world, signed, torch.float32, dist.ReduceOp.SUM)
    _all_reduce_once(group, message, dist.ReduceOp.SUM)
    verify_header(message, world, signed, mismatch)


def signed_broadcast(
    group: Any, rank: int, world: int, tensor: torch.Tensor, src: int, signed: Signed, mismatch: Mismatch
) -> None:
    """In-place broadcast from ``src``, verified first (all workers; blocks)."""
    _header_only(group, rank, world, signed, mismatch)
    options = dist.BroadcastOptions()
    options.rootRank = src
    group.broadcast([tensor], options).wait()


def signed_all_gather(
    group: Any,
    rank: int,
    world: int,
    tensor: torch.Tensor,
    out: list[torch.Tensor],
    signed: Signed,
    mismatch: Mismatch,
) -> None:
    """Gathers every worker's tensor into ``out`` (rank order), verified first (all workers; blocks)."""
    _header_only(group, rank, world, signed, mismatch)
    group.allgather([out], [tensor]).wait()
