"""The two connections of one worker in a TLS ring (`phalanx.communication.transports.tls.ring`).

Every worker listens on its own address, publishes ``host|port|named`` under
``<tag>/addr/<rank>`` in the job's rendezvous store (sealed with the token's MAC, so no
outsider can redirect a worker), dials the next rank as a TLS client and accepts the previous
one as a TLS server, both sides presenting a certificate of the cluster CA and requiring the
peer's. The dialling side checks the server's certificate against the host it published when
the cluster spec gave that worker one (``named``); then sends a hello (its rank, the ring's
tag), which the accepting side checks. A connection that fails the handshake or says it is
someone else is refused and logged, and the listener is closed once the ring is made.
"""

from __future__ import annotations

import logging
import os
import socket
import ssl
import struct
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

from phalanx.communication.group.work import PeerGoneError
from phalanx.security.certificates import TaskCertificate, task_certificate

__all__ = ["SLICE", "RingLinks", "tls_contexts"]

log = logging.getLogger("phalanx")

SLICE = 0.25  # seconds each blocking socket call waits before it checks health and closing
_HELLO = struct.Struct("!Q32s")  # the dialling worker's rank, the ring's tag


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
    # no session tickets: the dialling side never reads its connection, and unread bytes would
    # make its close a reset that drops what it sent last
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


class RingLinks:
    """Connects this worker to the next and the previous one (all workers at once).

    Args:
        store: The job's rendezvous store.
        rank, world_size: This worker and the number of workers.
        own_host: This task's host in the cluster spec; None or a name that does not resolve:
            the address on the route to ``chief`` (the peers then check the CA only).
        chief: ``(host, port)`` of the chief's store.
        token: The cluster token (the CA), or the site's certificate files (`task_certificate`).
        task_name: ``task_name(rank) -> "worker:1 (host:port)"``, for messages.
        tag: Unique per ring of the job (its store keys and hello).
    """

    def __init__(
        self,
        store: Any,
        rank: int,
        world_size: int,
        own_host: str | None,
        chief: tuple[str, int],
        token: str,
        task_name: Callable[[int], str],
        tag: str = "tls-ring",
    ) -> None:
        self.rank, self.world_size, self.name = rank, world_size, task_name
        self._store, self._name = store, task_name
        self.closed = self._closed = threading.Event()  # set by the ring: stop connecting
        self._next, self._prev = (rank + 1) % world_size, (rank - 1) % world_size
        self._key = tag
        self._tag = tag.encode().ljust(32, b"\0")[:32]
        host = _usable(own_host)
        self._check_names = host is not None  # else: the CA check only
        self._host = host if host is not None else _local_address_towards(*chief)
        cert = task_certificate(token, [self._host] if self._check_names else [])
        self._server_context, self._client_context = tls_contexts(cert)

    def connect(self, timeout: float) -> tuple[ssl.SSLSocket, ssl.SSLSocket]:
        """(to the next worker, from the previous one), within ``timeout`` seconds.

        Raises:
            PeerGoneError: A neighbour failed the handshake or did not connect in time (named).
        """
        return self._connect(self._store, self._host, timeout)

    def _connect(self, store: Any, host: str, timeout: float) -> tuple[ssl.SSLSocket, ssl.SSLSocket]:
        family, _, _, _, address = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
        listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            listener.bind(address[:2] if family == socket.AF_INET else address)
            listener.listen(8)
            listener.settimeout(SLICE)
            store.set(
                f"{self._key}/addr/{self.rank}",
                f"{host}|{listener.getsockname()[1]}|{int(self._check_names)}",
            )
            accepted: list[ssl.SSLSocket] = []
            errors: list[BaseException] = []
            deadline = time.monotonic() + timeout
            acceptor = threading.Thread(
                target=self._accept_previous, args=(listener, deadline, accepted, errors), daemon=True
            )
            acceptor.start()
            try:
                outgoing = self._dial_next(store, deadline)
            finally:
                acceptor.join(max(deadline - time.monotonic(), 0) + 1)
            if not accepted:
                outgoing.close()
                if errors:
                    raise errors[0]
                raise PeerGoneError(
                    f"{self._name(self._prev)} did not open its TLS connection to this worker within "
                    f"{timeout:g}s"
                )
            return outgoing, accepted[0]
        finally:
            listener.close()  # nothing listens once the ring is made

    def _dial_next(self, store: Any, deadline: float) -> ssl.SSLSocket:
        """Connects to the next worker at the address it published, as a TLS client."""
        key = f"{self._key}/addr/{self._next}"
        while True:
            try:
                host, port, named = store.get(key).decode().rsplit("|", 2)
                raw = socket.create_connection(
                    (host, int(port)), timeout=max(deadline - time.monotonic(), 0.1)
                )
                break
            except (OSError, RuntimeError) as exc:  # not published, or not listening yet
                if time.monotonic() > deadline or self._closed.is_set():
                    raise PeerGoneError(
                        f"{self._name(self._next)} could not be reached for the TLS ring ({exc})"
                    ) from exc
                time.sleep(0.05)
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        # the peer's certificate names its host when the cluster spec gave it one (it says so
        # in its sealed store entry); else the cluster CA is the whole check
        self._client_context.check_hostname = named == "1"
        try:
            tls = self._client_context.wrap_socket(raw, server_hostname=host if named == "1" else None)
            tls.sendall(_HELLO.pack(self.rank, self._tag))
        except (OSError, ssl.SSLError) as exc:
            raw.close()
            raise PeerGoneError(
                f"{self._name(self._next)} failed the TLS handshake of the ring ({exc}): it does not hold "
                "this cluster's token or certificate"
            ) from exc
        tls.settimeout(SLICE)
        return tls

    def _accept_previous(
        self,
        listener: socket.socket,
        deadline: float,
        accepted: list[ssl.SSLSocket],
        errors: list[BaseException],
    ) -> None:
        """Accepts the previous worker; refuses (and logs) anyone else until the deadline."""
        while time.monotonic() < deadline and not self._closed.is_set():
            try:
                raw, peer = listener.accept()
            except TimeoutError:
                continue
            except OSError as exc:
                errors.append(exc)
                return
            raw.settimeout(max(min(deadline - time.monotonic(), 10.0), 0.5))
            try:
                tls = self._server_context.wrap_socket(raw, server_side=True)
                rank, tag = _HELLO.unpack(_read_exactly(tls, _HELLO.size))
            except (OSError, ssl.SSLError, struct.error) as exc:
                log.warning("The TLS ring refused a connection from %s: %s", peer, exc)
                raw.close()
                continue
            if rank != self._prev or tag != self._tag:
                log.warning("The TLS ring refused %s: it said it was rank %d of another ring", peer, rank)
                tls.close()
                continue
            tls.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            tls.settimeout(SLICE)
            accepted.append(tls)
            return


def _read_exactly(sock: ssl.SSLSocket, nbytes: int) -> bytes:
    data = bytearray()
    while len(data) < nbytes:
        chunk = sock.recv(nbytes - len(data))
        if not chunk:
            raise ConnectionError("closed before it said who it is")
        data += chunk
    return bytes(data)
