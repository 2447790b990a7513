"""The transports a worker group may send its collectives through, in order of preference.

`open_first` asks each registered opener in turn; the first transport that opens carries the
group's collectives (the group's signed gloo transport carries them where none does). A new
transport is one module with an opener (`phalanx.communication.transports.base.Opener`) and one
line below, or a `register` call before the strategy is made.
"""

from __future__ import annotations

from phalanx.communication.transports.base import Opener, OpenRequest, Transport
from phalanx.communication.transports.shm.opener import open_shared_memory
from phalanx.communication.transports.tls.opener import open_tls_ring

__all__ = ["open_first", "register", "registered", "unregister"]

_OPENERS: dict[str, Opener] = {
    "shm": open_shared_memory,  # every worker on this machine
    "tls": open_tls_ring,  # across machines, with a cluster token
}


def register(name: str, opener: Opener, *, first: bool = False) -> None:
    """Adds a transport (every worker of a job, before its strategy is made).

    Args:
        name: Its name (`Transport.name`), unique.
        opener: Opens it for a group, or returns None where it does not apply.
        first: Ask it before the registered ones (else after them).

    Raises:
        ValueError: A transport of that name is registered already.
    """
    global _OPENERS
    if name in _OPENERS:
        raise ValueError(
            f"A transport named {name!r} is registered already. Received: register({name!r}, ...). "
            f"HINT: registered are {list(_OPENERS)}; unregister({name!r}) first to replace it."
        )
    _OPENERS = {name: opener, **_OPENERS} if first else {**_OPENERS, name: opener}


def unregister(name: str) -> None:
    """Removes a registered transport (no error if there is none of that name)."""
    _OPENERS.pop(name, None)


def registered() -> list[str]:
    """The registered transports' names, in the order they are asked."""
    return list(_OPENERS)


def open_first(request: OpenRequest) -> Transport | None:
    """The first registered transport that opens for this group, or None (all workers)."""
    for opener in list(_OPENERS.values()):
        transport = opener(request)
        if transport is not None:
            return transport
    return None
