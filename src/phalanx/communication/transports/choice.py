"""Which transport carries MultiWorkerMirrored's CPU collectives: ``PHALANX_COLLECTIVES``.

``auto`` (the default): the TLS ring (`phalanx.communication.transports.tls.ring`) when the job has a
cluster token and its workers are not all on one machine; gloo (and shared memory) on one
machine, whose traffic never leaves the kernel. ``tls``: the ring always (e.g. to test it on
one machine). ``gloo``: plaintext between machines, logged by the chief, as with
``PHALANX_INSECURE_TRANSPORT=1``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from phalanx import settings
from phalanx.communication.checks.collective_check import Signed
from phalanx.communication.transports.tls.endpoint import TlsEndpoint
from phalanx.communication.transports.tls.links import RingLinks
from phalanx.communication.transports.tls.ring import TlsRing
from phalanx.security.channels import INSECURE_ENV, insecure_transport
from phalanx.security.token import TOKEN_ENV

__all__ = ["COLLECTIVES_ENV", "check_settings", "collectives_mode", "ring_if_needed"]

log = logging.getLogger("phalanx")

COLLECTIVES_ENV = "PHALANX_COLLECTIVES"


def collectives_mode() -> str:
    """``PHALANX_COLLECTIVES``: "auto" (default), "tls" or "gloo".

    Raises:
        ValueError: Another value (a typo must not silently drop TLS).
    """
    return settings.current().collectives


def check_settings() -> None:
    """Refuses collective settings that cannot work, before a job opens anything.

    Raises:
        ValueError: ``PHALANX_COLLECTIVES`` is unknown, or asks for TLS without a token.
    """
    if collectives_mode() == "tls" and not settings.current().cluster_token:
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
    mismatch: Callable[[Signed, int | None], BaseException] | None = None,
) -> TlsRing | None:
    """The job's TLS ring when its collectives need one (all workers; see the module's
    ``PHALANX_COLLECTIVES``); None: they go through gloo (and shared memory). ``mismatch``:
    the error of a frame whose signature differs (`CollectiveCheck.mismatch`).

    Raises:
        ValueError: ``PHALANX_COLLECTIVES`` is unknown, or asks for TLS without a token.
        PeerGoneError: A neighbour did not join the ring within ``timeout``.
    """
    check_settings()
    if world_size == 1:
        return None
    mode, token = collectives_mode(), settings.current().cluster_token
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
    links = RingLinks(store, rank, world_size, TlsEndpoint(own_host, chief, token), task_name)
    ring = TlsRing(links, failure, timeout, mismatch)
    if rank == 0:
        log.info("MultiWorkerMirrored collectives go over mutual TLS between the %d workers.", world_size)
    return ring
