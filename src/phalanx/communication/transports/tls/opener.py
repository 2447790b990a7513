"""The mutual-TLS transport behind the group seam (`phalanx.communication.transports.base`):
opened when a group's workers span machines and the job has a cluster token (or asks for it).

It is the job's ring (the collectives), the point-to-point links between any two workers
(`phalanx.communication.transports.tls.peers`: send and recv), and a ring of their own for
each torch group made with ``new_group()`` (`TlsTransport.subgroup`), all authenticated the
same way (`phalanx.communication.transports.tls.endpoint`)."""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable
from typing import Any

import torch

from phalanx.communication.checks.collective_check import Signed
from phalanx.communication.transports.base import OpenRequest
from phalanx.communication.transports.choice import ring_if_needed
from phalanx.communication.transports.tls.links import RingLinks
from phalanx.communication.transports.tls.peers import TlsPeers
from phalanx.communication.transports.tls.ring import TlsRing

__all__ = ["TlsTransport", "open_tls_ring"]


class TlsTransport:
    """A `TlsRing` as a group's transport (no reduce-scatter or gather-into of its own), with
    the job's point-to-point links and the rings of its torch subgroups.

    Args:
        ring: The group's ring.
        point_to_point: The job's point-to-point links (None: a subgroup's transport, whose
            group sends over the job's).
        failure: The job's health (a reason once a peer is known dead).
        connect_timeout: Seconds a subgroup's ring waits for its neighbours.
    """

    name = "tls"
    closes_before_leaving = False  # after the goodbye: a peer may still read this worker's last bytes

    def __init__(
        self,
        ring: TlsRing,
        point_to_point: TlsPeers | None = None,
        failure: Callable[[], str | None] = lambda: None,
        connect_timeout: float = 60.0,
    ) -> None:
        self.ring = ring
        self.point_to_point = point_to_point
        self._failure, self._connect_timeout = failure, connect_timeout
        self._subgroups: list[TlsTransport] = []
        self._lock = threading.Lock()

    def subgroup(
        self,
        store: Any,
        rank: int,
        size: int,
        task_name: Callable[[int], str],
        group_name: str,
        mismatch: Callable[..., BaseException] | None,
    ) -> TlsTransport | None:
        """A ring of the members of a torch group (all of them, at once; blocks until its
        neighbours connect), closed with this transport; None for a group of one, whose
        collectives need no network.

        Args:
            store: The group's store (torch prefixes it per group).
            rank, size: This worker's rank in the group and the group's size.
            task_name: ``task_name(group rank) -> "worker:1 (host:port)"``.
            group_name: torch's name of the group (the ring's hello tag).
            mismatch: The error of a frame whose signature differs (the group's check).

        Raises:
            PeerGoneError: A neighbour did not join the ring within the connect timeout.
        """
        if size == 1:
            return None
        tag = "tls-group-" + hashlib.sha256(group_name.encode()).hexdigest()[:16]
        links = RingLinks(store, rank, size, self.ring.links.endpoint, task_name, tag)
        transport = TlsTransport(TlsRing(links, self._failure, self._connect_timeout, mismatch))
        with self._lock:
            self._subgroups.append(transport)
        return transport

    def all_reduce_async(self, tensor: torch.Tensor, op: Any, signed: Signed) -> Any:
        return self.ring.all_reduce_async(tensor, op, signed)

    def broadcast_async(self, tensor: torch.Tensor, src: int, signed: Signed) -> Any:
        return self.ring.broadcast_async(tensor, src, signed)

    def all_gather_async(self, tensor: torch.Tensor, signed: Signed) -> tuple[Any, list[torch.Tensor]]:
        return self.ring.all_gather_async(tensor, signed)

    def can_reduce_scatter(self, tensor: torch.Tensor, output: torch.Tensor, op: Any) -> bool:
        return False

    def reduce_scatter_async(
        self, tensor: torch.Tensor, output: torch.Tensor, op: Any, signed: Signed
    ) -> Any:
        raise NotImplementedError(
            "the TLS ring has no reduce-scatter of its own (can_reduce_scatter is False)"
        )

    def can_all_gather_into(self, tensor: torch.Tensor, output: torch.Tensor) -> bool:
        return False

    def all_gather_into_async(self, tensor: torch.Tensor, output: torch.Tensor, signed: Signed) -> Any:
        raise NotImplementedError("the TLS ring gathers into a list (can_all_gather_into is False)")

    def close(self) -> None:
        """Closes the ring, the point-to-point links and every subgroup's ring."""
        with self._lock:
            subgroups, self._subgroups = self._subgroups, []
        for transport in subgroups:
            transport.close()
        if self.point_to_point is not None:
            self.point_to_point.close()
        self.ring.close()

    def release(self) -> None:
        """Nothing outlives `close`."""


def open_tls_ring(request: OpenRequest) -> TlsTransport | None:
    """The ring and the point-to-point links when the group's collectives need TLS
    (`ring_if_needed`), else None.

    Raises:
        ValueError: ``PHALANX_COLLECTIVES`` asks for TLS without a token.
        PeerGoneError: A neighbour did not join the ring within the connect timeout.
    """
    ring = ring_if_needed(
        request.store,
        request.rank,
        request.world_size,
        request.own_host,
        request.chief,
        request.same_machine,
        request.task_name,
        request.failure,
        request.connect_timeout,
        request.mismatch,
    )
    if ring is None:
        return None
    peers = TlsPeers(
        ring.links.endpoint,
        request.store,
        request.rank,
        request.world_size,
        request.task_name,
        request.failure,
        request.connect_timeout,
    )
    return TlsTransport(ring, peers, request.failure, request.connect_timeout)
