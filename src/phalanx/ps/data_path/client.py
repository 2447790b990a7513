"""The caller's end of the parameter-server data path (`phalanx.ps.data_path.server` describes it).

A `DataClient` keeps idle connections to one task and takes one per call (a call in flight
owns its connection), so the threads of a worker or of the chief call at once without
sharing a stream. A connection that failed, timed out or broke the protocol is closed and
never reused: the call that saw it raises `TaskUnavailableError` naming the task, the next call
opens a new connection. When the task shares this machine, each connection gets a
shared-memory segment as soon as a message of `SEGMENT_FROM` bytes or more goes either way,
grown to the largest message seen.
"""

from __future__ import annotations

import contextlib
import json
import select
import socket
import ssl
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch

from phalanx.communication.transports.tls.links import tls_contexts
from phalanx.ps import wire
from phalanx.ps.data_path.frames import FrameError, Kind, Segment, read_frame, read_message, send_frame
from phalanx.ps.rpc.errors import TaskUnavailableError, peer_not_authenticated, remote_error, too_large
from phalanx.security.certificates import task_certificate

__all__ = ["SEGMENT_FROM", "DataClient", "DataConnectError", "Watch"]

T = TypeVar("T")
SEGMENT_FROM = 1 << 16  # smaller messages go on the stream: a copy costs less than a segment
_MIN_SEGMENT = 1 << 20


class _Connection:
    def __init__(self, sock: socket.socket | ssl.SSLSocket) -> None:
        self.sock = sock
        self.segment: Segment | None = None
        self.wanted = 0  # the largest message seen: the segment's next size

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()
        if self.segment is not None:
            self.segment.close()
            self.segment = None


# while a reply is awaited, ``on_wait()`` runs every ``every`` seconds on the caller's thread; what it
# raises ends the call (its connection is closed) and reaches the caller unchanged
Watch = tuple[float, Callable[[], None]]


class _Stopped(Exception):
    """What a `Watch`'s ``on_wait`` raised, carried past the transport's own error mapping."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error


class DataConnectError(TaskUnavailableError):
    """The data path's port did not accept a connection: nothing was sent (the task may have
    restarted on another data port; its gRPC address tells)."""


class DataClient:
    """Calls one task's methods on its data path. Thread-safe.

    Args:
        host, port: Where the task's data path listens (``host`` as dialled for gRPC).
        token: The cluster token.
        name, address: The task and its gRPC address, for messages.
        limit: The largest message sent or accepted.
        insecure: The plaintext opt-out (the token goes in the hello).
        segments: Offer shared memory (the task uses it only if it shares this machine).
    """

    def __init__(
        self,
        host: str,
        port: int,
        token: str,
        *,
        name: str,
        address: str,
        limit: int,
        insecure: bool,
        segments: bool,
    ) -> None:
        self.name, self._address, self._limit = name, address, limit
        self._host, self._port, self._token = host.strip("[]"), port, token
        self._insecure, self._segments = insecure, segments
        self._context = None if insecure else tls_contexts(task_certificate(token, ()))[1]
        self._idle: list[_Connection] = []
        self._lock = threading.Lock()
        self._closed = False

    def close(self) -> None:
        """Closes every idle connection; calls in flight close theirs when they end."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for connection in idle:
            connection.close()

    def call(
        self,
        method: str,
        header: dict[str, Any],
        tensors: Sequence[torch.Tensor],
        timeout: float,
        watch: Watch | None = None,
    ) -> tuple[dict[str, Any], list[torch.Tensor]]:
        """One call of ``method`` on the caller's thread; raises as
        `phalanx.ps.transport.RpcClient.call`, or what ``watch``'s ``on_wait`` raised."""
        return self.begin(method, header, tensors, timeout)(watch)

    def begin(
        self, method: str, header: dict[str, Any], tensors: Sequence[torch.Tensor], timeout: float
    ) -> Callable[[Watch | None], tuple[dict[str, Any], list[torch.Tensor]]]:
        """Sends a call of ``method`` and returns at once; calling what it returns waits for the
        reply (once, on any thread; a ``watch`` as `call`'s). The call owns its connection
        until then, so calls begun one after the other on one thread run at once (one per ps
        task, `phalanx.ps.variables.PSClient`) without a thread each.

        Raises:
            As `call` (what is raised before the request left: nothing reached the task).
        """
        parts = wire.pack_parts(header, tensors)
        size = sum(part.nbytes for part in parts)
        if size > self._limit:
            raise too_large(f"The request of {method} to {self.name}", size, self._limit)
        deadline = time.monotonic() + timeout
        connection = self._take(method, deadline)
        self._guarded(
            connection, method, timeout, lambda: self._send(connection, method, parts, size, deadline)
        )

        def finish(watch: Watch | None = None) -> tuple[dict[str, Any], list[torch.Tensor]]:
            result = self._guarded(
                connection, method, timeout, lambda: self._receive(connection, method, deadline, watch)
            )
            self._give_back(connection)
            if isinstance(result, Exception):
                raise result
            return result

        return finish

    def _guarded(self, connection: _Connection, method: str, timeout: float, step: Callable[[], T]) -> T:
        """``step()``, its failures as the caller's errors; a failure closes ``connection``."""
        try:
            return step()
        except _Stopped as stopped:
            connection.close()  # a reply may still come: this connection cannot be reused
            raise stopped.error from None
        except TimeoutError:
            connection.close()
            raise TaskUnavailableError(
                f"{self.name} did not answer {method} within the {timeout:g}s deadline (data path). HINT: "
                f"check that the task is running and reachable at {self._address}; a slow call needs a "
                "longer timeout."
            ) from None
        except (OSError, ssl.SSLError, FrameError, ValueError) as exc:
            connection.close()
            raise self._broken(method, exc) from None
        except BaseException:
            connection.close()
            raise

    def _broken(self, method: str, exc: BaseException) -> TaskUnavailableError:
        if isinstance(exc, ssl.SSLError):
            what = (
                f"broke the TLS connection of the data path during {method}: a record failed TLS's integrity "
                f"check or the session failed ({exc}); a relay may have changed bytes in transit"
            )
        elif isinstance(exc, ConnectionError | EOFError):
            what = f"closed its data-path connection during {method} ({exc})"
        else:
            what = f"sent what the data path cannot read during {method} ({exc})"
        return TaskUnavailableError(
            f"{self.name} {what}. HINT: check that the task at {self._address} is running the same phalanx "
            "version; a task that closes every connection at once may refuse this process's credentials."
        )

    def _send(
        self, connection: _Connection, method: str, parts: list[memoryview], size: int, deadline: float
    ) -> None:
        sock = connection.sock
        self._ensure_segment(connection, size, deadline)
        sock.settimeout(_left(deadline))
        segment = connection.segment
        if segment is not None and SEGMENT_FROM <= size <= segment.capacity:
            offset = 0
            for part in parts:
                segment.view[offset : offset + part.nbytes] = part
                offset += part.nbytes
            send_frame(sock, Kind.REQUEST, method=method, in_segment=size)
        else:
            send_frame(sock, Kind.REQUEST, parts, method=method)

    def _receive(
        self, connection: _Connection, method: str, deadline: float, watch: Watch | None
    ) -> tuple[dict[str, Any], list[torch.Tensor]] | Exception:
        sock, segment = connection.sock, connection.segment
        if watch is not None:
            _await_reply(sock, deadline, *watch)
        sock.settimeout(_left(deadline))
        kind, flags, _, length = read_frame(sock)
        if length > self._limit:
            raise FrameError(f"a reply of {length} bytes, over the {self._limit}-byte limit")
        connection.wanted = max(connection.wanted, length)
        if kind == Kind.ERROR:
            header, _ = read_message(sock, length)
            return remote_error(self.name, method, json.dumps(header.get("error")))
        if kind != Kind.REPLY:
            raise FrameError(f"a {kind.name} frame where a reply was expected")
        if flags:
            if segment is None or length > segment.capacity:
                raise FrameError(f"a reply of {length} bytes in a segment this connection does not have")
            return wire.unpack(segment.view[:length])
        return read_message(sock, length)

    def _ensure_segment(self, connection: _Connection, size: int, deadline: float) -> None:
        """Gives ``connection`` a segment for messages as large as any seen (same machine only)."""
        wanted = max(size, connection.wanted)
        current = connection.segment.capacity if connection.segment is not None else 0
        if not self._segments or wanted < SEGMENT_FROM or wanted <= current:
            return
        capacity = min(max(_MIN_SEGMENT, 1 << (wanted - 1).bit_length()), self._limit)
        try:
            segment = Segment.create(capacity)
        except OSError:
            self._segments = False  # no /dev/shm here: the stream it is
            return
        try:
            connection.sock.settimeout(_left(deadline))
            proposal = {"path": segment.path, "size": segment.size, "nonce": segment.nonce.hex()}
            send_frame(connection.sock, Kind.SEGMENT, wire.pack_parts(proposal))
            _, _, _, length = read_frame(connection.sock)
            answer, _ = read_message(connection.sock, length)
        finally:
            segment.unlink()
        if not answer.get("mapped"):
            segment.close()
            self._segments = False  # another machine: never again for this task
            return
        if connection.segment is not None:
            connection.segment.close()
        connection.segment = segment

    def _take(self, method: str, deadline: float) -> _Connection:
        while True:
            with self._lock:
                if self._closed:
                    raise TaskUnavailableError(
                        f"{self.name} cannot be called ({method}): this process closed its connection. HINT: "
                        "make every call before RpcClient.close (or the strategy's close)."
                    )
                connection = self._idle.pop() if self._idle else None
            if connection is None:
                return self._connect(method, deadline)
            if _still_open(connection.sock):
                return connection
            connection.close()  # the task closed it while idle (restarted, or stopped)

    def _give_back(self, connection: _Connection) -> None:
        with self._lock:
            if not self._closed:
                self._idle.append(connection)
                return
        connection.close()

    def _connect(self, method: str, deadline: float) -> _Connection:
        try:
            raw = socket.create_connection((self._host, self._port), timeout=_left(deadline))
        except OSError as exc:
            raise DataConnectError(
                f"{self.name} is unreachable: {method} could not open its data-path connection to "
                f"{self._host}:{self._port} ({exc}). HINT: check that the task is running and reachable at "
                f"{self._address}, its address in the cluster spec."
            ) from None
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            if self._context is None:
                sock: socket.socket | ssl.SSLSocket = raw
                hello = {"token": self._token}
            else:
                self._context.check_hostname = True
                sock = self._context.wrap_socket(raw, server_hostname=self._host)
                hello = {}
            send_frame(sock, Kind.HELLO, wire.pack_parts(hello))
            kind, _, _, length = read_frame(sock)
            if kind != Kind.REPLY or length > 4096:
                raise FrameError(
                    f"a {kind.name} frame of {length} bytes where the hello's answer was expected"
                )
            read_message(sock, length)
        except ssl.SSLCertVerificationError as exc:
            raw.close()
            raise peer_not_authenticated(self.name, self._address, method, str(exc)) from None
        except (OSError, ValueError) as exc:
            raw.close()
            raise self._broken(method, exc) from None
        return _Connection(sock)


def _left(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError
    return left


def _await_reply(
    sock: socket.socket | ssl.SSLSocket, deadline: float, every: float, on_wait: Callable[[], None]
) -> None:
    """Returns once a reply starts to arrive (or the peer closed), calling ``on_wait`` every
    ``every`` seconds meanwhile; nothing of the reply is read, so none is lost to a wait."""
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLIN)
    while not (isinstance(sock, ssl.SSLSocket) and sock.pending()):
        if poller.poll(max(min(every, _left(deadline)), 0.001) * 1000):
            return
        try:
            on_wait()
        except BaseException as exc:
            raise _Stopped(exc) from None


def _still_open(sock: socket.socket | ssl.SSLSocket) -> bool:
    """Whether an idle connection is still open: readable means the peer closed it (or broke
    the protocol: nothing is due on an idle connection)."""
    try:
        readable, _, _ = select.select([sock], [], [], 0)
    except (OSError, ValueError):
        return False
    return not readable
