"""The stall inspector: workers stuck in collectives that cannot meet are named within seconds.

Every worker's `CollectiveTracker` state (the collective it issued last and the one it waits
in, `phalanx.communication.checks.signatures`) rides on the heartbeat that `HealthCheck` writes to
the chief's store every second, only when it changed; the heartbeat round reads every peer's
in the same ``multi_get`` as their counters, so the inspector adds no round trip to any
collective. After each round every worker's inspector looks at all the states:

* a worker that has waited in collective #N longer than the **stall bound** (30 s,
  ``PHALANX_STALL_TIMEOUT_SECONDS``), while some other worker is not waiting in a matching #N
  (it waits in another collective or number, or it issued no #N and is not waiting: it runs
  on, or is closing), is a **mismatch**: every worker's inspector reaches the same verdict,
  and every worker raises `CollectiveMismatchError` naming each worker's pending call site
  and sequence number: the waiting ones from their collective's wait loop (it polls the
  verdict every 0.5 s), the one that ran on from its next collective or from ``close()``;
* at the shorter **warning bound** (10 s, ``PHALANX_STALL_WARNING_SECONDS``) the chief logs a
  warning naming the laggards, once per stall.

Trade-off (docs/multi_worker.md, "Mismatched collectives"): a worker that computes alone for
longer than the stall bound while the others wait (the chief evaluating or saving without
collectives) cannot be told from one that took another path: it gets the warning, and the
error once it exceeds the bound. Raise the bound for such programs, or turn the inspector off
with ``PHALANX_STALL_INSPECTOR=0``. Workers that all wait in the same collective #N are never
a mismatch: a slow or dead peer is the health check's business.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from phalanx import settings
from phalanx.communication.checks.health import PeerUnavailableError, seconds_from_env
from phalanx.communication.checks.signatures import CollectiveTracker, Signature, WorkerState

__all__ = [
    "DEBUG_ENV",
    "DEFAULT_STALL_TIMEOUT",
    "DEFAULT_STALL_WARNING",
    "INSPECTOR_ENV",
    "STALL_TIMEOUT_ENV",
    "STALL_WARNING_ENV",
    "CollectiveMismatchError",
    "StallInspector",
    "StallSettings",
]

log = logging.getLogger("phalanx")

STALL_TIMEOUT_ENV = "PHALANX_STALL_TIMEOUT_SECONDS"
STALL_WARNING_ENV = "PHALANX_STALL_WARNING_SECONDS"
INSPECTOR_ENV = "PHALANX_STALL_INSPECTOR"
DEBUG_ENV = "PHALANX_DISTRIBUTED_DEBUG"
DEFAULT_STALL_TIMEOUT = 30.0
DEFAULT_STALL_WARNING = 10.0
MISMATCH_HINT = (
    "HINT: every worker must call the same collectives in the same order. The usual causes: a "
    "step skipped on some workers (backward and optimizer.step() skipped after a non-finite "
    "loss seen by one worker), a collective called on some workers only (rank-conditional evaluation, "
    "logging or strategy.reduce), uneven data outside the distributed iterator, an early `break`. "
    f"Set {DEBUG_ENV}=DETAIL to check every collective; if a worker legitimately computes alone "
    f"longer than the bound, raise {STALL_TIMEOUT_ENV} (docs/multi_worker.md, 'Mismatched collectives')."
)


class CollectiveMismatchError(PeerUnavailableError):
    """The workers (or replicas) wait in collectives that cannot meet; the message names each
    one's pending collective, sequence number and call site."""


@dataclass(frozen=True)
class StallSettings:
    """The inspector's bounds and switches.

    Args:
        enabled: Whether collectives carry signatures and the inspector runs.
        timeout: Seconds of mismatched waiting before every worker raises.
        warning: Seconds before the chief logs a warning (below ``timeout``).
        debug: Whether every collective is checked across workers first (``DETAIL``).
    """

    enabled: bool = True
    timeout: float = DEFAULT_STALL_TIMEOUT
    warning: float = DEFAULT_STALL_WARNING
    debug: bool = False

    @staticmethod
    def from_env(timeout: float | None = None, warning: float | None = None) -> StallSettings:
        """Settings from the arguments, else ``PHALANX_STALL_TIMEOUT_SECONDS`` (30),
        ``PHALANX_STALL_WARNING_SECONDS`` (10, at most a third of the timeout when unset),
        ``PHALANX_STALL_INSPECTOR`` (1; 0/false/off turns it off) and
        ``PHALANX_DISTRIBUTED_DEBUG`` (OFF, INFO or DETAIL).

        Raises:
            ValueError: A bound is not positive, the warning is not below the timeout, or a
                switch has another value.
        """
        stall = timeout if timeout is not None else seconds_from_env(STALL_TIMEOUT_ENV, DEFAULT_STALL_TIMEOUT)
        default_warning = min(DEFAULT_STALL_WARNING, stall / 3)
        warn = warning if warning is not None else seconds_from_env(STALL_WARNING_ENV, default_warning)
        if not 0 < warn < stall:
            raise ValueError(
                f"The stall warning must come before the stall error. Received: warning {warn:g}s, "
                f"timeout {stall:g}s. HINT: set {STALL_WARNING_ENV} below {STALL_TIMEOUT_ENV}."
            )
        knobs = settings.current()
        enabled = knobs.stall_inspector
        return StallSettings(enabled, stall, warn, enabled and knobs.distributed_debug == "DETAIL")


def _joins(state: WorkerState, reference: Signature) -> bool:
    """Whether a worker takes part in the collective ``reference``: it waits in a matching
    one, or it issued a matching one (or later ones, asynchronously) and runs on or closes
    (a closing worker took part in every collective it issued, and will issue no more)."""
    if state.waiting is not None:
        return state.waiting.signature.matches(reference)
    if state.issued < reference.seq:
        return False
    last = state.last
    return last is None or last.seq != reference.seq or last.matches(reference)


def _proven(laggard: WorkerState, reference: Signature) -> bool:
    """Whether a laggard's state proves the mismatch even if it is a round old: it closes, or
    it waits in another collective of the same number (a smaller number may be stale: it may
    have moved on since; a dead peer's state stays at its last one)."""
    if laggard.closing is not None and laggard.waiting is None:
        return True
    waiting = laggard.waiting
    return waiting is not None and waiting.signature.seq == reference.seq


class StallInspector:
    """Compares every worker's collective state after each heartbeat round (see the module doc).

    `HealthCheck` calls `outgoing`, `incoming` and `review` on its thread; the collectives'
    wait loops read `verdict`.

    Args:
        rank, world_size: This worker and the number of workers.
        name: ``name(rank) -> "worker:1 (host:port)"``, for messages.
        tracker: This worker's collectives.
        settings: The bounds.
        clock: Monotonic clock (a fake one in tests).
    """

    def __init__(
        self,
        rank: int,
        world_size: int,
        name: Callable[[int], str],
        tracker: CollectiveTracker,
        settings: StallSettings,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._rank, self._world, self._name = rank, world_size, name
        self._tracker, self._settings, self._clock = tracker, settings, clock
        self._published = -1
        self._peers: dict[int, WorkerState] = {}
        self._raw: dict[int, bytes] = {}
        self._peer_waiting_since: dict[int, tuple[int, float]] = {}  # rank -> (seq, first seen)
        self._warned: tuple[int, ...] | None = None
        self.verdict: str | None = None

    @staticmethod
    def key(rank: int) -> str:
        """The store key of ``rank``'s collective state."""
        return f"collectives/{rank}"

    def initial(self) -> bytes:
        """The state every worker publishes before it checks in (so every key exists)."""
        self._published = self._tracker.version
        return self._tracker.state().to_bytes()

    # ---------------------------------------------------------------- the heartbeat thread
    def outgoing(self) -> bytes | None:
        """This worker's state when it changed since the last round, else None."""
        version = self._tracker.version
        if version == self._published:
            return None
        self._published = version
        return self._tracker.state().to_bytes()

    def incoming(self, peer: int, data: bytes) -> None:
        """Notes a peer's state as read in this round."""
        now = self._clock()
        if self._raw.get(peer) != data:
            self._raw[peer] = data
            self._peers[peer] = WorkerState.from_bytes(data)
        waiting = self._peers[peer].waiting
        if waiting is None:
            self._peer_waiting_since.pop(peer, None)
        elif self._peer_waiting_since.get(peer, (None,))[0] != waiting.signature.seq:
            self._peer_waiting_since[peer] = (waiting.signature.seq, now)

    def peer_state(self, peer: int) -> WorkerState | None:
        """``peer``'s state as last read (at most a heartbeat round old), or None."""
        return self._peers.get(peer)

    def review(self) -> str | None:
        """Warns or decides after a round (see the module doc); returns the verdict, if any."""
        if self.verdict is not None or len(self._peers) < self._world - 1:
            return self.verdict
        states, waited = self._snapshot()
        if not waited:
            self._warned = None
            return None
        longest, waiter = max((seconds, rank) for rank, seconds in waited.items())
        laggards = self._laggards(states, waiter)
        if not laggards:
            return None
        if longest >= self._settings.timeout:
            self.verdict = self._message(states, waiter, laggards, longest)
        elif longest >= self._settings.warning and self._warned != tuple(laggards):
            self._warned = tuple(laggards)
            if self._rank == 0:  # the chief's log names them once per stall (as Horovod's)
                log.warning("%s", self._warning(states, waiter, laggards, longest))
        return self.verdict

    def suspicion(self) -> str | None:
        """A mismatch the last states prove, however short (None if none): a peer that
        raised its verdict and exited first is still explained on the others.

        Proof needs every laggard to be closing or waiting in another collective of the same
        number (`_proven`): a laggard that computes may still issue the collective, or may
        have died (the health check's business), so it is a mismatch only after the bound.
        """
        if self.verdict is not None or len(self._peers) < self._world - 1:
            return self.verdict
        states, waited = self._snapshot()
        if not waited:
            return None
        longest, waiter = max((seconds, rank) for rank, seconds in waited.items())
        laggards = self._laggards(states, waiter)
        reference = states[waiter].waiting
        assert reference is not None
        if not laggards or not all(_proven(states[r], reference.signature) for r in laggards):
            return None
        return self._message(states, waiter, laggards, longest)

    def someone_waits(self) -> bool:
        """Whether a peer waited in a collective in the last states read."""
        return any(state.waiting is not None for state in self._peers.values())

    # ---------------------------------------------------------------- verdicts
    def _snapshot(self) -> tuple[dict[int, WorkerState], dict[int, float]]:
        now = self._clock()
        states = {**self._peers, self._rank: self._tracker.state()}
        waited = {peer: now - since for peer, (_, since) in self._peer_waiting_since.items()}
        own = self._tracker.waited()
        if own is not None and states[self._rank].waiting is not None:
            waited[self._rank] = own
        return states, waited

    @staticmethod
    def _laggards(states: dict[int, WorkerState], waiter: int) -> list[int]:
        """The workers not waiting in a collective that matches ``waiter``'s."""
        pending = states[waiter].waiting
        assert pending is not None
        reference = pending.signature
        return [rank for rank, state in sorted(states.items()) if not _joins(state, reference)]

    def _lines(self, states: dict[int, WorkerState]) -> str:
        return "; ".join(f"{self._name(rank)} {states[rank].describe()}" for rank in sorted(states))

    def _message(
        self, states: dict[int, WorkerState], waiter: int, laggards: list[int], waited: float
    ) -> str:
        return (
            "Every worker must call the same collectives in the same order, but "
            f"{self._name(waiter)} has waited {waited:.1f}s (the stall bound is "
            f"{self._settings.timeout:g}s, {STALL_TIMEOUT_ENV}) in a collective that "
            f"{[self._name(r) for r in laggards]} did not join: the workers took different paths. "
            f"Received: {self._lines(states)}. {MISMATCH_HINT}"
        )

    def _warning(
        self, states: dict[int, WorkerState], waiter: int, laggards: list[int], waited: float
    ) -> str:
        return (
            f"Stalled collective: {self._name(waiter)} has waited {waited:.0f}s for "
            f"{[self._name(r) for r in laggards]}, which are not in the same collective: "
            f"{self._lines(states)}. Every worker raises CollectiveMismatchError after "
            f"{self._settings.timeout:g}s ({STALL_TIMEOUT_ENV})."
        )
