"""The rendezvous: the chief's TCPStore, where workers check in and send heartbeats (for `WorkerGroup`).

Rank 0 serves the store on the chief's address from the cluster spec, and only there (a
TCPStore left to itself listens on every interface); every other worker waits until something
listens there, connects, and checks in. Under torchrun, its agent serves the store instead.

torch's TCPStore authenticates nobody: whoever reaches its port may read, write and delete
any key. With ``PHALANX_CLUSTER_TOKEN`` set (`phalanx launch` sets one), every connection is
wrapped in an `AuthenticatedStore`: each value phalanx or gloo writes carries an HMAC of the
key and the value under a key derived from the token, and a value read back without a valid
one is refused, so an outsider can neither check in as a worker, nor move a heartbeat, nor
hand gloo an address to connect to. It can still delete keys or fill the store (docs/security.md).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
import socket
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from phalanx import settings
from phalanx.communication.checks.health import HealthCheck, PeerUnavailableError
from phalanx.security.token import TOKEN_ENV, check_token

__all__ = [
    "JOIN_TIMEOUT_ENV",
    "LOG_EVERY_SECONDS",
    "AuthenticatedStore",
    "Rendezvous",
    "StoreAuthenticationError",
    "listening_socket",
]

log = logging.getLogger("phalanx")

LOG_EVERY_SECONDS = 5.0
JOIN_TIMEOUT_ENV = "PHALANX_JOIN_TIMEOUT_SECONDS"
_MAGIC = b"phx1"
_NONCE, _TAG = 8, 32  # bytes: a random nonce makes every write unique (see AuthenticatedStore.add)
_warned_unauthenticated = False


class StoreAuthenticationError(PermissionError):
    """A rendezvous store value was not written by a holder of the cluster token."""


def _store_key(token: str) -> bytes:
    """The MAC key of the store, derived from the token (so that the token itself is never used
    as a key twice: the transport derives its own from it)."""
    return hmac.new(check_token(token).encode(), b"phalanx rendezvous store v1", hashlib.sha256).digest()


class AuthenticatedStore(dist.Store):
    """A store whose values carry an HMAC-SHA256 of (key, value) under a key derived from the
    cluster token; wraps one connection to the rendezvous store (every worker, every connection).

    A value is stored as ``phx1 | nonce | tag | value``. `get`, `multi_get` and `add` refuse a
    value without a valid tag (`StoreAuthenticationError`, naming the key); `check` counts such
    a key as absent and logs it. `add` is a compare-and-set loop on sealed counters (atomic
    with any number of writers; the nonce keeps two writers' equal counts apart). `wait` and
    `delete_key` pass through: the presence of a key and its removal are not authenticated.

    Args:
        inner: A connection to the store (a `TCPStore`, or a `PrefixStore` over one).
        token: The cluster's shared secret.
        context: What the MAC binds besides each key (the job's key prefix), so that a value
            of one job (a torchrun restart) is refused in another.
    """

    def __init__(self, inner: Any, token: str, context: str = "") -> None:
        super().__init__()
        self._inner, self._key, self._context = inner, _store_key(token), context
        self._reported: set[str] = set()  # keys whose forged value `check` logged (once each)

    def _tag(self, key: str, nonce: bytes, value: bytes) -> bytes:
        encoded = f"{self._context}\0{key}".encode()
        message = len(encoded).to_bytes(4, "big") + encoded + nonce + value
        return hmac.new(self._key, message, hashlib.sha256).digest()

    def _seal(self, key: str, value: bytes) -> bytes:
        nonce = secrets.token_bytes(_NONCE)
        return _MAGIC + nonce + self._tag(key, nonce, value) + value

    def _open(self, key: str, sealed: bytes) -> bytes:
        head = len(_MAGIC) + _NONCE + _TAG
        nonce, tag = sealed[len(_MAGIC) : len(_MAGIC) + _NONCE], sealed[len(_MAGIC) + _NONCE : head]
        if not (sealed.startswith(_MAGIC) and hmac.compare_digest(tag, self._tag(key, nonce, sealed[head:]))):
            raise StoreAuthenticationError(
                f"The rendezvous store's key {key!r} holds a value that no task of this cluster wrote: "
                f"it lacks a valid MAC of {TOKEN_ENV}. Received: {len(sealed)} bytes. HINT: something "
                "other than this job's tasks reached the chief's rendezvous port, or a task runs with "
                f"another {TOKEN_ENV}; every task needs the same one (docs/security.md)."
            )
        return sealed[head:]

    def set(self, key: str, value: str | bytes) -> None:  # noqa: D102 - dist.Store's
        self._inner.set(key, self._seal(key, value.encode() if isinstance(value, str) else bytes(value)))

    def get(self, key: str) -> bytes:  # noqa: D102
        return self._open(key, bytes(self._inner.get(key)))

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:  # noqa: D102
        return [self._open(k, bytes(v)) for k, v in zip(keys, self._inner.multi_get(list(keys)), strict=True)]

    def add(self, key: str, amount: int) -> int:  # noqa: D102
        current = b""
        while True:
            value = (int(self._open(key, current)) if current else 0) + amount
            desired = self._seal(key, str(value).encode())
            current = bytes(self._inner.compare_set(key, current, desired))
            if current == desired:
                return value

    def check(self, keys: Sequence[str]) -> bool:  # noqa: D102
        if not self._inner.check(list(keys)):
            return False
        for key, sealed in zip(keys, self._inner.multi_get(list(keys)), strict=True):
            try:
                self._open(key, bytes(sealed))
            except StoreAuthenticationError as exc:
                if key not in self._reported:  # check-in polls every 50 ms
                    self._reported.add(key)
                    log.warning("%s", exc)
                return False
        return True

    def wait(self, keys: Sequence[str], timeout: timedelta | None = None) -> None:  # noqa: D102
        if timeout is None:
            self._inner.wait(list(keys))
        else:
            self._inner.wait(list(keys), timeout)

    def delete_key(self, key: str) -> bool:  # noqa: D102
        return bool(self._inner.delete_key(key))

    def num_keys(self) -> int:  # noqa: D102
        return int(self._inner.num_keys())

    def set_timeout(self, timeout: timedelta) -> None:  # noqa: D102
        self._inner.set_timeout(timeout)


def _authenticated(store: Any, context: str) -> Any:
    """``store`` wrapped in an `AuthenticatedStore` when ``PHALANX_CLUSTER_TOKEN`` is set; else
    ``store`` itself, with a warning (once per process) that anyone reaching it may write it."""
    global _warned_unauthenticated
    token = settings.current().cluster_token
    if token:
        return AuthenticatedStore(store, token, context)
    if not _warned_unauthenticated:
        _warned_unauthenticated = True
        log.warning(
            "The rendezvous store is not authenticated: %s is unset, so anyone who reaches the chief's "
            "port can check in as a worker or rewrite heartbeats. Set it to the same secret on every "
            "task (`phalanx launch` does for a local cluster; docs/security.md).",
            TOKEN_ENV,
        )
    return store


def listening_socket(host: str, port: int) -> int:
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
            ValueError: The chief cannot listen at its address, or ``PHALANX_CLUSTER_TOKEN`` is
                set but too short.
            PeerUnavailableError: Nothing listens at the chief's address by ``deadline``.
        """
        timeout = timedelta(seconds=wait_seconds if heartbeat else max(wait_seconds, 10.0))
        if self._rank == 0 and not self._agent_store and not heartbeat:
            store = self._serve(timeout)
        else:
            self._wait_until_reachable(deadline, wait_seconds, quiet=heartbeat)
            store = dist.TCPStore(self._host, self._port, None, is_master=False, timeout=timeout)
        # the wrapper outermost: the caller's reference keeps its Python methods alive (a Python
        # store referenced only from C++, e.g. inside a PrefixStore, loses them when collected)
        return _authenticated(dist.PrefixStore(self._prefix, store), self._prefix)

    def _serve(self, timeout: timedelta) -> Any:
        try:  # on the chief's address only (TCPStore alone would listen on every interface)
            fd = listening_socket(self._host, self._port)
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

    def check_in(
        self, store: Any, deadline: float, join_timeout: float, lost: Callable[[], str | None] | None = None
    ) -> None:
        """Checks this worker in and waits until every worker did (all workers).

        Args:
            lost: An elastic job's verdict on its members (`Membership.failure`): once it names
                one, waiting stops (the members re-form without it).

        Raises:
            PeerUnavailableError: Some did not by ``deadline``, or ``lost`` named one (they are named).
        """
        store.add(HealthCheck.key(self._rank), 1)
        start = last_log = time.monotonic()
        while True:
            missing = self.missing_tasks(store)
            if not missing:
                return
            reason = lost() if lost is not None else None
            if reason is not None:
                raise PeerUnavailableError(
                    f"Stopped waiting for {missing} to join the group: {reason}. HINT: the members of an "
                    "elastic job re-form without it; a restarted task joins at a step boundary."
                )
            now = time.monotonic()
            if now > deadline:
                raise PeerUnavailableError(
                    f"Gave up after {join_timeout:g}s waiting for {missing} to join. "
                    "HINT: start every task of the cluster (TF_CONFIG's 'cluster'), check their "
                    f"addresses, or allow longer with {JOIN_TIMEOUT_ENV}. Every task needs the same "
                    f"{TOKEN_ENV} (a warning that a rendezvous key lacks a valid MAC says one has another)."
                )
            if now - last_log >= _log_every(join_timeout):
                waited = now - start
                log.warning("Still waiting for %s to join (%.0fs of %gs).", missing, waited, join_timeout)
                last_log = now
            time.sleep(0.05)

    def missing_tasks(self, store: Any) -> list[str]:
        """The tasks that have not checked in yet, by name."""
        return [self._name(r) for r in range(self._world) if not store.check([HealthCheck.key(r)])]
