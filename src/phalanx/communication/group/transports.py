"""What a `WorkerGroup` sends its collectives through besides its process group: the first
registered transport that opens for it (`phalanx.communication.transports.registry`: shared
memory when every worker is on this machine, the mutual-TLS ring when they span machines and
the job has a token), else gloo itself (None)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from phalanx.communication.checks.health import PeerUnavailableError
from phalanx.communication.group.work import PeerGoneError
from phalanx.communication.transports import registry
from phalanx.communication.transports.base import OpenRequest, Transport
from phalanx.communication.transports.gloo.signed import Mismatch
from phalanx.communication.transports.shm.same_machine import probe_machines

__all__ = ["open_transport"]


def open_transport(
    store: Any,
    rank: int,
    world_size: int,
    chief: tuple[str, int],
    own_host: str | None,
    task_name: Callable[[int], str],
    failure: Callable[[], str | None],
    collective_timeout: float,
    connect_timeout: float,
    keep: Callable[[Any], Any],
    mismatch: Mismatch | None = None,
) -> Transport | None:
    """Probes where the workers are and opens the transport they prefer (all workers, gloo
    groups only); None: the group's gloo carries its collectives.

    Args:
        store: The job's rendezvous store.
        rank, world_size: This worker and the number of workers.
        chief: ``(host, port)`` of the chief's store (the port also names this job's segments).
        own_host: This task's host in the cluster spec, or None.
        task_name: ``task_name(rank) -> "worker:1 (host:port)"``, for messages.
        failure: The group's health (a reason once a peer is known dead).
        collective_timeout: The default deadline of a collective, in seconds.
        connect_timeout: Seconds to connect a transport (the TLS ring).
        keep: Holds a gloo work until the group is torn down (`RecentWorks.add`).
        mismatch: The error of a collective whose signature differs from a peer's
            (`CollectiveCheck.mismatch`).

    Raises:
        PeerUnavailableError: A transport applied but could not connect.
    """
    pids, shm_allowed = probe_machines(store, rank, world_size, str(chief[1]))
    request = OpenRequest(
        store,
        rank,
        world_size,
        chief,
        own_host,
        pids,
        shm_allowed,
        task_name,
        failure,
        collective_timeout,
        connect_timeout,
        keep,
        mismatch,
    )
    try:
        return registry.open_first(request)
    except PeerGoneError as exc:
        raise PeerUnavailableError(
            f"MultiWorkerMirroredStrategy could not connect {task_name(rank)} to the other workers' "
            f"transport: {exc.failure}. HINT: every worker needs the same PHALANX_CLUSTER_TOKEN (or "
            "certificate files of one CA) and TCP between the machines on ephemeral ports "
            "(docs/multi_machine.md)."
        ) from None
