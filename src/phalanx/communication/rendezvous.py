"""The rendezvous: the chief's TCPStore, where workers check in and send heartbeats (for `WorkerGroup`).

Rank 0 serves the store on the chief's address from the cluster spec, and only there (a
TCPStore left to itself listens on every interface); every other worker waits until something
listens there, connects, and checks in. Under torchrun, its agent serves the store instead.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from phalanx.communication.health import HealthCheck, PeerUnavailableError

__all__ = ["JOIN_TIMEOUT_ENV", "LOG_EVERY_SECONDS", "Rendezvous"]

log = logging.getLogger("phalanx")

LOG_EVERY_SECONDS = 5.0
JOIN_TIMEOUT_ENV = "PHALANX_JOIN_TIMEOUT_SECONDS"


def _listening_socket(host: str, port: int) -> int:
    """A TCP socket listening at ``host:port`` (an IPv4/IPv6 address or a name); its fd,
    owned by the caller (TCPStore closes it)."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as TCPStore's own listener
        sock.bind(address)
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    return sock.detach()


def _log_every(join_timeout: float) -> float:
    return min(LOG_EVERY_SECONDS, max(join_timeout / 3, 0.2))


class Rendezvous:
    """Opens connections to the chief's store and checks this worker in (every worker).

    Args:
        host, port: The chief's address (an IPv6 host without brackets).
        rank, world_size: This worker (0 = chief) and the number of workers.
        name: ``name(rank) -> "worker:1 (host:port)"``, for messages.
        prefix: The key prefix of this job's keys (torchrun restarts reuse the agent's store).
        agent_store: Whether torchrun's agent serves the store (then rank 0 does not).
    """

    def __init__(
        self,
        host: str,
        port: int,
        rank: int,
        world_size: int,
        name: Callable[[int], str],
        prefix: str,
        agent_store: bool,
    ) -> None:
        self._host, self._port, self._rank, self._world = host, port, rank, world_size
        self._name, self._prefix, self._agent_store = name, prefix, agent_store

    def open(self, deadline: float, wait_seconds: float, heartbeat: bool = False) -> Any:
        """A connection to the store; rank 0's first one serves it (unless torchrun does).

        Store operations time out after ``wait_seconds`` (at least 10 s, except for the
        heartbeat's connection); across a partition they block instead (see `HealthCheck`).

        Raises:
            ValueError: The chief cannot listen at its address.
            PeerUnavailableError: Nothing listens at the chief's address by ``deadline``.
        """
        timeout = timedelta(seconds=wait_seconds if heartbeat else max(wait_seconds, 10.0))
        if self._rank == 0 and not self._agent_store and not heartbeat:
            store = self._serve(timeout)
        else:
            self._wait_until_reachable(deadline, wait_seconds, quiet=heartbeat)
            store = dist.TCPStore(self._host, self._port, None, is_master=False, timeout=timeout)
        return dist.PrefixStore(self._prefix, store)

    def _serve(self, timeout: timedelta) -> Any:
        try:  # on the chief's address only (TCPStore alone would listen on every interface)
            fd = _listening_socket(self._host, self._port)
            return dist.TCPStore(
                self._host,
                self._port,
                None,
                is_master=True,
                timeout=timeout,
                wait_for_workers=False,
                master_listen_fd=fd,
            )
        except (OSError, RuntimeError) as exc:
            raise ValueError(
                f"The chief {self._name(0)} must serve the rendezvous at port {self._port} of its address "
                f"{self._host}, but it cannot listen there. Received: {exc}. HINT: the chief's address in "
                "the cluster spec must be an address of this machine with a free port."
            ) from None

    def _wait_until_reachable(self, deadline: float, join_timeout: float, quiet: bool) -> None:
        # Probe with a plain socket: a TCPStore client retrying by itself floods stderr.
        start = last_log = time.monotonic()
        while True:
            try:
                with socket.create_connection((self._host, self._port), timeout=1.0):
                    return
            except OSError:
                pass
            now = time.monotonic()
            if now > deadline:
                raise PeerUnavailableError(
                    f"Gave up after {join_timeout:g}s waiting for ['{self._name(0)}'] to join: "
                    f"nothing listens at {self._host}:{self._port}, where the chief serves the "
                    "rendezvous. HINT: start every task of the cluster, and check the chief's "
                    "address in TF_CONFIG (or MASTER_ADDR/MASTER_PORT)."
                )
            if not quiet and now - last_log >= _log_every(join_timeout):
                log.warning(
                    "Still waiting for ['%s'] to join (the chief, serving the rendezvous; %.0fs of %gs).",
                    self._name(0),
                    now - start,
                    join_timeout,
                )
                last_log = now
            time.sleep(0.1)

    def check_in(self, store: Any, deadline: float, join_timeout: float) -> None:
        """Checks this worker in and waits until every worker did (all workers).

        Raises:
            PeerUnavailableError: Some did not by ``deadline`` (they are named).
        """
        store.add(HealthCheck.key(self._rank), 1)
        start = last_log = time.monotonic()
        while True:
            missing = self.missing_tasks(store)
            if not missing:
                return
            now = time.monotonic()
            if now > deadline:
                raise PeerUnavailableError(
                    f"Gave up after {join_timeout:g}s waiting for {missing} to join. "
                    "HINT: start every task of the cluster (TF_CONFIG's 'cluster'), check their "
                    f"addresses, or allow longer with {JOIN_TIMEOUT_ENV}."
                )
            if now - last_log >= _log_every(join_timeout):
                waited = now - start
                log.warning("Still waiting for %s to join (%.0fs of %gs).", missing, waited, join_timeout)
                last_log = now
            time.sleep(0.05)

    def missing_tasks(self, store: Any) -> list[str]:
        """The tasks that have not checked in yet, by name."""
        return [self._name(r) for r in range(self._world) if not store.check([HealthCheck.key(r)])]
