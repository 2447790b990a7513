"""The bytes of one message between tasks: a JSON header and raw tensor data.

    b"PHX1" | uint32 header length | header (UTF-8 JSON) | tensor 0 bytes | tensor 1 bytes | ...

The header holds the caller's fields and, under ``"__tensors__"``, each tensor's dtype,
shape and byte length. Tensors travel as their raw little-endian memory (CPU, contiguous),
so a round trip is bit-exact.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping, Sequence
from typing import Any

import torch

__all__ = ["pack", "unpack"]

MAGIC = b"PHX1"
_LENGTH = struct.Struct("<I")
_TABLE = "__tensors__"


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"Unknown tensor dtype {name!r} in a message.")
    return dtype


def pack(header: Mapping[str, Any], tensors: Sequence[torch.Tensor] = ()) -> bytes:
    """One message: ``header`` (JSON-serialisable, str keys) and ``tensors`` (dense, any device).

    Raises:
        ValueError: A sparse tensor.
    """
    table, chunks = [], []
    for tensor in tensors:
        if tensor.layout != torch.strided:
            raise ValueError(
                "sparse tensors cannot be sent. HINT: .to_dense(), or send the indices and values."
            )
        flat = tensor.detach().to("cpu").contiguous()
        # the tensor's own memory: join below is the only copy
        data = flat.reshape(-1).view(torch.uint8).numpy().data if flat.numel() else memoryview(b"")
        table.append([str(flat.dtype).removeprefix("torch."), list(flat.shape), data.nbytes])
        chunks.append(data)
    encoded = json.dumps({**header, _TABLE: table}).encode()
    return b"".join([MAGIC, _LENGTH.pack(len(encoded)), encoded, *chunks])


def unpack(data: bytes | bytearray | memoryview) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """The header and tensors of a message made by `pack` (tensors are writable copies).

    Raises:
        ValueError: Not such a message, or truncated.
    """
    view = memoryview(data)
    if len(view) < 8 or bytes(view[:4]) != MAGIC:
        raise ValueError("Not a phalanx message (wrong magic or version). HINT: both tasks must run phalanx.")
    (length,) = _LENGTH.unpack(view[4:8])
    end = 8 + length
    if len(view) < end:
        raise ValueError(f"A truncated message: header of {length} bytes, {len(view) - 8} present.")
    try:
        header = json.loads(bytes(view[8:end]).decode())
    except (UnicodeDecodeError, ValueError) as exc:
        raise ValueError(f"A message header is not JSON: {exc}.") from None
    if not isinstance(header, dict) or not isinstance(header.get(_TABLE, []), list):
        raise ValueError("A message header must be a JSON object.")
    tensors = []
    offset = end
    for dtype_name, shape, nbytes in header.pop(_TABLE, []):
        dtype = _dtype(dtype_name)
        expected = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        if nbytes != expected or offset + nbytes > len(view):
            raise ValueError(
                f"A tensor of dtype {dtype_name} and shape {shape} needs {expected} bytes; the message "
                f"gives {nbytes} ({len(view) - offset} left)."
            )
        raw = bytearray(view[offset : offset + nbytes])
        flat = torch.frombuffer(raw, dtype=torch.uint8) if nbytes else torch.empty(0, dtype=torch.uint8)
        tensors.append(flat.view(dtype).reshape(shape) if nbytes else torch.empty(shape, dtype=dtype))
        offset += nbytes
    return header, tensors
