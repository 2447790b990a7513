"""How a worker group waits on a collective, and whom it names when one fails (all workers).

`WorkerGroup` waits on every collective through `GroupFailures.wait`: in slices of
`POLL_SECONDS`, looking at the health check (heartbeats), the stall inspector's verdict, the
signature check's report and the deadline between slices. A failure is sticky: the first
reason found is kept, and every later collective of the group raises it at once. Errors are
`PeerUnavailableError` naming the missing task(s), or `CollectiveMismatchError` when the
workers called different collectives (`phalanx.communication.checks.collective_check`,
`phalanx.communication.checks.stall_inspector`).
"""

from __future__ import annotations

import abc
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from phalanx import timeline
from phalanx.communication.checks.collective_check import CollectiveCheck
from phalanx.communication.checks.collective_watch import CollectiveWatch
from phalanx.communication.checks.health import HEARTBEAT_INTERVAL, HealthCheck, PeerUnavailableError
from phalanx.communication.checks.stall_inspector import CollectiveMismatchError
from phalanx.communication.group.work import PeerGoneError
from phalanx.communication.transports.base import CollectivesDifferError
from phalanx.status.counters import COUNTERS

__all__ = ["POLL_SECONDS", "GroupFailures"]

POLL_SECONDS = 0.5
_RESTART_HINT = "HINT: check that task's log; restart the job (BackupAndRestore resumes it)."


class GroupFailures(abc.ABC):
    """A group's failure state and its watched waits (see the module doc)."""

    rank: int
    world_size: int
    backend: str
    _name: Callable[[int], str]
    _failure: str | None
    _closed: bool
    _collective_timeout: float
    _check: CollectiveCheck
    _subgroup_checks: list[CollectiveCheck]  # of groups made with torch.distributed.new_group
    _watch: CollectiveWatch
    _health: HealthCheck

    @property
    @abc.abstractmethod
    def _lost(self) -> str | None:
        """A verdict on lost members from outside the group (an elastic job's membership)."""

    def _report(self) -> CollectiveMismatchError | None:
        """The mismatch the signature check reported, on this group or one of its subgroups."""
        for check in (self._check, *self._subgroup_checks):
            if check.report is not None:
                return check.report
        return None

    # ---------------------------------------------------------------- failures
    @property
    def failure(self) -> str | None:
        """Why this group can no longer be used, or None while it is healthy."""
        report = self._report()
        return (
            self._failure
            or (str(report) if report else None)
            or self._health.dead_peer()
            or self._watch.verdict
            or self._lost
        )

    def _raise(self, what: str, cause: BaseException | None = None) -> None:
        self._failure = self.failure or "it was closed"
        report = self._report()
        if self._watch.explains(self._failure) or (report is not None and self._failure == str(report)):
            raise CollectiveMismatchError(self._failure) from cause
        raise PeerUnavailableError(
            f"{what} failed on {self._name(self.rank)}: {self._failure}. {_RESTART_HINT}"
        ) from cause

    def _check_usable(self, what: str) -> None:
        if self._closed:
            raise RuntimeError(
                f"{what} was called after the strategy was closed. HINT: create a new "
                "MultiWorkerMirroredStrategy (on every worker)."
            )
        if self.failure is not None:
            self._raise(what)

    def _blame(self, exc: RuntimeError, what: str) -> None:
        """A collective failed inside torch.distributed: name the task responsible."""
        text = str(exc).splitlines()[0] if str(exc) else repr(exc)
        reported = self._check.peer_report()  # a peer saw a mismatch and left
        if reported is not None and self.failure is None:
            self._failure = str(reported)
        suspicion = self._watch.suspicion()  # a peer that raised on a mismatch and exited
        if suspicion is not None and self.failure is None:
            self._failure = suspicion
        elif "timed out" in text.lower() and self.failure is None:
            self._failure = (
                f"no answer within the process group's timeout ({self._collective_timeout:g}s; "
                f"every worker still sends heartbeats, so one is stuck or called another collective): {text}"
            )
        elif self.world_size == 2:
            self._failure = self.failure or f"{self._name(1 - self.rank)} closed its connection ({text})"
        else:  # the heartbeats tell which peer is gone
            deadline = time.monotonic() + self._health.timeout + 2 * HEARTBEAT_INTERVAL
            while self.failure is None and time.monotonic() < deadline:
                time.sleep(0.1)
            self._failure = self.failure or f"a peer closed its connection ({text})"
        self._raise(what, exc)

    # ---------------------------------------------------------------- waiting (all workers)
    def wait(self, work: Any, what: str, timeout: float | None = None, where_issued: bool = False) -> None:
        """Waits for an async collective, watching the health check and the deadline.

        Args:
            work: What ``torch.distributed.<collective>(..., async_op=True)`` returned.
            what: The collective, for messages.
            timeout: Seconds (default: the group's collective timeout).
            where_issued: The stall inspector names the site that issued it as where this
                worker waits (the gradient buckets, which wait inside the same backward call),
                instead of walking the stack again.

        Raises:
            PeerUnavailableError: A peer died or stopped answering, or the deadline passed.
        """
        self._watched_wait(work, what, timeout, where_issued)

    def _watched_wait(self, work: Any, what: str, timeout: float | None, where_issued: bool) -> None:
        with timeline.span(what, "collective"):  # free unless PHALANX_TIMELINE is set
            self._watch.begin_wait(work, what, where_issued)
            start = time.monotonic()
            try:
                self._wait_for(work, what, self._collective_timeout if timeout is None else timeout)
            finally:
                self._watch.end_wait()
                COUNTERS.waited(time.monotonic() - start)  # the status page's wait fraction

    def _wait_for(self, work: Any, what: str, limit: float) -> None:
        deadline = time.monotonic() + limit
        while True:
            remaining = deadline - time.monotonic()
            try:
                if self._wait_some(work, min(POLL_SECONDS, max(remaining, 0.001))):
                    return
            except RuntimeError as exc:
                self._on_error(exc, work, what)
            if self.failure is not None:
                self._raise(what)
            if time.monotonic() >= deadline:
                self._failure = f"no answer within {limit:g}s"
                self._raise(what)

    def _on_error(self, exc: RuntimeError, work: Any, what: str) -> None:
        """Raises the error of a wait that failed (a timed wait that ran out returns)."""
        if isinstance(exc, CollectiveMismatchError):  # a transport saw another code
            self._failure = self._failure or str(exc)
            raise CollectiveMismatchError(self._failure) from exc
        if isinstance(exc, PeerGoneError):  # a peer that saw a mismatch closed its connections
            reported = self._check.peer_report()
            if reported is not None:
                self._failure = self._failure or str(reported)
                raise CollectiveMismatchError(self._failure) from exc
        if isinstance(exc, CollectivesDifferError):  # the TLS ring saw another collective (unsigned)
            verdict = self._verdict_soon()
            self._failure = self._failure or verdict or exc.failure
            raise CollectiveMismatchError(self._failure) from exc
        if isinstance(exc, PeerGoneError):  # our own transports name the peer
            # a peer that raised on a mismatch and exited first is explained as one
            self._failure = self.failure or self._watch.suspicion() or exc.failure
            self._raise(what, exc)
        if work.is_completed():
            # A timed wait can run out just as the collective finishes: ask the finished work
            # for its own outcome, so only a real error (a peer's socket closed) is blamed.
            try:
                work.wait()
            except RuntimeError as final:
                self._blame(final, what)

    def _verdict_soon(self) -> str | None:
        """The mismatch the stall inspector proves within a gossip round (it names where each
        worker is, and the call sites), else None."""
        deadline = time.monotonic() + 2 * HEARTBEAT_INTERVAL + POLL_SECONDS
        while self._watch.enabled and time.monotonic() < deadline:
            proven = self._watch.suspicion()
            if proven is not None:
                return proven
            time.sleep(0.05)
        return None

    def _wait_some(self, work: Any, seconds: float) -> bool:
        """True once ``work`` finished; False after ``seconds`` without (raises its error)."""
        if self.backend == "gloo":
            # Blocks on a condition variable: wakes exactly at completion, no polling.
            work.wait(timedelta(seconds=seconds))  # raises "timed out" while still running
            return True
        end = time.monotonic() + seconds  # nccl: its timed wait may abort the communicator
        pause = 0.00005
        while not work.is_completed():
            if time.monotonic() > end:
                return False
            time.sleep(pause)  # sleep, never spin: the communication threads need the cores
            pause = min(0.001, pause * 2)
        work.wait()
        return True
