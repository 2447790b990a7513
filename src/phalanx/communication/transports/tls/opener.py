"""The mutual-TLS ring behind the group seam (`phalanx.communication.transports.base`): opened
when a group's workers span machines and the job has a cluster token (or asks for the ring)."""

from __future__ import annotations

from typing import Any

import torch

from phalanx.communication.checks.collective_check import Signed
from phalanx.communication.transports.base import OpenRequest
from phalanx.communication.transports.choice import ring_if_needed
from phalanx.communication.transports.tls.ring import TlsRing

__all__ = ["TlsTransport", "open_tls_ring"]


class TlsTransport:
    """A `TlsRing` as a group's transport (no reduce-scatter or gather-into of its own)."""

    name = "tls"
    closes_before_leaving = False  # after the goodbye: a peer may still read this worker's last bytes

    def __init__(self, ring: TlsRing) -> None:
        self.ring = ring

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
        self.ring.close()

    def release(self) -> None:
        """Nothing outlives `close`."""


def open_tls_ring(request: OpenRequest) -> TlsTransport | None:
    """The ring when the group's collectives need one (`ring_if_needed`), else None.

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
    return None if ring is None else TlsTransport(ring)
