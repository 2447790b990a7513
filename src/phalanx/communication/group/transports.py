"""What a `WorkerGroup` sends its collectives through besides its process group: shared memory
when every worker is on this machine (`phalanx.communication.transports.shm.shared_memory`), the mutual-TLS
ring when they span machines and the job has a token (`phalanx.communication.transports.choice`),
else gloo itself (both None)."""

from __future__ import annotations

import dataclasses
import secrets
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from phalanx.communication.checks.health import PeerUnavailableError
from phalanx.communication.group.work import PeerGoneError
from phalanx.communication.transports.choice import ring_if_needed
from phalanx.communication.transports.gloo.signed import Mismatch
from phalanx.communication.transports.shm.same_machine import probe_machines
from phalanx.communication.transports.shm.shared_memory import SharedMemoryAllReduce
from phalanx.communication.transports.tls.ring import TlsRing

__all__ = ["Transports", "open_transports"]


@dataclasses.dataclass
class Transports:
    """The group's own transports (None: not used) and the gloo group shared memory agrees on."""

    shm: SharedMemoryAllReduce | None = None
    shm_group: Any = None
    ring: TlsRing | None = None


def open_transports(
    store: Any,
    rank: int,
    world_size: int,
    chief: tuple[str, int],
    own_host: str | None,
    task_name: Callable[[int], str],
    failure: Callable[[], str | None],
    collective_timeout: float,
    ring_timeout: float,
    keep: Callable[[Any], Any],
    mismatch: Mismatch | None = None,
) -> Transports:
    """Probes where the workers are and opens what they need (all workers, gloo groups only).

    Args:
        store: The job's rendezvous store.
        rank, world_size: This worker and the number of workers.
        chief: ``(host, port)`` of the chief's store (the port also names this job's segments).
        own_host: This task's host in the cluster spec, or None.
        task_name: ``task_name(rank) -> "worker:1 (host:port)"``, for messages.
        failure: The group's health (a reason once a peer is known dead).
        collective_timeout: The default deadline of a collective, in seconds.
        ring_timeout: Seconds to connect the TLS ring.
        keep: Holds a gloo work until the group is torn down (`RecentWorks.add`).
        mismatch: The error of a collective whose signature differs from a peer's
            (`CollectiveCheck.mismatch`).

    Raises:
        PeerUnavailableError: The TLS ring could not be made (what was opened is closed).
    """
    port = chief[1]
    pids, shm_allowed = probe_machines(store, rank, world_size, str(port))
    opened = Transports()
    if pids is not None and shm_allowed and world_size > 1:  # an elastic job's group may have one
        # its own gloo group: the transport's thread agrees on segments without interleaving
        # with the collectives of the training thread (made before the job's process group,
        # on the store: a gloo backend of its own, in no torch.distributed registry)
        opened.shm_group = dist.ProcessGroupGloo(
            dist.PrefixStore("phalanx-shm/", store), rank, world_size, timedelta(seconds=collective_timeout)
        )
        opened.shm = SharedMemoryAllReduce(
            f"{port}-{pids[0]}-{_group_nonce(store, rank)}",
            rank,
            world_size,
            pids,
            opened.shm_group,
            failure,
            task_name,
            collective_timeout,
            keep,
            mismatch,
        )
    try:
        opened.ring = ring_if_needed(
            store,
            rank,
            world_size,
            own_host,
            chief,
            pids is not None,
            task_name,
            failure,
            ring_timeout,
            mismatch,
        )
    except PeerGoneError as exc:
        if opened.shm is not None:
            opened.shm.close()
            opened.shm_group = None  # dropping the last reference joins its threads
        raise PeerUnavailableError(
            f"MultiWorkerMirroredStrategy could not connect {task_name(rank)} to its TLS ring: "
            f"{exc.failure}. HINT: every worker needs the same PHALANX_CLUSTER_TOKEN (or certificate "
            "files of one CA) and TCP between the machines on ephemeral ports (docs/multi_machine.md)."
        ) from None
    return opened


def _group_nonce(store: Any, rank: int) -> str:
    """A random name of this group, the same on its workers (rank 0 draws it). An elastic job's
    groups share the store's port and often the chief: without it, a worker taken for lost that
    removes its files late could remove a segment of the next group while its members open it."""
    if rank == 0:
        store.set("shm-nonce", secrets.token_hex(4))
    return bytes(store.get("shm-nonce")).decode()
