"""The seam between a worker group and the transports that carry its collectives.

A `Transport` moves the bytes of a group's collectives (all-reduce, broadcast, all-gather, and
optionally reduce-scatter and all-gather into one tensor); the group signs, watches and waits on
them and never names a transport. Transports are opened by their `Opener`, registered in
`phalanx.communication.transports.registry` in order of preference: the first that opens for
a group carries its collectives, and the group's signed gloo transport carries them where none
does (`phalanx.communication.transports.gloo.transport`). A new transport is one module with an
opener plus one registry line.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from phalanx.communication.checks.collective_check import Signed
from phalanx.communication.group.work import PeerGoneError

__all__ = ["CollectivesDifferError", "Opener", "OpenRequest", "RunsOnCaller", "Transport"]


class CollectivesDifferError(PeerGoneError):
    """A transport saw a peer send another collective than this worker's (unsigned frames)."""


class Transport(Protocol):
    """What a group's collectives need of a transport (all workers of the group call the same
    methods in the same order; tensors are contiguous and of one shape and dtype everywhere).

    Each ``*_async`` method queues the collective and returns a work whose ``wait(timeout)``
    the group calls; ``signed`` is the collective's checked code (`CollectiveCheck.sign`), which
    the transport compares with every peer's before any result is used.
    """

    name: str  # "shm", "tls", ... (in messages and `WorkerGroup.transport_name`)
    closes_before_leaving: bool  # closed before the group's goodbye (else after it)

    def all_reduce_async(self, tensor: torch.Tensor, op: Any, signed: Signed) -> Any: ...

    def broadcast_async(self, tensor: torch.Tensor, src: int, signed: Signed) -> Any: ...

    def all_gather_async(self, tensor: torch.Tensor, signed: Signed) -> tuple[Any, list[torch.Tensor]]: ...

    def can_reduce_scatter(self, tensor: torch.Tensor, output: torch.Tensor, op: Any) -> bool:
        """Whether `reduce_scatter_async` takes these (asked before the collective is signed;
        where not, the group all-reduces instead)."""
        ...

    def reduce_scatter_async(
        self, tensor: torch.Tensor, output: torch.Tensor, op: Any, signed: Signed
    ) -> Any:
        """Reduces ``tensor`` (one part per worker, end to end) into this worker's ``output``."""
        ...

    def can_all_gather_into(self, tensor: torch.Tensor, output: torch.Tensor) -> bool:
        """Whether `all_gather_into_async` takes these (asked before the collective is signed)."""
        ...

    def all_gather_into_async(self, tensor: torch.Tensor, output: torch.Tensor, signed: Signed) -> Any:
        """Gathers every worker's ``tensor`` into ``output`` (rank order, end to end)."""
        ...

    def close(self) -> None:
        """Stops the transport (a collective still waiting fails); never waits on a peer."""
        ...

    def release(self) -> None:
        """Drops what had to outlive `close` until the group's own teardown (e.g. a gloo group
        whose threads are joined when its last reference goes)."""
        ...


class RunsOnCaller(Protocol):
    """A `Transport` that can run an all-reduce on the thread that issues it (the shared-memory
    one, where the machine has no core to spare for its own thread). Optional: the group looks
    the method up on its transport and uses `Transport.all_reduce_async` where it has none."""

    def all_reduce_may_block_async(self, tensor: torch.Tensor, op: Any, signed: Signed) -> Any:
        """As `Transport.all_reduce_async`, for a caller that issues nothing another worker waits
        for until this one ends (the gradient buckets): it may run here, and then returns
        finished, once every worker met."""
        ...


@dataclass(frozen=True)
class OpenRequest:
    """What an opener knows of the group it may carry (all workers open at the same time).

    Attributes:
        store: The job's rendezvous store.
        rank, world_size: This worker and the number of workers.
        chief: ``(host, port)`` of the chief's store (the port also names this job's files).
        own_host: This task's host in the cluster spec, or None.
        pids: Every worker's process id by rank when all are on this machine, else None.
        shared_memory_allowed: Whether every worker allows shared memory.
        task_name: ``task_name(rank) -> "worker:1 (host:port)"``, for messages.
        failure: The group's health (a reason once a peer is known dead).
        collective_timeout: The default deadline of a collective, in seconds.
        connect_timeout: Seconds to connect a transport's links.
        keep: Holds a gloo work until the group is torn down (`RecentWorks.add`).
        mismatch: The error of a collective whose signature differs from a peer's.
    """

    store: Any
    rank: int
    world_size: int
    chief: tuple[str, int]
    own_host: str | None
    pids: list[int] | None
    shared_memory_allowed: bool
    task_name: Callable[[int], str]
    failure: Callable[[], str | None]
    collective_timeout: float
    connect_timeout: float
    keep: Callable[[Any], Any]
    mismatch: Any = None

    @property
    def same_machine(self) -> bool:
        """Whether every worker of the group runs on this machine."""
        return self.pids is not None


Opener = Callable[[OpenRequest], "Transport | None"]
"""Opens a transport for a group (all workers, at the same time, with the same answer), or
returns None where it does not apply; raises `PeerGoneError` when it applies but could not
connect."""
