"""What `phalanx.communication.transports.gloo.transport` records of announced all-reduces: the all-reduces
of one backward pass announced together, the end-of-data flag the last of them carries, and
the code a pass offers for the next (see that module's doc, "Announced all-reduces")."""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import torch

from phalanx.communication.checks.collective_check import Signed
from phalanx.communication.transports.gloo.signed import PIECES
from phalanx.communication.transports.gloo.works import Header

__all__ = ["KIND", "Announced", "DataFlag", "Spec", "announced_tail", "pass_code"]

Spec = tuple[int, torch.dtype, int]  # an announced all-reduce: element count, dtype, code
KIND = "all_reduce(SUM)"  # what the announced all-reduces are signed as (`GroupCollectives`)


def announced_tail(world: int) -> int:
    """Elements the last announced all-reduce of a pass reserves at its end: each worker's
    code for the next pass (`PIECES` each), the end-of-data flag and that it was carried,
    and the break mark (see the module doc)."""
    return PIECES * world + 3


class DataFlag:
    """One worker's end-of-data flag for the next step, carried by the last gradient
    all-reduce (`GlooTransport.carry`). ``agreed``: whether any worker has data, once every
    worker's flag was carried in the same all-reduce; None until then (or if not)."""

    def __init__(self, has_data: bool) -> None:
        self.has_data = has_data
        self.agreed: bool | None = None


class Announced:
    """The all-reduces announced for one backward pass (`GlooTransport.announce`), or by the
    pass before it (``pre``)."""

    def __init__(self, header: Header, specs: Sequence[Spec], tail: int = 1, pre: bool = False) -> None:
        self.header = header
        self.specs = list(specs)
        self.left = list(specs)  # not launched yet, in order
        self.total = len(specs)
        self.launched: list[Signed] = []
        self.tail, self.pre = tail, pre
        self.flag: DataFlag | None = None  # carried by the last
        self.offered = 0  # this worker's code for the next pass (0: none)
        self.next_codes: list[int] = []  # the next pass's all-reduces' codes, when offered


def pass_code(codes: list[int]) -> int:
    """The code a worker offers for the next pass: of its all-reduces' ``codes`` (numbered on
    from this pass's last)."""
    return (zlib.crc32(",".join(map(str, codes)).encode()) & 0x7FFFFFFF) or 1
