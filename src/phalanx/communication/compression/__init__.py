"""Gradient compression for the MultiWorkerMirrored engine (``CommunicationOptions(compression=...)``).

``"fp16"`` / ``"bf16"``: `phalanx.communication.compression.fp16`; `PowerSGD`:
`phalanx.communication.compression.powersgd`; the seam both plug into:
`phalanx.communication.compression.base`.
"""

from __future__ import annotations

from typing import Union

import torch

from phalanx.communication.compression.base import CompressedAllReduce, Compressor
from phalanx.communication.compression.fp16 import HalfPrecision
from phalanx.communication.compression.powersgd import PowerSGD, PowerSGDCompressor

__all__ = [
    "HALF_PRECISION",
    "Compression",
    "CompressedAllReduce",
    "Compressor",
    "PowerSGD",
    "check_compression",
    "make_compressor",
]

Compression = Union[str, PowerSGD, None]  # noqa: UP007 (a runtime alias)
HALF_PRECISION = {"fp16": torch.float16, "bf16": torch.bfloat16}


def check_compression(compression: object) -> Compression:
    """``compression`` as `CommunicationOptions` keeps it: None, ``"fp16"``, ``"bf16"`` or a
    `PowerSGD`.

    Raises:
        ValueError: Another string, or another kind of object.
    """
    if compression is None or isinstance(compression, PowerSGD):
        return compression
    if isinstance(compression, str) and compression.lower() in HALF_PRECISION:
        return compression.lower()
    raise ValueError(
        "compression must be None, 'fp16', 'bf16' or phalanx.experimental.PowerSGD(rank=...). "
        f"Received: {compression!r}. HINT: 'fp16' halves the bytes; PowerSGD(rank=2) sends a "
        "rank-2 approximation of each gradient matrix."
    )


def make_compressor(compression: Compression, workers: int) -> Compressor | None:
    """The stateful compressor of one gradient engine over ``workers`` workers (None: none)."""
    if compression is None:
        return None
    if isinstance(compression, PowerSGD):
        return PowerSGDCompressor(compression, workers)
    return HalfPrecision(HALF_PRECISION[compression], workers)
