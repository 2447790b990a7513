"""Which receive a point-to-point message is for (`phalanx.communication.transports.tls.peers`).

Matching as torch's gloo does it: a message goes to the first receive posted for its
channel (the torch group), its sender (or any sender) and its tag; messages of one sender,
channel and tag arrive in the order they were sent, and a message whose receive is not
posted yet waits here, in memory, until it is. Sizes must agree: a receive of another
size fails, naming the sender, and the message is dropped.

The reading thread of each incoming link calls `arrive` when a frame's header is in (and
fills the returned buffer before calling `filled`); the caller's thread calls `post`. A
message is read straight into the receiving tensor when its receive was posted first.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

from phalanx.communication.group.work import QueuedWork

__all__ = ["Arrival", "Mailbox", "Receive"]


@dataclass(eq=False)
class Receive:
    """A posted receive: where its bytes go, and its work (``source`` set once matched).

    Attributes:
        channel, source, tag: What it matches (``source`` None: any sender).
        into: The receiving tensor's bytes (contiguous).
        work: Finished once the bytes are in (or with the error).
        what: The receive, for errors (``"recv from worker:1 (...) with tag 3"``).
    """

    channel: int
    source: int | None
    tag: int
    into: memoryview
    work: QueuedWork
    what: str
    sender: int | None = None  # who sent what it got


@dataclass(eq=False)
class Arrival:
    """A message whose header arrived: the buffer its payload is read into and, once one is
    posted, the receive that takes it."""

    channel: int
    source: int
    tag: int
    buffer: memoryview
    taker: Receive | None = None
    ready: bool = False


class Mailbox:
    """The posted receives and the messages nobody received yet, of one worker (thread-safe).

    Args:
        name: ``name(rank) -> "worker:1 (host:port)"``, for errors.
    """

    def __init__(self, name: Callable[[int], str]) -> None:
        self._name = name
        self._lock = threading.Lock()
        self._posted: list[Receive] = []
        self._arrived: list[Arrival] = []
        self._broken: dict[int, BaseException] = {}  # sender -> why nothing more comes from it
        self._closed: BaseException | None = None

    def post(self, receive: Receive) -> None:
        """Matches ``receive`` with the first message that arrived for it, or keeps it until
        one does (its work finishes then); fails it at once when its sender is gone."""
        with self._lock:
            arrival = next((a for a in self._arrived if _matches(receive, a)), None)
            if arrival is None:
                gone = self._closed or (None if receive.source is None else self._broken.get(receive.source))
                if gone is None:
                    self._posted.append(receive)
                    return
            else:
                self._arrived.remove(arrival)
                receive.sender = arrival.source
                if not arrival.ready:  # its reader delivers it once the payload is in
                    arrival.taker = receive
                    return
        if arrival is None:
            receive.work.finish(gone)
        else:
            self._deliver(arrival, receive)

    def arrive(self, channel: int, source: int, tag: int, nbytes: int) -> tuple[memoryview, Arrival | None]:
        """A message's header arrived: the buffer to read its ``nbytes`` into, and the
        `Arrival` to pass to `filled` once read (None: it went straight into the receive
        posted for it, which is finished then, or it is dropped)."""
        with self._lock:
            receive = next((r for r in self._posted if _matches(r, _Key(channel, source, tag))), None)
            if receive is None:
                arrival = Arrival(channel, source, tag, memoryview(bytearray(nbytes)))
                self._arrived.append(arrival)
                return arrival.buffer, arrival
            self._posted.remove(receive)
            receive.sender = source
        if len(receive.into) == nbytes:
            arrival = Arrival(channel, source, tag, receive.into, taker=receive)
            return receive.into, arrival
        receive.work.finish(self._size_error(receive, source, nbytes))
        return memoryview(bytearray(nbytes)), None  # read and dropped: the stream stays in step

    def filled(self, arrival: Arrival, error: BaseException | None = None) -> None:
        """The payload of ``arrival`` is in (``error``: its sender broke off while it was
        read): delivers it to its receive, if one took it (or fails that receive)."""
        with self._lock:
            arrival.ready = error is None
            if error is not None and arrival in self._arrived:
                self._arrived.remove(arrival)
            receive = arrival.taker
        if receive is None:
            return
        if error is not None:
            receive.work.finish(error)
        else:
            self._deliver(arrival, receive)

    def sender_gone(self, source: int, error: BaseException) -> None:
        """Nothing more comes from ``source``: its posted receives fail with ``error``, and so
        do later ones (messages it sent before stay deliverable)."""
        with self._lock:
            self._broken.setdefault(source, error)
            failing = [r for r in self._posted if r.source == source]
            self._posted = [r for r in self._posted if r.source != source]
            unread = [a for a in self._arrived if a.source == source and not a.ready]
            self._arrived = [a for a in self._arrived if a not in unread]
        for receive in failing:
            receive.work.finish(error)

    def close(self, error: BaseException) -> None:
        """Fails every posted receive, and every later one, with ``error``."""
        with self._lock:
            self._closed = error
            failing, self._posted = self._posted, []
            self._arrived = []
        for receive in failing:
            receive.work.finish(error)

    def _deliver(self, arrival: Arrival, receive: Receive) -> None:
        if arrival.buffer is not receive.into:
            if len(arrival.buffer) != len(receive.into):
                receive.work.finish(self._size_error(receive, arrival.source, len(arrival.buffer)))
                return
            receive.into[:] = arrival.buffer
        receive.work.finish()

    def _size_error(self, receive: Receive, source: int, nbytes: int) -> ValueError:
        return ValueError(
            f"{receive.what}: {self._name(source)} sent {nbytes} bytes where this worker receives "
            f"{len(receive.into)}. HINT: receive into a tensor of the shape and dtype that was sent."
        )


@dataclass(frozen=True)
class _Key:
    channel: int
    source: int
    tag: int


def _matches(receive: Receive, message: Arrival | _Key) -> bool:
    return (
        receive.channel == message.channel
        and receive.tag == message.tag
        and (receive.source is None or receive.source == message.source)
    )
