"""The two connections of one worker in a TLS ring (`phalanx.communication.transports.tls.ring`).

Every worker of the ring listens on its own address, publishes it under ``<tag>/addr/<rank>``
in the ring's rendezvous store, dials the next rank as a TLS client and accepts the previous
one as a TLS server (`phalanx.communication.transports.tls.endpoint`: the certificates, the
hello and the checks). A connection that fails the handshake or says it is someone else is
refused and logged, and the listener is closed once the ring is made.
"""

from __future__ import annotations

import logging
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

from phalanx.communication.group.work import PeerGoneError
from phalanx.communication.transports.tls.endpoint import HELLO, SLICE, TlsEndpoint, tag_bytes, tls_contexts

__all__ = ["SLICE", "RingLinks", "tls_contexts"]

log = logging.getLogger("phalanx")


class RingLinks:
    """Connects this worker to the next and the previous one (all workers of the ring at once).

    Args:
        store: The ring's rendezvous store (the job's, or a torch group's).
        rank, world_size: This worker's place in the ring and the ring's size.
        endpoint: This worker's TLS identity and address.
        task_name: ``task_name(rank) -> "worker:1 (host:port)"`` (ranks of the ring), for messages.
        tag: Unique per ring of one store (its store keys and hello).
    """

    def __init__(
        self,
        store: Any,
        rank: int,
        world_size: int,
        endpoint: TlsEndpoint,
        task_name: Callable[[int], str],
        tag: str = "tls-ring",
    ) -> None:
        self.rank, self.world_size, self.name = rank, world_size, task_name
        self.endpoint = endpoint
        self._store, self._name = store, task_name
        self.closed = self._closed = threading.Event()  # set by the ring: stop connecting
        self._next, self._prev = (rank + 1) % world_size, (rank - 1) % world_size
        self._key = tag
        self._tag = tag_bytes(tag)

    def connect(self, timeout: float) -> tuple[ssl.SSLSocket, ssl.SSLSocket]:
        """(to the next worker, from the previous one), within ``timeout`` seconds.

        Raises:
            PeerGoneError: A neighbour failed the handshake or did not connect in time (named).
        """
        listener = self.endpoint.listen(self._store, f"{self._key}/addr/{self.rank}")
        try:
            accepted: list[ssl.SSLSocket] = []
            errors: list[BaseException] = []
            deadline = time.monotonic() + timeout
            acceptor = threading.Thread(
                target=self._accept_previous, args=(listener, deadline, accepted, errors), daemon=True
            )
            acceptor.start()
            try:
                outgoing = self.endpoint.dial(
                    self._store,
                    f"{self._key}/addr/{self._next}",
                    HELLO.pack(self.rank, self._tag),
                    deadline,
                    self._closed,
                    self._name(self._next),
                    "the TLS ring",
                )
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
            try:
                tls, rank, tag = self.endpoint.accept(raw, deadline)
            except (OSError, ssl.SSLError, struct.error) as exc:
                log.warning("The TLS ring refused a connection from %s: %s", peer, exc)
                raw.close()
                continue
            if rank != self._prev or tag != self._tag:
                log.warning("The TLS ring refused %s: it said it was rank %d of another ring", peer, rank)
                tls.close()
                continue
            accepted.append(tls)
            return
