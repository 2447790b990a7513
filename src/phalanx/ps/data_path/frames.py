"""The frames and shared-memory segments of the parameter-server data path (`phalanx.ps.data_path`).

Every frame is a fixed prefix, then (for a request) the method's name, then a
`phalanx.ps.wire` message of ``length`` bytes, which follows on the stream or, with the
``IN_SEGMENT`` flag, lies at the start of the connection's shared-memory segment::

    b"PXD1" | kind (1 byte) | flags (1 byte) | method length (uint16) | message length (uint64)

A message on the stream is read straight into the tensors it carries (`read_message`): the
header first, then each tensor's bytes with ``recv_into`` on the tensor's own memory. Nothing
is allocated before the lengths are checked against the limit and against each other.

A segment is a file in ``/dev/shm`` that the client creates (mode 0600, ``O_EXCL``), with a
random nonce in its first `SEGMENT_RESERVED` bytes. It proposes it over the authenticated
stream (path, size, nonce); the server maps it only if the file is a regular file of this
user with that size and that nonce, which also proves both ends share a machine (a task on
another host finds no such file, or another one). The client unlinks the file once the server
answered, so nothing is left behind.
"""

from __future__ import annotations

import contextlib
import enum
import hmac
import mmap
import os
import secrets
import socket
import ssl
import stat
import struct
from typing import Any

import torch

from phalanx.ps import wire

__all__ = [
    "FRAME",
    "IN_SEGMENT",
    "MAGIC",
    "SEGMENT_RESERVED",
    "FrameError",
    "Kind",
    "Segment",
    "read_exactly",
    "read_frame",
    "read_message",
    "send_frame",
]

MAGIC = b"PXD1"
FRAME = struct.Struct("!4sBBHQ")
IN_SEGMENT = 1
MAX_METHOD = 128
SEGMENT_RESERVED = 64  # the nonce lives here; messages start after it
_DIR = "/dev/shm"  # noqa: S108 (created O_EXCL | O_NOFOLLOW, mode 0600, unlinked at once)


class Kind(enum.IntEnum):
    """What a frame is."""

    HELLO = 1  # client -> server, first: {"token": ...} in plaintext mode, {} with TLS
    REQUEST = 2  # a method call
    REPLY = 3  # its result
    ERROR = 4  # its error (`rpc_errors.error_details` JSON under "error")
    SEGMENT = 5  # client -> server: map this segment {"path", "size", "nonce"}


class FrameError(ValueError):
    """A frame that breaks the protocol: the connection is closed after it."""


def read_exactly(sock: socket.socket | ssl.SSLSocket, view: memoryview) -> None:
    """Fills ``view`` from ``sock`` (``recv_into``: no intermediate bytes).

    Raises:
        ConnectionError: The peer closed the connection first.
    """
    got, size = 0, view.nbytes
    while got < size:
        n = sock.recv_into(view[got:], size - got)
        if n == 0:
            raise ConnectionError("the peer closed the connection")
        got += n


def _read_bytes(sock: socket.socket | ssl.SSLSocket, size: int) -> bytes:
    buffer = bytearray(size)
    read_exactly(sock, memoryview(buffer))
    return bytes(buffer)


def send_frame(
    sock: socket.socket | ssl.SSLSocket,
    kind: Kind,
    parts: list[memoryview] | None = None,
    *,
    method: str = "",
    in_segment: int | None = None,
) -> None:
    """Sends a frame: the message's ``parts`` on the stream, or, with ``in_segment``, only its
    length (the message is in the segment already)."""
    name = method.encode()
    length = in_segment if in_segment is not None else sum(p.nbytes for p in parts or ())
    flags = IN_SEGMENT if in_segment is not None else 0
    head = FRAME.pack(MAGIC, int(kind), flags, len(name), length) + name
    if in_segment is not None or not parts:
        sock.sendall(head)
        return
    first = parts[0]
    if first.nbytes < (1 << 16):  # header and a small first part in one write
        sock.sendall(head + bytes(first))
    else:
        sock.sendall(head)
        sock.sendall(first)
    for part in parts[1:]:
        if part.nbytes:
            sock.sendall(part)


def read_frame(sock: socket.socket | ssl.SSLSocket) -> tuple[Kind, int, str, int]:
    """``(kind, flags, method, message length)`` of the next frame.

    Raises:
        ConnectionError: The peer closed the connection.
        FrameError: Not a frame of this protocol, or a method name that is too long (nothing
            more is read). The message's length is the caller's to check.
    """
    head = _read_bytes(sock, FRAME.size)
    magic, kind, flags, method_length, length = FRAME.unpack(head)
    if magic != MAGIC or kind not in Kind.__members__.values() or flags & ~IN_SEGMENT:
        raise FrameError(f"not a frame of the phalanx data path (it starts with {head[:8]!r})")
    if method_length > MAX_METHOD:
        raise FrameError(f"a method name of {method_length} bytes (at most {MAX_METHOD})")
    method = _read_bytes(sock, method_length).decode("utf-8", "replace") if method_length else ""
    return Kind(kind), flags, method, length


def read_message(sock: socket.socket | ssl.SSLSocket, size: int) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """A `wire` message of ``size`` bytes from the stream, each tensor's bytes received into
    that tensor's memory.

    Raises:
        ValueError: A malformed message (as `wire.read_header`).
        ConnectionError: The peer closed the connection.
    """
    header, entries = wire.read_header(lambda n: _read_bytes(sock, n), size)
    tensors = []
    for dtype, shape, nbytes in entries:
        tensor = torch.empty(shape, dtype=dtype)
        if nbytes:
            read_exactly(sock, tensor.reshape(-1).view(torch.uint8).numpy().data)
        tensors.append(tensor)
    return header, tensors


class Segment:
    """One shared-memory segment of a data-path connection (see the module's docstring).

    Use `create` on the client and `open` on the server.
    """

    def __init__(self, path: str, size: int, nonce: bytes, memory: mmap.mmap) -> None:
        self.path, self.size, self.nonce = path, size, nonce
        self._memory = memory
        self.view = memoryview(memory)[SEGMENT_RESERVED:]

    @property
    def capacity(self) -> int:
        """The largest message it holds."""
        return self.size - SEGMENT_RESERVED

    @classmethod
    def create(cls, capacity: int) -> Segment:
        """A new segment for messages of up to ``capacity`` bytes (the client's side).

        Raises:
            OSError: ``/dev/shm`` is missing or full.
        """
        path = os.path.join(_DIR, f"phalanx-psd-{os.getpid()}-{secrets.token_hex(8)}")
        size = capacity + SEGMENT_RESERVED
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.posix_fallocate(fd, 0, size)  # ENOSPC now, never SIGBUS at first touch
            memory = mmap.mmap(fd, size)
        except OSError:
            os.unlink(path)
            raise
        finally:
            os.close(fd)
        nonce = secrets.token_bytes(32)
        memory[: len(nonce)] = nonce
        return cls(path, size, nonce, memory)

    @classmethod
    def open(cls, path: str, size: int, nonce: bytes, limit: int) -> Segment:
        """The client's segment, after checking it is what the client said (the server's side).

        Raises:
            ValueError: Not a file in ``/dev/shm`` of this user, of ``size`` bytes, holding
                ``nonce`` (another machine's task, or a planted file), or over ``limit``.
            OSError: It cannot be opened.
        """
        if os.path.dirname(path) != _DIR or not os.path.basename(path).startswith("phalanx-psd-"):
            raise ValueError(f"a segment must be /dev/shm/phalanx-psd-*: {path!r}")
        if not 0 < size - SEGMENT_RESERVED <= limit:
            raise ValueError(f"a segment of {size} bytes (the message limit is {limit})")
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid() or info.st_size != size:
                raise ValueError(f"{path} is not a {size}-byte file of this user")
            memory = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        if not hmac.compare_digest(bytes(memory[: len(nonce)]), nonce) or len(nonce) != 32:
            memory.close()
            raise ValueError(f"{path} does not hold the nonce the client sent")
        return cls(path, size, nonce, memory)

    def unlink(self) -> None:
        """Removes the file (the mappings stay valid)."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def close(self) -> None:
        """Unmaps it (the caller must hold no view of it any more)."""
        self.view.release()
        with contextlib.suppress(BufferError):  # still viewed: the mapping goes with the last view
            self._memory.close()
