"""Heartbeats between workers: who is alive, who stopped answering (used by `WorkerGroup`)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from phalanx import settings

__all__ = ["DEFAULT_HEARTBEAT_TIMEOUT", "HEARTBEAT_INTERVAL", "HealthCheck", "PeerUnavailableError"]

log = logging.getLogger("phalanx")

DEFAULT_HEARTBEAT_TIMEOUT = 10.0
HEARTBEAT_INTERVAL = 1.0


class PeerUnavailableError(RuntimeError):
    """Another worker died, stopped answering, or never joined (the message names it)."""


class Gossip(Protocol):
    """What else a heartbeat carries (the stall inspector's collective states)."""

    @staticmethod
    def key(rank: int) -> str: ...

    def outgoing(self) -> bytes | None: ...

    def incoming(self, peer: int, data: bytes) -> None: ...

    def review(self) -> str | None: ...


class HealthCheck:
    """Heartbeats of every worker in a shared store, and the verdict on the others.

    `beat` is one round: add 1 to this worker's counter, read every peer's, and remember
    when each last changed. A peer whose counter has not changed for ``timeout`` seconds is
    dead (the message says whether it announced that it left). `start` runs rounds every
    ``interval`` on a daemon thread with its own store connection.

    A round that cannot finish is a failure too: across a network partition a store call
    does not fail, it blocks (TCP retransmits for many minutes), so `dead_peer` also reports
    the chief as lost once no round has finished for ``timeout`` seconds. That is how the
    side of a partition without the store notices within the same bound as the chief.

    Args:
        connect: Opens a store connection (called on the heartbeat thread).
        rank, world_size: This worker and the number of workers.
        name: ``name(rank) -> "worker:1 (host:port)"``, for messages.
        timeout: Seconds without a heartbeat before a peer counts as dead.
        interval: Seconds between rounds.
        clock: Monotonic clock (a fake one in tests).
        gossip: Also carried by each round: its `outgoing` value is written under its key
            when there is one (only when it changed), the peers' values are read in the same
            ``multi_get`` as their counters and handed to `incoming`, then `review` runs while
            every peer's heartbeat moved within 3 rounds; a verdict it returns is logged once.
            Every worker must have written its key before the first round (the rendezvous'
            check-in sees to it).
    """

    def __init__(
        self,
        connect: Callable[[], Any],
        rank: int,
        world_size: int,
        name: Callable[[int], str],
        timeout: float = DEFAULT_HEARTBEAT_TIMEOUT,
        interval: float = HEARTBEAT_INTERVAL,
        clock: Callable[[], float] = time.monotonic,
        gossip: Gossip | None = None,
    ) -> None:
        self._connect = connect
        self._gossip = gossip
        self._verdict_logged = False
        self._rank, self._world = rank, world_size
        self._name, self._timeout, self._interval, self._clock = name, timeout, interval, clock
        self._seen: dict[int, tuple[bytes, float]] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_round: float | None = None  # when the last round finished (None: not started)
        self.failure: str | None = None

    @staticmethod
    def key(rank: int) -> str:
        """The store key of ``rank``'s heartbeat counter."""
        return f"heartbeat/{rank}"

    def beat(self, store: Any) -> str | None:
        """One round (see class doc); returns the failure found so far, if any."""
        now = self._clock()
        peers = [r for r in range(self._world) if r != self._rank]
        try:
            store.add(self.key(self._rank), 1)
            values = store.multi_get(self._round_keys(store, peers)) if peers else []
        except Exception as exc:  # the store lives in the chief's process
            log.debug("heartbeat round failed", exc_info=True)
            self.failure = self.failure or f"the chief {self._name(0)} is unreachable ({exc})"
            return self.failure
        for peer, value in zip(peers, values[: len(peers)], strict=True):
            last = self._seen.get(peer)
            if last is None or last[0] != value:
                self._seen[peer] = (value, now)
            elif now - last[1] > self._timeout and self.failure is None:
                left = store.check([f"left/{peer}"])
                what = "left the cluster (closed its strategy)" if left else "stopped sending heartbeats"
                self.failure = f"{self._name(peer)} {what} {now - last[1]:.1f}s ago"
        if self._gossip is not None and values:
            # a silent peer's state is frozen at its last one: only live peers are judged
            live = all(now - self._seen[p][1] <= 3 * self._interval for p in peers)
            self._hear(peers, values[len(peers) :], live)
        self._last_round = self._clock()
        return self.failure

    def _round_keys(self, store: Any, peers: list[int]) -> list[str]:
        """The keys one round reads; writes this worker's gossip first when it changed."""
        keys = [self.key(r) for r in peers]
        if self._gossip is None:
            return keys
        mine = self._gossip.outgoing()
        if mine is not None:
            store.set(self._gossip.key(self._rank), mine)
        return keys + [self._gossip.key(r) for r in peers]

    def _hear(self, peers: list[int], values: list[bytes], live: bool) -> None:
        assert self._gossip is not None
        for peer, value in zip(peers, values, strict=True):
            self._gossip.incoming(peer, value)
        if not live:
            return
        verdict = self._gossip.review()
        if verdict is not None and not self._verdict_logged:
            self._verdict_logged = True  # also seen by a worker that never calls a collective again
            log.error("%s", verdict)

    @property
    def timeout(self) -> float:
        """Seconds without a heartbeat (or a finished round) before a task counts as lost."""
        return self._timeout

    def dead_peer(self) -> str | None:
        """The failure found by the heartbeats, if any (None while every peer beats).

        Also the verdict on a round that never finished (see the class doc); called by the
        threads that wait for collectives, so it never waits for the store itself.
        """
        last = self._last_round
        if self.failure is None and last is not None and self._clock() - last > self._timeout:
            waited = self._clock() - last
            whose = "its own rendezvous store" if self._rank == 0 else f"the chief {self._name(0)}'s store"
            self.failure = (
                f"lost contact with the cluster: {whose} has not answered a heartbeat for {waited:.1f}s "
                "(a network partition, or the chief stopped)"
            )
        return self.failure

    def start(self) -> None:
        """Runs `beat` every ``interval`` seconds on a daemon thread until `stop`."""
        self._last_round = self._clock()  # connecting counts as a round: it is bounded the same way
        self._thread = threading.Thread(target=self._run, name="phalanx-heartbeat", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            store = self._connect()
        except Exception as exc:
            log.debug("heartbeat store unreachable", exc_info=True)
            self.failure = self.failure or f"the chief {self._name(0)} is unreachable ({exc})"
            return
        while not self._stop.is_set():
            self.beat(store)
            self._stop.wait(self._interval)

    def stop(self) -> None:
        """Stops the thread and waits for it (a daemon stopped inside a store call at
        interpreter exit aborts the process), except when its store stopped answering: a
        thread blocked on a partitioned link never returns, and the process must still exit."""
        self._stop.set()
        thread = self._thread
        if thread is not None and thread.is_alive() and thread is not threading.current_thread():
            thread.join(timeout=15 if self.dead_peer() is None else 2 * self._interval)


def seconds_from_env(name: str, default: float) -> float:
    """A positive number of seconds from environment variable ``name`` (``default`` if unset).

    Raises:
        ValueError: The variable is set but is not a positive number.
    """
    return settings.current().seconds(name, default)
