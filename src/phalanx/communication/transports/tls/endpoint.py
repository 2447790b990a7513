"""One worker's side of every TLS connection it makes: its certificate, its listening address,
how it dials a peer and how it accepts one (`RingLinks` for the rings, `TlsPeers` for the
point-to-point links).

Every listener's address is published as ``host|port|named`` under a key of the job's
rendezvous store (sealed with the token's MAC, so no outsider can redirect a worker). Both
sides present a certificate of the cluster CA and require the peer's; the dialling side
checks the server's certificate against the host it published when the cluster spec gave
that worker one (``named``), then sends a hello (its rank, the link's tag), which the
accepting side checks. A connection that fails the handshake or says it is someone else is
refused and logged by the accepting side.
"""

from __future__ import annotations

import os
import socket
import ssl
import struct
import tempfile
import threading
import time
from typing import Any

from phalanx.communication.group.work import PeerGoneError
from phalanx.security.certificates import TaskCertificate, task_certificate

__all__ = ["HELLO", "SLICE", "TlsEndpoint", "read_exactly", "tag_bytes", "tls_contexts"]

SLICE = 0.25  # seconds each blocking socket call waits before it checks health and closing
HELLO = struct.Struct("!Q32s")  # the dialling worker's rank, the link's tag


def tag_bytes(tag: str) -> bytes:
    """``tag`` as the hello carries it (32 bytes, zero-padded)."""
    return tag.encode().ljust(32, b"\0")[:32]


def tls_contexts(cert: TaskCertificate) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    """(server, client) contexts: both present this task's certificate and require the
    peer's, signed by the cluster CA only."""
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    # ssl loads a key only from a file: a private directory that lives for the call
    with tempfile.TemporaryDirectory(prefix="phalanx-tls-") as folder:
        chain, key = os.path.join(folder, "chain.pem"), os.path.join(folder, "key.pem")
        for path, data in ((chain, cert.chain), (key, cert.key)):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
        for context in (server, client):
            context.minimum_version = ssl.TLSVersion.TLSv1_2
            context.load_cert_chain(chain, key)
            context.load_verify_locations(cadata=cert.ca.decode("ascii"))
            context.verify_mode = ssl.CERT_REQUIRED
    # no session tickets: the dialling side of a ring never reads its connection, and unread
    # bytes would make its close a reset that drops what it sent last
    server.num_tickets = 0
    return server, client


def _usable(host: str | None) -> str | None:
    """``host`` without IPv6 brackets if it resolves here, else None (torchrun's ranks other
    than the first have no address in the cluster spec)."""
    if host is None:
        return None
    host = host.strip("[]")
    try:
        socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)
    except OSError:
        return None
    return host


def _local_address_towards(host: str, port: int) -> str:
    """This machine's address on the route to ``host`` (no packet is sent)."""
    family, _, _, _, address = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(address)
        return str(probe.getsockname()[0])


def read_exactly(sock: ssl.SSLSocket, nbytes: int) -> bytes:
    """``nbytes`` from ``sock`` (its own timeout applies).

    Raises:
        ConnectionError: The peer closed first.
    """
    data = bytearray()
    while len(data) < nbytes:
        chunk = sock.recv(nbytes - len(data))
        if not chunk:
            raise ConnectionError("closed before it said who it is")
        data += chunk
    return bytes(data)


class TlsEndpoint:
    """This worker's TLS identity and address, shared by every link it makes.

    Args:
        own_host: This task's host in the cluster spec; None or a name that does not resolve:
            the address on the route to ``chief`` (the peers then check the CA only).
        chief: ``(host, port)`` of the chief's store.
        token: The cluster token (the CA), or the site's certificate files (`task_certificate`).
    """

    def __init__(self, own_host: str | None, chief: tuple[str, int], token: str) -> None:
        host = _usable(own_host)
        self.check_names = host is not None  # else: the CA check only
        self.host = host if host is not None else _local_address_towards(*chief)
        cert = task_certificate(token, [self.host] if self.check_names else [])
        self.server_context, self._client_context = tls_contexts(cert)
        # a second client context that checks the peer's host name: dialling threads never
        # change a context another thread may be using
        _, self._naming_client_context = tls_contexts(cert)
        self._client_context.check_hostname = False
        self._naming_client_context.check_hostname = True

    def listen(self, store: Any, key: str) -> socket.socket:
        """A listener on this worker's address, published under ``key`` (its accepts wait
        `SLICE` seconds at a time)."""
        family, _, _, _, address = socket.getaddrinfo(self.host, 0, type=socket.SOCK_STREAM)[0]
        listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            listener.bind(address[:2] if family == socket.AF_INET else address)
            listener.listen(16)
            listener.settimeout(SLICE)
            store.set(key, f"{self.host}|{listener.getsockname()[1]}|{int(self.check_names)}")
        except BaseException:
            listener.close()
            raise
        return listener

    def dial(
        self,
        store: Any,
        key: str,
        hello: bytes,
        deadline: float,
        closed: threading.Event,
        peer: str,
        what: str,
    ) -> ssl.SSLSocket:
        """Connects to the worker that published its address under ``key``, as a TLS client,
        and sends ``hello`` (retries until it listens, up to ``deadline``).

        Args:
            peer: The worker's name, for errors; ``what``: the link ("the TLS ring").

        Raises:
            PeerGoneError: It could not be reached in time, or it failed the handshake (it
                does not hold this cluster's token or certificate).
        """
        while True:
            try:
                host, port, named = store.get(key).decode().rsplit("|", 2)
                raw = socket.create_connection(
                    (host, int(port)), timeout=max(deadline - time.monotonic(), 0.1)
                )
                break
            except (OSError, RuntimeError) as exc:  # not published, or not listening yet
                if time.monotonic() > deadline or closed.is_set():
                    raise PeerGoneError(f"{peer} could not be reached for {what} ({exc})") from exc
                time.sleep(0.05)
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        # the peer's certificate names its host when the cluster spec gave it one (it says so
        # in its sealed store entry); else the cluster CA is the whole check
        context = self._naming_client_context if named == "1" else self._client_context
        try:
            tls = context.wrap_socket(raw, server_hostname=host if named == "1" else None)
            tls.sendall(hello)
        except (OSError, ssl.SSLError) as exc:
            raw.close()
            raise PeerGoneError(
                f"{peer} failed the TLS handshake of {what} ({exc}): it does not hold this cluster's "
                "token or certificate"
            ) from exc
        tls.settimeout(SLICE)
        return tls

    def accept(self, raw: socket.socket, deadline: float) -> tuple[ssl.SSLSocket, int, bytes]:
        """The TLS side of an accepted connection and its hello: ``(connection, rank, tag)``.

        Raises:
            OSError, ssl.SSLError, struct.error: It failed the handshake or said nothing (the
                caller refuses it).
        """
        raw.settimeout(max(min(deadline - time.monotonic(), 10.0), 0.5))
        tls = self.server_context.wrap_socket(raw, server_side=True)
        try:
            rank, tag = HELLO.unpack(read_exactly(tls, HELLO.size))
        except BaseException:
            tls.close()
            raise
        tls.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        tls.settimeout(SLICE)
        return tls, rank, tag
