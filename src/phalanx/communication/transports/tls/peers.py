"""Point-to-point TLS links between any two workers of a job: what carries ``send``/``recv``
(and a pipeline's activations and gradients) when the job's collectives go over the TLS ring.

Every worker listens on an address of its own from the start (published under
``tls-p2p/addr/<rank>`` in the job's store, `phalanx.communication.transports.tls.endpoint`),
and opens its link to a peer the first time it sends to it: one connection per direction of
each pair, authenticated as the ring's links are (mutual TLS against the cluster CA, then a
hello with the dialling worker's rank, checked by the accepting side; a stranger or an
impostor is refused and logged, and the listener goes on serving the real workers).

Each message is a frame (channel: the torch group, tag, payload bytes) and its payload. A
worker sends to each peer from one thread, in the order of its calls, so messages of one
channel and tag arrive in order; each incoming link has a thread that reads frames and hands
them to the `Mailbox`, which matches them with the posted receives by channel, sender and tag
(as gloo does). A send is done once its bytes are written (a message whose receive is not
posted yet waits in the receiver's memory). A peer that closes its link fails the receives
posted for it, naming it; a receive that nothing arrives for ends at the group's deadline
(`WorkerGroup.wait`), which names the peer it waited for.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from phalanx.communication.group.work import Lane, PeerGoneError, QueuedWork
from phalanx.communication.transports.tls.endpoint import HELLO, SLICE, TlsEndpoint, tag_bytes
from phalanx.communication.transports.tls.mailbox import Arrival, Mailbox, Receive

__all__ = ["PeerChannel", "TlsPeers", "channel_number"]

log = logging.getLogger("phalanx")

_TAG = "tls-p2p"
_FRAME = struct.Struct("!QqQ")  # channel, tag, payload bytes
_PIECE = 1 << 20  # bytes written per socket call


def channel_number(group_name: str) -> int:
    """The 64-bit number that stands for a torch group's name in frames (the same on every
    member)."""
    return int.from_bytes(hashlib.sha256(group_name.encode()).digest()[:8], "big")


def _bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous tensor, shared with it (writable)."""
    return tensor.reshape(-1).view(torch.uint8).numpy().data.cast("B")


class TlsPeers:
    """This worker's point-to-point links to every other worker (see the module doc).

    Made by every worker when the job's TLS transport opens (`open_tls_ring`); used through
    a `PeerChannel` per torch group.

    Args:
        endpoint: This worker's TLS identity and address.
        store: The job's rendezvous store (where the addresses are published).
        rank, world_size: This worker and the number of workers.
        task_name: ``task_name(rank) -> "worker:1 (host:port)"``, for messages.
        failure: The job's health: a reason once a peer is known dead (stops sends).
        connect_timeout: Seconds a first send waits for its link to open.
    """

    def __init__(
        self,
        endpoint: TlsEndpoint,
        store: Any,
        rank: int,
        world_size: int,
        task_name: Callable[[int], str],
        failure: Callable[[], str | None],
        connect_timeout: float,
    ) -> None:
        self.rank, self.world_size, self.name = rank, world_size, task_name
        self._endpoint, self._store = endpoint, store
        self._failure, self._connect_timeout = failure, connect_timeout
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._lanes: dict[int, Lane] = {}  # destination -> the thread that dials it and writes to it
        self._outgoing: dict[int, ssl.SSLSocket] = {}
        self._incoming: dict[int, ssl.SSLSocket] = {}
        self._mailbox = Mailbox(task_name)
        self._hello = HELLO.pack(rank, tag_bytes(_TAG))
        self._listener = endpoint.listen(store, f"{_TAG}/addr/{rank}")
        self._acceptor = threading.Thread(
            target=self._accept_loop, name="phalanx-tls-p2p-accept", daemon=True
        )
        self._acceptor.start()

    def channel(self, group_name: str, members: Sequence[int]) -> PeerChannel:
        """The links as a torch group sees them: ranks of the group, messages of its own."""
        return PeerChannel(self, channel_number(group_name), list(members))

    # ---------------------------------------------------------------- sending
    def send_async(self, tensor: torch.Tensor, dst: int, tag: int, channel: int) -> QueuedWork:
        """Queues ``tensor``'s bytes for worker ``dst`` (the caller keeps it unchanged until
        the work is done: written to the link, which opens on the first send).

        Raises:
            ValueError: ``dst`` is this worker or no worker.
        """
        self._check_peer(dst, "send to")
        payload = _bytes(tensor.detach().contiguous())
        with self._lock:
            lane = self._lanes.get(dst)
            if lane is None:
                lane = self._lanes[dst] = Lane(f"phalanx-tls-p2p-send-{dst}")
        header = _FRAME.pack(channel, tag, len(payload))
        return lane.submit(
            f"send to {self.name(dst)} with tag {tag}", lambda: self._write(dst, header, payload)
        )

    def _write(self, dst: int, header: bytes, payload: memoryview) -> None:
        """Writes one frame to ``dst`` (on its lane), dialling it the first time."""
        sock = self._outgoing.get(dst)
        if sock is None:
            sock = self._endpoint.dial(
                self._store,
                f"{_TAG}/addr/{dst}",
                self._hello,
                time.monotonic() + self._connect_timeout,
                self._closed,
                self.name(dst),
                "its point-to-point link",
            )
            with self._lock:
                if self._closed.is_set():
                    sock.close()
                    raise PeerGoneError("the point-to-point links were closed")
                self._outgoing[dst] = sock
        for view in (memoryview(header), payload):
            sent = 0
            while sent < len(view):
                try:
                    sent += sock.send(view[sent : sent + _PIECE])
                except TimeoutError:
                    self._check("sending to", dst)
                except (OSError, ssl.SSLError) as exc:
                    self._check("sending to", dst)
                    raise PeerGoneError(f"{self.name(dst)} broke its point-to-point link ({exc})") from exc

    def _check(self, doing: str, peer: int) -> None:
        if self._closed.is_set():
            raise PeerGoneError(f"the point-to-point links were closed while {doing} {self.name(peer)}")
        failure = self._failure()
        if failure is not None:
            raise PeerGoneError(failure)

    # ---------------------------------------------------------------- receiving
    def recv_async(
        self, tensor: torch.Tensor, src: int | None, tag: int, channel: int, what: str
    ) -> tuple[QueuedWork, Receive]:
        """Posts a receive into ``tensor`` (contiguous) from worker ``src`` (None: any) and
        returns its work and the `Receive` (whose ``sender`` says who sent it, once done).

        Raises:
            ValueError: ``src`` is this worker or no worker.
        """
        if src is not None:
            self._check_peer(src, "receive from")
        work = QueuedWork(what)
        receive = Receive(channel, src, tag, _bytes(tensor), work, what)
        self._mailbox.post(receive)
        return work, receive

    def _accept_loop(self) -> None:
        """Accepts links for as long as the job runs; each handshake on a thread of its own,
        so that a stranger that says nothing delays no worker."""
        while not self._closed.is_set():
            try:
                raw, peer = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return  # closed
            threading.Thread(target=self._admit, args=(raw, peer), daemon=True).start()

    def _admit(self, raw: socket.socket, peer: Any) -> None:
        """Authenticates an incoming link and starts reading it; refuses (and logs) anyone else."""
        try:
            tls, rank, tag = self._endpoint.accept(raw, time.monotonic() + self._connect_timeout)
        except (OSError, ssl.SSLError, struct.error) as exc:
            log.warning("A point-to-point TLS link refused a connection from %s: %s", peer, exc)
            raw.close()
            return
        with self._lock:
            known = rank in self._incoming
            valid = tag == tag_bytes(_TAG) and 0 <= rank < self.world_size and rank != self.rank
            if valid and not known and not self._closed.is_set():
                self._incoming[rank] = tls
        if not valid or known or self._closed.is_set():
            log.warning(
                "A point-to-point TLS link refused %s: it said it was rank %d%s",
                peer,
                rank,
                " (linked already)" if known else " of no link of this job",
            )
            tls.close()
            return
        threading.Thread(
            target=self._read_loop, args=(rank, tls), name=f"phalanx-tls-p2p-recv-{rank}", daemon=True
        ).start()

    def _read_loop(self, src: int, sock: ssl.SSLSocket) -> None:
        """Reads frames from worker ``src`` until it closes its link or the links close."""
        arrival: Arrival | None = None
        try:
            while True:
                header = bytearray(_FRAME.size)
                if not self._read_into(sock, memoryview(header), src, at_frame=True):
                    raise PeerGoneError(f"{self.name(src)} closed its point-to-point link")
                channel, tag, nbytes = _FRAME.unpack(header)
                buffer, arrival = self._mailbox.arrive(channel, src, tag, nbytes)
                self._read_into(sock, buffer, src, at_frame=False)
                if arrival is not None:
                    self._mailbox.filled(arrival)
                arrival = None
        except BaseException as exc:
            error = exc if isinstance(exc, PeerGoneError) else PeerGoneError(f"{self.name(src)}: {exc}")
            if arrival is not None:
                self._mailbox.filled(arrival, error)
            self._mailbox.sender_gone(src, error)

    def _read_into(self, sock: ssl.SSLSocket, view: memoryview, src: int, at_frame: bool) -> bool:
        """Fills ``view`` from ``src``'s link; False when it closed cleanly before a frame."""
        got = 0
        while got < len(view):
            try:
                n = sock.recv_into(view[got:], len(view) - got)
            except TimeoutError:
                if self._closed.is_set():
                    raise PeerGoneError("the point-to-point links were closed") from None
                continue
            except (OSError, ssl.SSLError) as exc:
                raise PeerGoneError(f"{self.name(src)} broke its point-to-point link ({exc})") from exc
            if n == 0:
                if at_frame and got == 0:
                    return False
                raise PeerGoneError(f"{self.name(src)} closed its point-to-point link mid-message")
            got += n
        return True

    def _check_peer(self, peer: int, doing: str) -> None:
        if not 0 <= peer < self.world_size or peer == self.rank:
            raise ValueError(
                f"A worker can {doing} another worker of the job (0..{self.world_size - 1} but not itself, "
                f"{self.rank}). Received: {peer}."
            )

    # ---------------------------------------------------------------- closing
    def close(self) -> None:
        """Closes every link and fails what still waits (never waits on a peer)."""
        if self._closed.is_set():
            return
        self._closed.set()
        with contextlib.suppress(OSError):
            self._listener.close()
        self._mailbox.close(PeerGoneError("the point-to-point links were closed"))
        with self._lock:
            lanes, socks = list(self._lanes.values()), [*self._outgoing.values(), *self._incoming.values()]
        for lane in lanes:
            lane.close(timeout=2 * SLICE + 1)
        for sock in socks:
            with contextlib.suppress(OSError):
                sock.close()


class PeerChannel:
    """`TlsPeers` as one torch group sees them: its ranks, and messages apart from every other
    group's (the same tag on two groups never meets).

    Args:
        peers: The job's links.
        channel: The group's number in frames (`channel_number` of its name).
        members: Each group rank's rank in the job.
    """

    def __init__(self, peers: TlsPeers, channel: int, members: list[int]) -> None:
        self._peers, self._channel, self._members = peers, channel, members
        self._group_rank = {job: group for group, job in enumerate(members)}

    def send_async(self, tensor: torch.Tensor, dst: int, tag: int) -> QueuedWork:
        """Sends ``tensor`` to the group's rank ``dst`` (see `TlsPeers.send_async`)."""
        return self._peers.send_async(tensor, self._job_rank(dst), tag, self._channel)

    def recv_async(
        self, tensor: torch.Tensor, src: int | None, tag: int
    ) -> tuple[QueuedWork, Callable[[], int]]:
        """Receives into ``tensor`` (contiguous) from the group's rank ``src`` (None: any):
        the work, and a function that says which group rank sent it (once done)."""
        job_src = None if src is None else self._job_rank(src)
        work, receive = self._peers.recv_async(
            tensor, job_src, tag, self._channel, self.describe("recv from", src, tag)
        )

        def sender() -> int:
            return -1 if receive.sender is None else self._group_rank[receive.sender]

        return work, sender

    def describe(self, doing: str, peer: int | None, tag: int) -> str:
        """``"recv from worker:1 (host:port) with tag 3"`` (``peer``: a group rank; None: any)."""
        who = "any worker" if peer is None else self._peers.name(self._job_rank(peer))
        return f"{doing} {who} with tag {tag}"

    def _job_rank(self, group_rank: int) -> int:
        if not 0 <= group_rank < len(self._members):
            raise ValueError(
                f"A point-to-point peer is a rank of the group (0..{len(self._members) - 1}). "
                f"Received: {group_rank}."
            )
        return self._members[group_rank]
