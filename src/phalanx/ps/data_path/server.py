"""The task's end of the parameter-server data path: tensor bytes beside gRPC, without its copies.

gRPC Python copies a large message several times on each end (~13 ms of CPU for 7.45 MB
where a ``memcpy`` takes 0.3 ms; docs/performance.md). A task therefore also listens on a
second port, announced through gRPC (the ``__data_path__`` method, so only a caller gRPC
authenticated learns it), where each client keeps long-lived connections, one call at a time
on each: frames of `phalanx.ps.data_path.frames`, sent from and received into tensor memory, and,
when client and task share a machine, a shared-memory segment per connection that requests
and replies are written into instead of the socket.

Authentication is the gRPC channel's: mutual TLS against the cluster CA, the task's
certificate naming its address, both ends' certificates required before a byte of a frame is
read (`phalanx.communication.transports.tls.links.tls_contexts`); with the plaintext opt-out
(``PHALANX_INSECURE_TRANSPORT=1``) the client's first frame carries the token, compared in
constant time before anything else is read. A frame that breaks the protocol, or announces a
message over ``PHALANX_MAX_MESSAGE_BYTES``, is refused before anything is allocated for it,
and the connection is closed. Handlers are the gRPC server's, so fences and errors are the same.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import logging
import socket
import ssl
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from phalanx import settings
from phalanx.communication.transports.tls.links import tls_contexts
from phalanx.ps import wire
from phalanx.ps.data_path.frames import FrameError, Kind, Segment, read_frame, read_message, send_frame
from phalanx.ps.rpc.errors import error_details, too_large
from phalanx.security.certificates import task_certificate

__all__ = ["DATA_PATH_ENV", "DataServer", "data_path_mode"]

log = logging.getLogger("phalanx")

DATA_PATH_ENV = "PHALANX_PS_DATA_PATH"
_MODES = ("auto", "stream", "grpc")
HANDSHAKE_SECONDS = 10.0  # a peer that connects and says nothing is dropped after this

Handler = Callable[[dict[str, Any], list[torch.Tensor]], Any]


def data_path_mode() -> str:
    """``PHALANX_PS_DATA_PATH``: "auto" (the default: the data path, with shared memory between
    tasks of one machine), "stream" (the data path, never shared memory) or "grpc" (none).

    Raises:
        ValueError: Another value.
    """
    return settings.current().ps_data_path


class DataServer:
    """Serves ``handlers`` on the data path of one task (see the module's docstring).

    Args:
        host: The address to listen at (the task's; the port is picked).
        token: The cluster token (TLS certificates, or the plaintext check).
        names: The names the task's certificate carries (as its gRPC server's).
        handlers: Method name -> handler, as `phalanx.ps.transport.RpcServer`'s.
        name: This task, for messages.
        limit: The largest message accepted or sent.
        insecure: The plaintext opt-out.
    """

    def __init__(
        self,
        host: str,
        token: str,
        names: Sequence[str],
        handlers: Mapping[str, Handler],
        *,
        name: str,
        limit: int,
        insecure: bool,
    ) -> None:
        self.name, self.limit, self._handlers = name, limit, dict(handlers)
        self._token = token.encode()
        self._context = None if insecure else tls_contexts(task_certificate(token, list(names)))[0]
        family, _, _, _, address = socket.getaddrinfo(host.strip("[]"), 0, type=socket.SOCK_STREAM)[0]
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        self._listener.bind(address)
        self._listener.listen(64)
        self.port = int(self._listener.getsockname()[1])
        self._connections: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._stopped = False
        self._thread = threading.Thread(target=self._accept, name=f"phalanx-data {name}", daemon=True)

    def start(self) -> None:
        """Starts accepting connections."""
        self._thread.start()

    @property
    def stopped(self) -> bool:
        """Whether `stop` was called (its connections' errors are then expected)."""
        return self._stopped

    def handler(self, method: str) -> Handler | None:
        """The handler of ``method``, or None when the data path does not serve it. Called by
        each connection's thread, per request."""
        return self._handlers.get(method)

    def stop(self) -> None:
        """Stops accepting and closes every connection (idempotent)."""
        with self._lock:
            self._stopped = True
            connections = list(self._connections)
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        for sock in connections:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def _accept(self) -> None:
        while True:
            try:
                raw, peer = self._listener.accept()
            except OSError:
                return  # stopped
            with self._lock:
                if self._stopped:
                    raw.close()
                    return
                self._connections.add(raw)
            threading.Thread(
                target=self._connection, args=(raw, peer), name=f"phalanx-data {self.name}", daemon=True
            ).start()

    def _connection(self, raw: socket.socket, peer: Any) -> None:
        sock: socket.socket | ssl.SSLSocket | None = None
        try:
            sock = self._authenticate(raw, peer)
            if sock is None:
                return
            with self._lock:  # a TLS socket took the raw one's descriptor: `stop` shuts it down
                self._connections.discard(raw)
                self._connections.add(sock)
                stopped = self._stopped
            if not stopped:
                _Connection(self, sock, peer).serve()
        finally:
            with self._lock:
                self._connections.discard(raw)
                if sock is not None:
                    self._connections.discard(sock)
            raw.close()
            if sock is not None:
                sock.close()

    def _authenticate(self, raw: socket.socket, peer: Any) -> socket.socket | ssl.SSLSocket | None:
        """The connection once the peer proved it holds the cluster's credentials, else None (logged)."""
        raw.settimeout(HANDSHAKE_SECONDS)
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            sock = raw if self._context is None else self._context.wrap_socket(raw, server_side=True)
            kind, _, _, length = read_frame(sock)
            if kind != Kind.HELLO or length > 4096:
                raise FrameError(f"a {kind.name} frame of {length} bytes before the hello")
            header, _ = read_message(sock, length)
            if self._context is None and not hmac.compare_digest(
                str(header.get("token", "")).encode(), self._token
            ):
                raise PermissionError("wrong or missing cluster token")
            send_frame(sock, Kind.REPLY, wire.pack_parts({}))
        except (OSError, ValueError, PermissionError, ssl.SSLError) as exc:
            log.warning("%s refused a data-path connection from %s: %s", self.name, peer, exc)
            return None
        sock.settimeout(None)
        return sock


class _Connection:
    """One authenticated connection: calls one after the other until the peer closes it."""

    def __init__(self, server: DataServer, sock: socket.socket | ssl.SSLSocket, peer: Any) -> None:
        self._server, self._sock, self._peer = server, sock, peer
        self._segment: Segment | None = None

    def serve(self) -> None:
        try:
            while self._next():
                pass
        except (ConnectionError, ssl.SSLError, OSError) as exc:
            if not isinstance(exc, ConnectionError) and not self._server.stopped:
                log.warning(
                    "%s closed the data-path connection from %s: %s", self._server.name, self._peer, exc
                )
        except FrameError as exc:
            log.warning(
                "%s refused a frame from %s and closed its connection: %s", self._server.name, self._peer, exc
            )
        finally:
            if self._segment is not None:
                self._segment.close()

    def _next(self) -> bool:
        """Serves one frame; False when the connection must close."""
        kind, flags, method, length = read_frame(self._sock)
        limit = self._server.limit
        if length > limit:
            what = f"The request of {method or kind.name} to {self._server.name}"
            self._error(too_large(what, length, limit))
            return False  # its bytes were not read: the stream cannot go on
        if kind == Kind.SEGMENT:
            return self._map_segment(length)
        if kind != Kind.REQUEST:
            raise FrameError(f"a {kind.name} frame where a request was expected")
        try:
            header, tensors = self._request(flags, length)
        except ValueError as exc:
            self._error(exc)
            return False
        self._reply(method, header, tensors)
        return True

    def _request(self, flags: int, length: int) -> tuple[dict[str, Any], list[torch.Tensor]]:
        if not flags:
            return read_message(self._sock, length)
        if self._segment is None or length > self._segment.capacity:
            raise FrameError(f"a request of {length} bytes in a shared-memory segment it did not map")
        return wire.unpack(self._segment.view[:length])

    def _map_segment(self, length: int) -> bool:
        header, _ = read_message(self._sock, length)
        try:
            segment = Segment.open(
                str(header["path"]),
                int(header["size"]),
                bytes.fromhex(str(header["nonce"])),
                self._server.limit,
            )
        except (OSError, ValueError, KeyError, TypeError) as exc:  # another machine, most often
            send_frame(self._sock, Kind.REPLY, wire.pack_parts({"mapped": False, "why": str(exc)}))
            return True
        if self._segment is not None:
            self._segment.close()
        self._segment = segment
        send_frame(self._sock, Kind.REPLY, wire.pack_parts({"mapped": True}))
        return True

    def _allocate(self, size: int) -> memoryview | None:
        segment = self._segment
        return segment.view[:size] if segment is not None and size <= segment.capacity else None

    def _reply(self, method: str, header: dict[str, Any], tensors: list[torch.Tensor]) -> None:
        handler = self._server.handler(method)
        try:
            if handler is None:
                raise KeyError(f"{self._server.name} serves no method {method!r} on its data path")
            with wire.reply_destination(self._allocate):
                result = handler(header, tensors)
                packed = result if isinstance(result, wire.Packed) else wire.pack_reply(*result)
            size = len(packed.data)
            if size > self._server.limit:
                raise too_large(f"The reply of {method} on {self._server.name}", size, self._server.limit)
        except Exception as exc:
            log.debug("%s on %s failed", method, self._server.name, exc_info=True)
            self._error(exc)
            return
        data = packed.data
        if isinstance(data, memoryview) and self._segment is not None and _inside(data, self._segment):
            send_frame(self._sock, Kind.REPLY, in_segment=size)
        else:
            send_frame(self._sock, Kind.REPLY, [memoryview(data)])

    def _error(self, exc: BaseException) -> None:
        details = error_details(exc)
        send_frame(self._sock, Kind.ERROR, wire.pack_parts({"error": json.loads(details)}))


def _inside(data: memoryview, segment: Segment) -> bool:
    """Whether ``data`` is the start of ``segment``'s message area (`pack_reply` packed into it)."""
    return data.obj is segment.view.obj
