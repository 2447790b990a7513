"""Collectives over mutual-TLS connections: what MultiWorkerMirrored workers send between machines.

gloo's connections are plain TCP: anyone on the path between two workers reads every gradient
and can alter it, and torch's CPU builds of gloo carry no TLS transport. So when a job has a
cluster token (``PHALANX_CLUSTER_TOKEN``) and its workers are not all on one machine,
`WorkerGroup` sends its collectives — all-reduce, broadcast, all-gather — through a `TlsRing`
instead: every worker holds one TLS connection to the next worker (rank + 1) and one from the
previous, each authenticated both ways against the cluster CA that the token derives
(`phalanx.security.certificates`; or the site's own CA files), so a peer without the token
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

Every message is framed by (collective number, payload bytes, signature code); a frame that
does not match what this worker expects (workers calling different collectives) fails the
collective before any of its bytes reaches a tensor: with the job's `CollectiveCheck` report
naming both sides (this worker cuts its connections once its side is published, so the
neighbour blocked on it fails at once and joins the report), else with an error saying so.
Each blocking socket call waits in short slices and checks the group's health
and whether the ring was closed, so a collective never outlives its deadline in
`WorkerGroup.wait`; a peer that closes its connection fails it at once, naming that peer.

How the ring's connections are made and authenticated: `phalanx.communication.transports.tls.links`;
when the ring is used (``PHALANX_COLLECTIVES``): `phalanx.communication.transports.choice`.
"""

from __future__ import annotations

import contextlib
import queue
import socket
import ssl
import struct
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from phalanx.communication.checks.collective_check import UNCHECKED, Signed
from phalanx.communication.group.work import PeerGoneError, QueuedWork
from phalanx.communication.transports.base import CollectivesDifferError
from phalanx.communication.transports.tls.links import SLICE, RingLinks

__all__ = ["PIECE_BYTES", "CollectivesDifferError", "TlsRing"]

PIECE_BYTES = 1 << 20  # received, reduced and forwarded in pieces of this size
_FRAME = struct.Struct("!QQQ")  # collective number, payload bytes, signature code (0: unchecked)
_OPS: dict[Any, Callable[[torch.Tensor, torch.Tensor], Any]] = {
    dist.ReduceOp.SUM: lambda acc, x: acc.add_(x),
    dist.ReduceOp.PRODUCT: lambda acc, x: acc.mul_(x),
    dist.ReduceOp.MAX: lambda acc, x: torch.maximum(acc, x, out=acc),
    dist.ReduceOp.MIN: lambda acc, x: torch.minimum(acc, x, out=acc),
}


class _Frame:
    """What every frame of one collective carries: its number and its signature."""

    __slots__ = ("number", "signed")

    def __init__(self, number: int, signed: Signed) -> None:
        self.number, self.signed = number, signed


def _bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous tensor, shared with it (writable)."""
    return tensor.reshape(-1).view(torch.uint8).numpy().data.cast("B")


class TlsRing:
    """Ring collectives between the workers over mutual-TLS connections (see the module).

    Made by every worker at the same time, over its `RingLinks` (how it connects to the next
    worker and is connected by the previous one).

    Args:
        links: This worker's place in the ring, not yet connected.
        failure: The group's health: a reason once a peer is known dead (stops waits).
        timeout: Seconds to connect the ring (and for each TLS handshake within it).
        mismatch: ``mismatch(signed, peer, then)``: the error of a frame whose signature
            differs (`CollectiveCheck.mismatch`); None: `CollectivesDifferError`.

    Raises:
        PeerGoneError: A neighbour failed the TLS handshake or did not connect within
            ``timeout`` (named).
    """

    def __init__(
        self,
        links: RingLinks,
        failure: Callable[[], str | None],
        timeout: float,
        mismatch: Callable[..., BaseException] | None = None,
    ) -> None:
        self.rank, self.world_size = links.rank, links.world_size
        self.links = links  # its endpoint opens the job's other TLS links (`TlsTransport`)
        self._name, self._failure = links.name, failure
        self._next, self._prev = (self.rank + 1) % self.world_size, (self.rank - 1) % self.world_size
        self._closed = links.closed
        self._count = 0  # collectives issued (the frames' numbers)
        self._mismatch = mismatch
        self._send_sock, self._recv_sock = links.connect(timeout)
        self._outbox: queue.SimpleQueue[tuple[memoryview, QueuedWork] | None] = queue.SimpleQueue()
        self._inbox: queue.SimpleQueue[tuple[Callable[[_Frame], None], QueuedWork, _Frame] | None] = (
            queue.SimpleQueue()
        )
        self._threads = [
            threading.Thread(target=self._send_loop, name="phalanx-tls-send", daemon=True),
            threading.Thread(target=self._run_loop, name="phalanx-tls-ring", daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    # ---------------------------------------------------------------- collectives (all workers)
    def all_reduce_async(
        self, tensor: torch.Tensor, op: Any = dist.ReduceOp.SUM, signed: Signed = UNCHECKED
    ) -> QueuedWork:
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
        return self._issue("all_reduce", lambda n: self._all_reduce(tensor.view(-1), reduce, n), signed)

    def broadcast_async(self, tensor: torch.Tensor, src: int, signed: Signed = UNCHECKED) -> QueuedWork:
        """Starts an in-place broadcast of a contiguous tensor from worker ``src``."""
        return self._issue("broadcast", lambda n: self._broadcast(tensor.view(-1), src, n), signed)

    def all_gather_async(
        self, tensor: torch.Tensor, signed: Signed = UNCHECKED
    ) -> tuple[QueuedWork, list[torch.Tensor]]:
        """Starts gathering every worker's tensor (same shape and dtype everywhere): the work
        and the list, in rank order, that it fills."""
        out = [torch.empty_like(tensor) for _ in range(self.world_size)]
        out[self.rank].copy_(tensor)
        return self._issue("all_gather", lambda n: self._all_gather(out, n), signed), out

    def _issue(self, what: str, run: Callable[[_Frame], None], signed: Signed) -> QueuedWork:
        work = QueuedWork(f"TLS ring {what}")
        if self._closed.is_set():
            work.finish(RuntimeError("the TLS ring was closed"))
            return work
        self._count += 1
        self._inbox.put((run, work, _Frame(self._count, signed)))
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
        self, flat: torch.Tensor, reduce: Callable[[torch.Tensor, torch.Tensor], Any], number: _Frame
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

    def _broadcast(self, flat: torch.Tensor, src: int, number: _Frame) -> None:
        if self.rank == src:
            self._wait_sent(self._send(flat, number))
            return
        forward = self._next != src
        self._receive(flat.numel() * flat.element_size(), number, flat, forward=forward)

    def _all_gather(self, out: list[torch.Tensor], number: _Frame) -> None:
        n, r = self.world_size, self.rank
        for step in range(n - 1):
            sent = self._send(out[(r - step) % n], number)
            target = out[(r - step - 1) % n]
            self._receive(target.numel() * target.element_size(), number, target)
            self._wait_sent(sent)

    # ---------------------------------------------------------------- bytes
    def _send(self, tensor: torch.Tensor, number: _Frame) -> QueuedWork:
        """Queues a frame with ``tensor``'s bytes for the next worker (the caller keeps the
        tensor unchanged until `_wait_sent`)."""
        done = QueuedWork("TLS ring send")
        payload = _bytes(tensor.contiguous())
        self._outbox.put(
            (memoryview(_FRAME.pack(number.number, len(payload), number.signed.code)), QueuedWork())
        )
        self._outbox.put((payload, done))
        return done

    def _wait_sent(self, done: QueuedWork) -> None:
        while not done.done_within(SLICE):
            self._check("sending")
        done.wait()

    def _receive(
        self,
        nbytes: int,
        number: _Frame,
        into: torch.Tensor,
        target: torch.Tensor | None = None,
        reduce: Callable[[torch.Tensor, torch.Tensor], Any] | None = None,
        forward: bool = False,
    ) -> None:
        """Receives a frame of ``nbytes`` from the previous worker into ``into``, piece by
        piece; each piece is reduced into ``target`` (when given) or forwarded to the next
        worker as it arrives (``forward``)."""
        header = self._read(_FRAME.size)
        got_number, got_bytes, got_code = _FRAME.unpack(header)
        if (got_number, got_bytes, got_code) != (number.number, nbytes, number.signed.code):
            if self._mismatch is not None and number.signed.code:  # before any byte reaches a tensor
                # once this side is published, cut the connections: a neighbour blocked on
                # this worker fails at once and joins the report
                raise self._mismatch(number.signed, self._prev, self._cut)
            raise CollectivesDifferError(
                f"{self._name(self._prev)} sent {got_bytes} bytes for collective #{got_number} where this "
                f"worker expects {nbytes} bytes for collective #{number.number}: the workers called "
                "different collectives (or the same one with other shapes or dtypes)"
            )
        if forward:
            self._outbox.put((memoryview(header), QueuedWork()))
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

    def _cut(self) -> None:
        """Shuts both connections down (no more bytes either way), without closing the ring."""
        for sock in (self._send_sock, self._recv_sock):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

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
            thread.join(2 * SLICE + 1)
