"""Collectives over mutual-TLS connections: what MultiWorkerMirrored workers send between machines.

gloo's connections are plain TCP: anyone on the path between two workers reads every gradient
and can alter it, and torch's CPU builds of gloo carry no TLS transport. So when a job has a
cluster token (``PHALANX_CLUSTER_TOKEN``) and its workers are not all on one machine,
`WorkerGroup` sends its collectives — all-reduce, broadcast, all-gather — through a `TlsRing`
instead: every worker holds one TLS connection to the next worker (rank + 1) and one from the
previous, each authenticated both ways against the cluster CA that the token derives
(`phalanx.cluster._certificates`; or the site's own CA files), so a peer without the token
fails the handshake before it can send a byte, the token never travels, and what travels is
encrypted and integrity-protected by TLS.

Algorithms, for ``n`` workers (every worker runs the same collectives in the same order, on
this transport's one thread):

* **all-reduce**: ring reduce-scatter then ring all-gather (``2 (n - 1)`` steps, each worker
  sends ``2 (n - 1) / n`` of the tensor); segment ``s`` is reduced along the ring in a fixed
  order starting after worker ``s``, so every worker ends with the same bits;
* **broadcast**: the source's tensor travels the ring in 1 MiB pieces, each forwarded as it
  arrives (a pipeline);
* **all-gather**: ``n - 1`` steps, each worker forwarding the piece it received last.

Every message is framed by (collective number, payload bytes); a frame that does not match
what this worker expects (workers calling different collectives) fails the collective with an
error saying so. Each blocking socket call waits in short slices and checks the group's health
and whether the ring was closed, so a collective never outlives its deadline in
`WorkerGroup.wait`; a peer that closes its connection fails it at once, naming that peer.

``PHALANX_COLLECTIVES`` chooses: ``auto`` (the default: TLS when the token is set and the
workers span machines; gloo on one machine, whose traffic never leaves the kernel), ``tls``
(always, e.g. to test it on one machine) or ``gloo`` (plaintext; logged, as
``PHALANX_INSECURE_TRANSPORT=1``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import socket
import ssl
import struct
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from phalanx.cluster._certificates import TaskCertificate, task_certificate
from phalanx.communication._work import PeerGoneError, QueuedWork

__all__ = [
    "COLLECTIVES_ENV",
    "CollectivesDifferError",
    "PIECE_BYTES",
    "TlsRing",
    "check_settings",
    "collectives_mode",
    "ring_if_needed",
]

log = logging.getLogger("phalanx")

COLLECTIVES_ENV = "PHALANX_COLLECTIVES"
PIECE_BYTES = 1 << 20  # received, reduced and forwarded in pieces of this size
_SLICE = 0.25  # seconds each blocking socket call waits before it checks health and closing
_FRAME = struct.Struct("!QQ")  # collective number, payload bytes
_HELLO = struct.Struct("!Q32s")  # the connecting worker's rank, the ring's tag (hashed)
_OPS: dict[Any, Callable[[torch.Tensor, torch.Tensor], Any]] = {
    dist.ReduceOp.SUM: lambda acc, x: acc.add_(x),
    dist.ReduceOp.PRODUCT: lambda acc, x: acc.mul_(x),
    dist.ReduceOp.MAX: lambda acc, x: torch.maximum(acc, x, out=acc),
    dist.ReduceOp.MIN: lambda acc, x: torch.minimum(acc, x, out=acc),
}


class CollectivesDifferError(PeerGoneError):
    """The previous worker sent a frame of another collective (or size) than this one's."""


def collectives_mode() -> str:
    """``PHALANX_COLLECTIVES``: "auto" (default), "tls" or "gloo".

    Raises:
        ValueError: Another value (a typo must not silently drop TLS).
    """
    text = os.environ.get(COLLECTIVES_ENV, "").strip().lower() or "auto"
    if text not in ("auto", "tls", "gloo"):
        raise ValueError(
            f"{COLLECTIVES_ENV} must be auto, tls or gloo. Received: {COLLECTIVES_ENV}={text!r}. HINT: "
            "unset it (auto: TLS between machines when PHALANX_CLUSTER_TOKEN is set); see docs/security.md."
        )
    return text


def _contexts(cert: TaskCertificate) -> tuple[ssl.SSLContext, ssl.SSLContext]:
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


def _bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous tensor, shared with it (writable)."""
    return tensor.reshape(-1).view(torch.uint8).numpy().data.cast("B")


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


class TlsRing:
    """Ring collectives between the workers over mutual-TLS connections (see the module).

    Made by every worker at the same time: each listens on its own address, publishes it in
    the job's (authenticated) rendezvous store, connects to the next worker and accepts the
    previous one, then stops listening.

    Args:
        store: The job's rendezvous store (an `AuthenticatedStore`: the addresses are sealed).
        rank, world_size: This worker and the number of workers.
        own_host: This task's host in the cluster spec (its certificate names it and peers
            check it); None or a name that does not resolve: the address on the route to
            ``chief`` (the CA check only).
        chief: ``(host, port)`` of the chief's store, to find ``own_host`` when it is None.
        token: The cluster token (the CA), or the site's certificate files (`task_certificate`).
        task_name: ``task_name(rank) -> "worker:1 (host:port)"``, for messages.
        failure: The group's health: a reason once a peer is known dead (stops waits).
        timeout: Seconds to connect the ring (and for each TLS handshake within it).
        tag: Unique per ring of the job (its store keys).

    Raises:
        PeerUnavailableError-like `PeerGoneError`: a neighbour did not connect within ``timeout``.
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
        failure: Callable[[], str | None],
        timeout: float,
        tag: str = "tls-ring",
    ) -> None:
        self.rank, self.world_size = rank, world_size
        self._name, self._failure = task_name, failure
        self._next, self._prev = (rank + 1) % world_size, (rank - 1) % world_size
        self._key = tag  # store keys: <tag>/addr/<rank>
        self._tag = tag.encode().ljust(32, b"\0")[:32]
        self._closed = threading.Event()
        self._count = 0  # collectives issued (the frames' numbers)
        host = _usable(own_host)
        self._check_names = host is not None  # else: the CA check only
        if host is None:
            host = _local_address_towards(*chief)
        cert = task_certificate(token, [host] if self._check_names else [])
        self._server_context, self._client_context = _contexts(cert)
        self._send_sock, self._recv_sock = self._connect(store, host, timeout)
        self._outbox: queue.SimpleQueue[tuple[memoryview, QueuedWork] | None] = queue.SimpleQueue()
        self._inbox: queue.SimpleQueue[tuple[Callable[[int], None], QueuedWork, int] | None] = (
            queue.SimpleQueue()
        )
        self._threads = [
            threading.Thread(target=self._send_loop, name="phalanx-tls-send", daemon=True),
            threading.Thread(target=self._run_loop, name="phalanx-tls-ring", daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    # ---------------------------------------------------------------- connecting (all workers)
    def _connect(self, store: Any, host: str, timeout: float) -> tuple[ssl.SSLSocket, ssl.SSLSocket]:
        family, _, _, _, address = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
        listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            listener.bind(address[:2] if family == socket.AF_INET else address)
            listener.listen(8)
            listener.settimeout(_SLICE)
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
        tls.settimeout(_SLICE)
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
            tls.settimeout(_SLICE)
            accepted.append(tls)
            return

    # ---------------------------------------------------------------- collectives (all workers)
    def all_reduce_async(self, tensor: torch.Tensor, op: Any = dist.ReduceOp.SUM) -> QueuedWork:
        """Starts an in-place all-reduce of a contiguous tensor (all workers, same order).

        Raises:
            ValueError: An operation other than SUM, PRODUCT, MAX or MIN.
        """
        reduce = _OPS.get(op)
        if reduce is None:
            raise ValueError(
                f"The TLS ring reduces with SUM, PRODUCT, MAX or MIN. Received: {op}. HINT: all-reduce "
                "with SUM and divide for a mean."
            )
        return self._issue("all_reduce", lambda n: self._all_reduce(tensor.view(-1), reduce, n))

    def broadcast_async(self, tensor: torch.Tensor, src: int) -> QueuedWork:
        """Starts an in-place broadcast of a contiguous tensor from worker ``src``."""
        return self._issue("broadcast", lambda n: self._broadcast(tensor.view(-1), src, n))

    def all_gather_async(self, tensor: torch.Tensor) -> tuple[QueuedWork, list[torch.Tensor]]:
        """Starts gathering every worker's tensor (same shape and dtype everywhere): the work
        and the list, in rank order, that it fills."""
        out = [torch.empty_like(tensor) for _ in range(self.world_size)]
        out[self.rank].copy_(tensor)
        return self._issue("all_gather", lambda n: self._all_gather(out, n)), out

    def _issue(self, what: str, run: Callable[[int], None]) -> QueuedWork:
        work = QueuedWork(f"TLS ring {what}")
        if self._closed.is_set():
            work.finish(RuntimeError("the TLS ring was closed"))
            return work
        self._count += 1
        self._inbox.put((run, work, self._count))
        return work

    def _run_loop(self) -> None:
        broken: BaseException | None = None
        while True:
            item = self._inbox.get()
            if item is None:
                return
            run, work, number = item
            if broken is not None:
                work.finish(broken)
                continue
            try:
                run(number)
            except BaseException as exc:  # every later collective fails the same way
                broken = exc
                work.finish(exc)
            else:
                work.finish()

    def _segments(self, flat: torch.Tensor) -> list[torch.Tensor]:
        n = self.world_size
        bounds = [flat.numel() * i // n for i in range(n + 1)]
        return [flat[bounds[i] : bounds[i + 1]] for i in range(n)]

    def _all_reduce(
        self, flat: torch.Tensor, reduce: Callable[[torch.Tensor, torch.Tensor], Any], number: int
    ) -> None:
        n, r = self.world_size, self.rank
        segments = self._segments(flat)
        scratch = torch.empty(max(s.numel() for s in segments), dtype=flat.dtype)
        for step in range(n - 1):  # reduce-scatter: segment (r - step - 1) gains this worker's part
            sent = self._send(segments[(r - step) % n], number)
            target = segments[(r - step - 1) % n]
            received = scratch[: target.numel()]
            self._receive(target.numel() * target.element_size(), number, received, target, reduce)
            self._wait_sent(sent)
        for step in range(n - 1):  # all-gather: this worker holds segment (r + 1) reduced
            sent = self._send(segments[(r + 1 - step) % n], number)
            target = segments[(r - step) % n]
            self._receive(target.numel() * target.element_size(), number, target)
            self._wait_sent(sent)

    def _broadcast(self, flat: torch.Tensor, src: int, number: int) -> None:
        if self.rank == src:
            self._wait_sent(self._send(flat, number))
            return
        forward = self._next != src
        self._receive(flat.numel() * flat.element_size(), number, flat, forward=forward)

    def _all_gather(self, out: list[torch.Tensor], number: int) -> None:
        n, r = self.world_size, self.rank
        for step in range(n - 1):
            sent = self._send(out[(r - step) % n], number)
            target = out[(r - step - 1) % n]
            self._receive(target.numel() * target.element_size(), number, target)
            self._wait_sent(sent)

    # ---------------------------------------------------------------- bytes
    def _send(self, tensor: torch.Tensor, number: int) -> QueuedWork:
        """Queues a frame with ``tensor``'s bytes for the next worker (the caller keeps the
        tensor unchanged until `_wait_sent`)."""
        done = QueuedWork("TLS ring send")
        payload = _bytes(tensor.contiguous())
        self._outbox.put((memoryview(_FRAME.pack(number, len(payload))), QueuedWork()))
        self._outbox.put((payload, done))
        return done

    def _wait_sent(self, done: QueuedWork) -> None:
        while not done.is_completed():
            self._check("sending")
            done._done.wait(_SLICE)
        done.wait()

    def _receive(
        self,
        nbytes: int,
        number: int,
        into: torch.Tensor,
        target: torch.Tensor | None = None,
        reduce: Callable[[torch.Tensor, torch.Tensor], Any] | None = None,
        forward: bool = False,
    ) -> None:
        """Receives a frame of ``nbytes`` from the previous worker into ``into``, piece by
        piece; each piece is reduced into ``target`` (when given) or forwarded to the next
        worker as it arrives (``forward``)."""
        header = self._read(_FRAME.size)
        got_number, got_bytes = _FRAME.unpack(header)
        if (got_number, got_bytes) != (number, nbytes):
            raise CollectivesDifferError(
                f"{self._name(self._prev)} sent {got_bytes} bytes for collective #{got_number} where this "
                f"worker expects {nbytes} bytes for collective #{number}: the workers called different "
                "collectives (or the same one with other shapes or dtypes)"
            )
        if forward:
            self._outbox.put((memoryview(_FRAME.pack(number, nbytes)), QueuedWork()))
        buffer = _bytes(into)
        item = max(into.element_size(), 1)
        piece = max(PIECE_BYTES // item, 1) * item
        last: QueuedWork | None = None
        for start in range(0, nbytes, piece):
            stop = min(start + piece, nbytes)
            self._read_into(buffer[start:stop])
            if target is not None and reduce is not None:
                reduce(target[start // item : stop // item], into[start // item : stop // item])
            if forward:
                last = QueuedWork("TLS ring forward")
                self._outbox.put((buffer[start:stop], last))
        if last is not None:
            self._wait_sent(last)

    def _read(self, nbytes: int) -> bytes:
        data = bytearray(nbytes)
        self._read_into(memoryview(data))
        return bytes(data)

    def _read_into(self, view: memoryview) -> None:
        got = 0
        while got < len(view):
            try:
                n = self._recv_sock.recv_into(view[got:], len(view) - got)
            except TimeoutError:
                self._check("receiving")
                continue
            except (OSError, ssl.SSLError) as exc:
                self._check("receiving")
                raise PeerGoneError(f"{self._name(self._prev)} broke its TLS connection ({exc})") from exc
            if n == 0:
                self._check("receiving")
                raise PeerGoneError(f"{self._name(self._prev)} closed its connection")
            got += n

    def _send_loop(self) -> None:
        broken: BaseException | None = None
        while True:
            item = self._outbox.get()
            if item is None:
                return
            view, done = item
            if broken is None:
                try:
                    self._write(view)
                except BaseException as exc:
                    broken = exc
            done.finish(broken)

    def _write(self, view: memoryview) -> None:
        sent = 0
        while sent < len(view):
            try:
                sent += self._send_sock.send(view[sent : sent + PIECE_BYTES])
            except TimeoutError:
                self._check("sending")
            except (OSError, ssl.SSLError) as exc:
                self._check("sending")
                raise PeerGoneError(f"{self._name(self._next)} broke its TLS connection ({exc})") from exc

    def _check(self, doing: str) -> None:
        """Raises if the ring was closed or the group knows a peer is dead."""
        if self._closed.is_set():
            raise PeerGoneError(f"the TLS ring was closed while {doing}")
        failure = self._failure()
        if failure is not None:
            raise PeerGoneError(failure)

    # ---------------------------------------------------------------- closing
    def close(self) -> None:
        """Stops both threads and closes the connections (never waits on a peer)."""
        if self._closed.is_set():
            return
        self._closed.set()
        self._inbox.put(None)
        self._outbox.put(None)
        for sock in (self._send_sock, self._recv_sock):
            with contextlib.suppress(OSError):
                sock.close()
        for thread in self._threads:
            thread.join(2 * _SLICE + 1)


def _read_exactly(sock: ssl.SSLSocket, nbytes: int) -> bytes:
    data = bytearray()
    while len(data) < nbytes:
        chunk = sock.recv(nbytes - len(data))
        if not chunk:
            raise ConnectionError("closed before it said who it is")
        data += chunk
    return bytes(data)


def check_settings() -> None:
    """Refuses collective settings that cannot work, before a job opens anything.

    Raises:
        ValueError: ``PHALANX_COLLECTIVES`` is unknown, or asks for TLS without a token.
    """
    from phalanx.cluster._token import TOKEN_ENV

    if collectives_mode() == "tls" and not os.environ.get(TOKEN_ENV, ""):
        raise ValueError(
            f"{COLLECTIVES_ENV}=tls needs {TOKEN_ENV}: the TLS certificates derive from it. Received: "
            f"{TOKEN_ENV} unset. HINT: export the same secret on every task (docs/security.md)."
        )


def ring_if_needed(
    store: Any,
    rank: int,
    world_size: int,
    own_host: str | None,
    chief: tuple[str, int],
    same_machine: bool,
    task_name: Callable[[int], str],
    failure: Callable[[], str | None],
    timeout: float,
) -> TlsRing | None:
    """The job's TLS ring when its collectives need one (all workers; see the module's
    ``PHALANX_COLLECTIVES``); None: they go through gloo (and shared memory).

    Raises:
        ValueError: ``PHALANX_COLLECTIVES`` is unknown, or asks for TLS without a token.
        PeerGoneError: A neighbour did not join the ring within ``timeout``.
    """
    from phalanx.cluster._token import TOKEN_ENV
    from phalanx.ps.channel_security import INSECURE_ENV, insecure_transport

    check_settings()
    if world_size == 1:
        return None
    mode, token = collectives_mode(), os.environ.get(TOKEN_ENV, "")
    if mode == "gloo" or insecure_transport():
        if not same_machine and rank == 0:
            log.warning(
                "MultiWorkerMirrored collectives travel between machines in PLAINTEXT gloo (%s): anyone "
                "on the path can read and alter the gradients. Use it only on a network where every host "
                "is trusted (docs/security.md).",
                f"{COLLECTIVES_ENV}=gloo" if mode == "gloo" else f"{INSECURE_ENV}=1",
            )
        return None
    if not token:
        if not same_machine and rank == 0:
            log.warning(
                "MultiWorkerMirrored collectives travel between machines in PLAINTEXT gloo: %s is unset. "
                "Set it to the same secret on every task and they go over mutual TLS (docs/security.md).",
                TOKEN_ENV,
            )
        return None
    if mode == "auto" and same_machine:
        return None
    ring = TlsRing(store, rank, world_size, own_host, chief, token, task_name, failure, timeout)
    if rank == 0:
        log.info("MultiWorkerMirrored collectives go over mutual TLS between the %d workers.", world_size)
    return ring
