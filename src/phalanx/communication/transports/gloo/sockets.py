"""The connections of one elastic group's gloo process group, so that dropping the group ends
what is still in flight on them (`GroupSockets`).

Why: torch's ``ProcessGroupGloo.abort()`` and ``shutdown()`` leave a collective already in
flight waiting (measured on torch 2.13: the wait ends only when the peer's socket closes, or
after the group's timeout, 600 s by default). When an elastic job re-forms, every survivor
drops its group while some of its gloo collectives may still wait on another survivor, whose
sockets stay open because it dropped its group too (a live process that moved on). Two
things then went wrong:

* a survivor that destroyed its old group blocked in gloo's destructor, which joins the
  threads running those collectives: each survivor waited on the other until gloo's timeout
  (the members froze for 600 s, and a joiner was never admitted);
* at the end of the job such a collective failed only when its peer exited, while this
  process was already finalizing; its completion ran a Python callback (the announcement of
  the gradient all-reduces), and a thread that takes the GIL during finalization is ended with
  ``pthread_exit``, whose unwinding through gloo's ``noexcept`` frames aborts the process:
  ``terminate called without an active exception`` (SIGABRT) after a clean finish.

`GroupSockets` records the TCP connections that making the group opened (not its listening
socket: gloo aborts when that one is shut down, nor the connections to the store), and
`shut_down` shuts them down (``shutdown(2)``: the descriptors stay gloo's to close). Every
collective in flight on them fails at once, here and on the peers, while the interpreter runs.
Linux only (``/proc/self/fd``); elsewhere nothing is recorded and the group is dropped as before.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Callable, Iterable
from typing import TypeVar

__all__ = ["GroupSockets", "open_sockets"]

T = TypeVar("T")
_FDS = "/proc/self/fd"


def open_sockets() -> dict[int, str]:
    """This process's socket descriptors: ``{fd: "socket:[inode]"}`` (empty where unknown)."""
    found: dict[int, str] = {}
    try:
        names = os.listdir(_FDS)
    except OSError:
        return found
    for name in names:
        with contextlib.suppress(OSError, ValueError):
            link = os.readlink(f"{_FDS}/{name}")
            if link.startswith("socket:["):
                found[int(name)] = link
    return found


def _ends(fd: int) -> tuple[tuple[str, int], tuple[str, int]] | None:
    """(this end, the peer's end) of a connected TCP socket, else None (listening, not TCP)."""
    try:
        sock = socket.socket(fileno=os.dup(fd))
    except OSError:
        return None
    try:
        if sock.family not in (socket.AF_INET, socket.AF_INET6) or sock.type != socket.SOCK_STREAM:
            return None
        peer, own = sock.getpeername(), sock.getsockname()
        return (str(own[0]), int(own[1])), (str(peer[0]), int(peer[1]))
    except OSError:  # not connected: gloo's listener
        return None
    finally:
        sock.close()


def _addresses(host: str) -> set[str]:
    """Every address ``host`` resolves to (``host`` itself if it does not resolve)."""
    try:
        return {str(info[4][0]) for info in socket.getaddrinfo(host, None)} | {host}
    except OSError:
        return {host}


class GroupSockets:
    """The connections one group opened (see the module doc).

    Args:
        store: ``(host, port)`` of the rendezvous store: connections to it are not the group's.
    """

    def __init__(self, store: tuple[str, int]) -> None:
        self._store_hosts, self._store_port = _addresses(store[0]), store[1]
        self.connections: list[tuple[int, str]] = []  # (fd, "socket:[inode]")

    def record(self, make: Callable[[], T]) -> T:
        """Runs ``make()`` (which makes the group) and records the TCP connections it opened."""
        before = open_sockets()
        made = make()
        self.add(fd for fd, link in open_sockets().items() if before.get(fd) != link)
        return made

    def add(self, fds: Iterable[int]) -> None:
        """Records these descriptors' connections (not the store's, not listening sockets)."""
        current = open_sockets()
        for fd in fds:
            ends = _ends(fd) if fd in current else None
            if ends is None or any(self._is_store(end) for end in ends):
                continue  # not a connection, or one to the store (the heartbeat's, the rendezvous's)
            self.connections.append((fd, current[fd]))

    def _is_store(self, end: tuple[str, int]) -> bool:
        host = end[0].removeprefix("::ffff:")  # an IPv4 address on a dual-stack socket
        return end[1] == self._store_port and (host in self._store_hosts or end[0] in self._store_hosts)

    def shut_down(self) -> int:
        """Shuts down every recorded connection that is still open (the same socket: a
        descriptor closed and reused since is left alone). Returns how many."""
        count = 0
        for fd, link in self.connections:
            try:
                if os.readlink(f"{_FDS}/{fd}") != link:
                    continue
                sock = socket.socket(fileno=os.dup(fd))
            except OSError:
                continue
            with contextlib.suppress(OSError):  # the peer closed it first
                sock.shutdown(socket.SHUT_RDWR)
                count += 1
            sock.close()
        self.connections = []
        return count
