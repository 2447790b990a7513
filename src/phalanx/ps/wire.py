"""The bytes of one message between tasks: a JSON header and raw tensor data.

    b"PHX1" | uint32 header length (little-endian) | header (UTF-8 JSON) | tensor 0 bytes | ...

The header holds the caller's fields and, under ``"__tensors__"``, one ``[dtype, shape,
byte length]`` entry per tensor. Tensors travel as their raw memory (CPU, contiguous, the
machine's byte order), so a round trip is bit-exact: NaN payloads and -0.0 included.
Decoding copies each tensor's bytes once, into memory the returned tensor owns. A handler
that packs its reply itself (under its lock, straight from its variables) returns `Packed`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import struct
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

__all__ = ["Packed", "pack", "pack_parts", "pack_reply", "read_header", "reply_destination", "unpack"]

MAGIC = b"PHX1"
_LENGTH = struct.Struct("<I")
_PREFIX = len(MAGIC) + _LENGTH.size
_TABLE = "__tensors__"
_SAME_VERSION = "HINT: every task of the cluster must run the same phalanx version."
# quantized tensors carry a scale and zero point that raw bytes would lose
_QUANTIZED = frozenset(
    getattr(torch, name)
    for name in ("qint8", "quint8", "qint32", "quint4x2", "quint2x4")
    if hasattr(torch, name)
)


@dataclasses.dataclass(frozen=True)
class Packed:
    """A message `pack` made already: a ps task packs a read under its lock, copying each
    variable once into the reply instead of cloning it and copying the clone again."""

    data: bytes | memoryview


# where a reply packed on this thread goes: a function of its size -> memory to pack into, or None
_destination = threading.local()


@contextlib.contextmanager
def reply_destination(allocate: Callable[[int], memoryview | None]) -> Iterator[None]:
    """Within the block, `pack_reply` on this thread packs into ``allocate(size)`` (when it gives
    memory: the data path's shared-memory segment) instead of new bytes."""
    _destination.allocate = allocate
    try:
        yield
    finally:
        _destination.allocate = None


def pack_reply(header: Mapping[str, Any], tensors: Sequence[torch.Tensor] = ()) -> Packed:
    """`pack`, into the `reply_destination` of this thread if it has room: a read is copied
    once, from the variables into the memory the reply leaves from."""
    parts = pack_parts(header, tensors)
    allocate = getattr(_destination, "allocate", None)
    size = sum(part.nbytes for part in parts)
    target = allocate(size) if allocate is not None else None
    if target is None:
        return Packed(b"".join(parts))
    offset = 0
    for part in parts:
        target[offset : offset + part.nbytes] = part
        offset += part.nbytes
    return Packed(target[:size])


def pack(header: Mapping[str, Any], tensors: Sequence[torch.Tensor] = ()) -> bytes:
    """One message: ``header`` and ``tensors``, for `unpack` on the other side.

    Args:
        header: JSON-serialisable, with str keys (``"__tensors__"`` is reserved).
        tensors: Dense tensors of any dtype, shape and device (sent from CPU memory).

    Raises:
        ValueError: A sparse, nested, quantized or meta tensor, or the reserved header key.
        TypeError: A header that is not a str-keyed mapping JSON can encode, or a non-tensor.
    """
    return b"".join(pack_parts(header, tensors))


def pack_parts(header: Mapping[str, Any], tensors: Sequence[torch.Tensor] = ()) -> list[memoryview]:
    """The message `pack` makes, as its pieces: the prefix and header, then each tensor's
    memory (no copy of a dense CPU tensor), for a writer that sends them one by one.

    Raises:
        As `pack`.
    """
    table, chunks = [], []
    for index, tensor in enumerate(tensors):
        data = _raw_bytes(tensor, index)
        table.append([str(tensor.dtype).removeprefix("torch."), list(tensor.shape), data.nbytes])
        chunks.append(data)
    encoded = _encode_header(header, table)
    return [memoryview(b"".join([MAGIC, _LENGTH.pack(len(encoded)), encoded])), *chunks]


def read_header(
    read: Callable[[int], bytes], size: int
) -> tuple[dict[str, Any], list[tuple[torch.dtype, list[int], int]]]:
    """The header of a message of ``size`` bytes that arrives through ``read(n) -> n bytes``,
    and its tensors' ``(dtype, shape, byte length)``: a reader then reads each tensor's bytes
    straight into a tensor. Nothing larger than ``size`` is allocated.

    Raises:
        ValueError: As `unpack`, or tensors whose lengths do not add up to ``size``.
    """
    if size < _PREFIX:
        raise ValueError(f"A message is truncated: {size} bytes, not even its {_PREFIX}-byte prefix.")
    prefix = read(_PREFIX)
    if prefix[: len(MAGIC)] != MAGIC:
        _decode_header(memoryview(prefix))  # raises, naming what it found
    (length,) = _LENGTH.unpack(prefix[len(MAGIC) :])
    if _PREFIX + length > size:
        raise ValueError(
            f"A message is truncated: its header needs {length} bytes, {size - _PREFIX} are present."
        )
    header, _ = _decode_header(memoryview(prefix + read(length)))
    entries = [_table_entry(entry, i) for i, entry in enumerate(_table(header))]
    data = sum(nbytes for _, _, nbytes in entries)
    if _PREFIX + length + data != size:
        raise ValueError(
            f"A message of {size} bytes has a {length}-byte header and tensors of {data} bytes. "
            f"{_SAME_VERSION}"
        )
    return header, entries


def unpack(data: bytes | bytearray | memoryview) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """The header and tensors of a message made by `pack`.

    The tensors are writable CPU tensors that own their memory (one copy each).

    Raises:
        ValueError: Not a message of this version, truncated or with bytes left over, a header
            that is not a JSON object, or a tensor table that does not fit the data.
    """
    view = memoryview(data)
    if view.ndim != 1 or view.itemsize != 1:
        view = view.cast("B")
    header, offset = _decode_header(view)
    entries = [_table_entry(entry, i) for i, entry in enumerate(_table(header))]
    tensors = []
    for index, (dtype, shape, nbytes) in enumerate(entries):
        left = len(view) - offset
        if nbytes > left:
            raise ValueError(
                f"A message is truncated: tensor {index} ({_describe(dtype, shape)}) needs {nbytes} bytes, "
                f"{left} are left. {_SAME_VERSION}"
            )
        tensors.append(_tensor(view[offset : offset + nbytes], dtype, shape))
        offset += nbytes
    if offset != len(view):
        raise ValueError(
            f"A message has {len(view) - offset} bytes after its last tensor; its table accounts for "
            f"{len(entries)} tensors. {_SAME_VERSION}"
        )
    return header, tensors


def _raw_bytes(tensor: torch.Tensor, index: int) -> memoryview:
    """The bytes of ``tensor`` as a dense CPU array (no copy when it already is one)."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(
            f"Only tensors can be sent. Received: tensor {index} of type {type(tensor).__name__}."
        )
    refusal = _refusal(tensor)
    if refusal:
        rule, hint = refusal
        raise ValueError(
            f"{rule}. Received: tensor {index} with layout {tensor.layout}, dtype {tensor.dtype}. "
            f"HINT: {hint}."
        )
    # conjugate and negative views are lazy: their memory does not hold the values yet
    flat = tensor.detach().to("cpu").resolve_conj().resolve_neg().contiguous()
    if flat.numel() == 0:
        return memoryview(b"")
    return flat.reshape(-1).view(torch.uint8).numpy().data  # keeps ``flat`` alive


def _refusal(tensor: torch.Tensor) -> tuple[str, str] | None:
    """Why ``tensor`` cannot be sent as raw bytes, and what to send instead (None: it can)."""
    if tensor.is_nested:
        return "nested tensors cannot be sent", "send each of tensor.unbind()"
    if tensor.layout != torch.strided:
        return "sparse tensors cannot be sent", ".to_dense(), or send the indices and values"
    if tensor.dtype in _QUANTIZED:
        return "quantized tensors cannot be sent", ".dequantize(), or send .int_repr() and the scale"
    if tensor.is_meta:
        return "meta tensors have no data to send", "create the tensor on a real device"
    return None


def _encode_header(header: Mapping[str, Any], table: list[list[Any]]) -> bytes:
    if not isinstance(header, Mapping) or not all(isinstance(key, str) for key in header):
        raise TypeError(
            f"A message header must be a mapping with str keys. Received: {type(header).__name__} "
            f"{header!r:.200}. HINT: pass a dict such as {{'name': value}}."
        )
    if _TABLE in header:
        raise ValueError(
            f"The header key {_TABLE!r} is reserved for the tensor table. Received: header keys "
            f"{sorted(header)}. HINT: name that field differently."
        )
    try:
        return json.dumps({**header, _TABLE: table}).encode()
    except (TypeError, ValueError) as exc:
        raise TypeError(
            f"A message header must be JSON-serialisable: {exc}. Received: {dict(header)!r:.200}. HINT: send "
            "tensors as tensors, and other values as str, int, float, bool, None, lists or dicts."
        ) from None


def _decode_header(view: memoryview) -> tuple[dict[str, Any], int]:
    """The header of the message in ``view`` and where its tensor data starts."""
    start = bytes(view[: len(MAGIC)])
    if len(view) < _PREFIX and MAGIC.startswith(start):
        raise ValueError(f"A message is truncated: {len(view)} bytes, not even its {_PREFIX}-byte prefix.")
    if start != MAGIC:
        raise ValueError(
            f"Not a phalanx message of version 1 (wrong magic or version): it starts with {start!r}, "
            f"expected {MAGIC!r}. {_SAME_VERSION}"
        )
    (length,) = _LENGTH.unpack(view[len(MAGIC) : _PREFIX])
    end = _PREFIX + length
    if len(view) < end:
        raise ValueError(
            f"A message is truncated: its header needs {length} bytes, {len(view) - _PREFIX} are present."
        )
    try:
        header = json.loads(bytes(view[_PREFIX:end]).decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise ValueError(f"A message header is not JSON: {exc}. {_SAME_VERSION}") from None
    if not isinstance(header, dict):
        raise ValueError(
            f"A message header must be a JSON object. Received: {type(header).__name__}. {_SAME_VERSION}"
        )
    return header, end


def _table(header: dict[str, Any]) -> list[Any]:
    """Removes the tensor table from ``header`` and returns it."""
    table = header.pop(_TABLE, [])
    if not isinstance(table, list):
        raise ValueError(
            f"A message's tensor table must be a JSON list. Received: {table!r:.200}. {_SAME_VERSION}"
        )
    return table


def _table_entry(entry: Any, index: int) -> tuple[torch.dtype, list[int], int]:
    """``[dtype name, shape, byte length]`` checked against each other."""
    if not (isinstance(entry, list) and len(entry) == 3):
        raise ValueError(
            f"Tensor {index} of a message must be described as [dtype, shape, byte length]. Received: "
            f"{entry!r:.200}. {_SAME_VERSION}"
        )
    name, shape, nbytes = entry
    dtype = _dtype(name)
    if not (isinstance(shape, list) and all(type(size) is int and size >= 0 for size in shape)):
        raise ValueError(
            f"Tensor {index} of a message must have a shape of non-negative ints. Received: {shape!r:.200}. "
            f"{_SAME_VERSION}"
        )
    expected = math.prod(shape) * dtype.itemsize
    if type(nbytes) is not int or nbytes != expected:
        raise ValueError(
            f"Tensor {index} of a message ({_describe(dtype, shape)}) needs {expected} bytes, but its table "
            f"entry says {nbytes!r}. {_SAME_VERSION}"
        )
    return dtype, shape, nbytes


def _dtype(name: Any) -> torch.dtype:
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype) or dtype in _QUANTIZED:
        raise ValueError(
            f"Unknown tensor dtype {name!r:.100} in a message (this process runs torch {torch.__version__}). "
            "HINT: every task of the cluster must run the same phalanx and torch versions."
        )
    return dtype


def _tensor(data: memoryview, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
    """A tensor that owns a copy of ``data``."""
    if not data.nbytes:
        return torch.empty(shape, dtype=dtype)
    raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)  # the one copy; the tensor keeps it alive
    return raw.view(dtype).reshape(shape)


def _describe(dtype: torch.dtype, shape: list[int]) -> str:
    return f"{str(dtype).removeprefix('torch.')}, shape {shape}"
