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

__all__ = ["open_transport", "point_to_point_of", "subgroup_transport"]


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


def point_to_point_of(transport: Transport | None) -> Any:
    """The transport's own links for ``send``/``recv`` between any two workers (the TLS
    transport's `TlsPeers`), or None: the group's gloo carries them. Optional for a
    transport: one without a ``point_to_point`` attribute has none."""
    return getattr(transport, "point_to_point", None)


def subgroup_transport(
    transport: Transport | None,
    store: Any,
    rank: int,
    size: int,
    task_name: Callable[[int], str],
    group_name: str,
    mismatch: Any,
) -> Transport | None:
    """The job's transport between the members of a torch group (all members at once; the
    TLS transport opens a ring of theirs: `TlsTransport.subgroup`), or None: the group's gloo
    carries its collectives (shared memory, and transports without a ``subgroup`` method).

    Raises:
        PeerUnavailableError: A member did not join the group's ring in time.
    """
    opener = getattr(transport, "subgroup", None)
    if opener is None:
        return None
    try:
        made: Transport | None = opener(store, rank, size, task_name, group_name, mismatch)
    except PeerGoneError as exc:
        raise PeerUnavailableError(
            f"torch.distributed.new_group could not connect {task_name(rank)} to the group's other "
            f"members over TLS: {exc.failure}. HINT: every member must create the group at the same "
            "point of the program (docs/c10d_backend.md)."
        ) from None
    return made
