"""Free TCP ports for a local cluster, never the same port twice from one process."""

from __future__ import annotations

import collections
import socket
import threading

__all__ = ["free_ports"]

_MAX_TRIES = 256
_lock = threading.Lock()
# Ports handed out recently by this process: a second launch started before the first one's
# tasks have bound their ports must not be given the same ones.
_handed_out: collections.deque[int] = collections.deque(maxlen=4096)


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` distinct TCP ports that are free on ``host`` (IPv4) now.

    Every port is held bound until all are chosen (so the OS gives distinct ones), then
    released for the tasks to bind. Another program could still take one in between; the
    window is the task start-up time, as with every bound-socket port picker.

    Args:
        count: How many ports.
        host: The IPv4 address they will be bound on.

    Raises:
        ValueError: ``count`` is negative.
        OSError: ``host`` cannot be bound, or no new port was found after many tries.
    """
    if count < 0:
        raise ValueError(f"free_ports needs a count >= 0. Received: {count}.")
    with _lock:
        sockets: list[socket.socket] = []
        ports: list[int] = []
        try:
            while len(ports) < count:
                if len(sockets) >= count + _MAX_TRIES:
                    raise OSError(f"found only {len(ports)} of {count} unused free ports on {host}")
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                sockets.append(sock)
                sock.bind((host, 0))
                port = sock.getsockname()[1]
                if port not in _handed_out:
                    ports.append(port)
        finally:
            for sock in sockets:
                sock.close()
        _handed_out.extend(ports)
        return ports
