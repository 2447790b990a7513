"""Worker loss on the chief: a state machine of the workers and a policy that decides.

The coordinator's worker threads feed events in and carry out the decisions that come back
(`ClusterCoordinator`); nothing here blocks, sleeps or talks to a worker, so every transition
is tested on its own, with a fake clock (tests/unit/ps/coordinator/test_worker_loss.py).

=========  =====================  =========  =========================================================
state      event                  new state  decision (`FailurePolicy`, TF's rules)
=========  =====================  =========  =========================================================
RUNNING    ``worker_lost``        LOST       RETRY: its function goes back to the queue, another
                                             worker runs it; this worker's thread waits for it (a
                                             process that died, or a worker silent for the heartbeat
                                             timeout: a network partition is a lost worker)
RUNNING    ``closure_timed_out``  HUNG       ABORT: the worker answers heartbeats but its function
                                             ran past the closure deadline: the function's own bug,
                                             not the worker's, so it fails with its error (not
                                             retried); the thread waits until the worker is idle
LOST       ``worker_back``        RUNNING    RESUME: the thread serves functions again (the worker
                                             answers and runs nothing: a healed partition, a restart)
HUNG       ``worker_back``        RUNNING    RESUME: the hung function returned at last
LOST/HUNG  ``waited``             same       WAIT; or PROBE once no worker has been RUNNING for
                                             ``recovery_timeout`` seconds with functions pending
LOST/HUNG  ``probed``             same       WAIT if a worker is available (its thread will notice),
                                             else FAIL: the queued functions fail with
                                             `NoWorkerAvailableError` naming the lost and hung workers
=========  =====================  =========  =========================================================

"No worker available" starts when the last RUNNING worker is lost or hung, and ends when any
runs again.
"""

from __future__ import annotations

import dataclasses
import enum
import threading
import time
from collections.abc import Callable, Sequence

__all__ = [
    "Action",
    "Decision",
    "Event",
    "FailurePolicy",
    "FleetStatus",
    "NoWorkerAvailableError",
    "WorkerState",
    "WorkerStateMachine",
]


class NoWorkerAvailableError(RuntimeError):
    """Every worker was lost for longer than the coordinator's recovery timeout."""


class WorkerState(enum.Enum):
    """Where one worker stands, as the chief sees it."""

    RUNNING = "running"  # its thread takes functions from the queue
    LOST = "lost"  # unreachable, or silent: its thread pings it until it answers
    HUNG = "hung"  # answers, but still runs a function past its deadline: pinged until idle


class Event(enum.Enum):
    """What a worker thread reports."""

    WORKER_LOST = "worker_lost"  # running a function raised WorkerLostError
    CLOSURE_TIMED_OUT = "closure_timed_out"  # running a function raised ClosureTimeoutError
    WORKER_BACK = "worker_back"  # the lost or hung worker answered a ping, running nothing
    WAITED = "waited"  # a wait for the lost worker ended without an answer
    PROBE_ANSWERED = "probe_answered"  # a worker answered the probe (PROBE)
    PROBE_UNANSWERED = "probe_unanswered"  # no worker answered the probe


class Action(enum.Enum):
    """What a worker thread does next."""

    RETRY = "retry"  # put the function back at the front of the queue: another worker runs it
    ABORT = "abort"  # the function fails with its own error (its deadline passed on a live worker)
    RESUME = "resume"  # serve functions again
    WAIT = "wait"  # keep waiting for the lost worker
    PROBE = "probe"  # ping every worker once before failing (a thread may not have noticed one is back)
    FAIL = "fail"  # fail the queued functions with `Decision.error`


@dataclasses.dataclass(frozen=True)
class Decision:
    """A policy's answer: the action, and for FAIL the error the queued functions get."""

    action: Action
    error: NoWorkerAvailableError | None = None


@dataclasses.dataclass(frozen=True)
class FleetStatus:
    """What the policy decides on.

    Attributes:
        lost: The names of the lost workers, by index.
        all_lost_for: Seconds since the last running worker was lost or hung; None while one runs.
        pending: Functions queued or running.
        hung: The names of the hung workers, by index.
    """

    lost: tuple[str, ...]
    all_lost_for: float | None
    pending: int
    hung: tuple[str, ...] = ()


class FailurePolicy:
    """TF's rules for lost workers: a lost worker's function runs on another worker; the
    chief waits for lost workers and gives up only when no worker at all was available for
    ``recovery_timeout`` seconds while functions were pending.

    Args:
        recovery_timeout: Seconds (``ClusterCoordinator(worker_recovery_timeout=...)``).
    """

    def __init__(self, recovery_timeout: float) -> None:
        self.recovery_timeout = recovery_timeout

    def make_decision(self, event: Event, status: FleetStatus) -> Decision:
        """The action for ``event`` given ``status`` (pure: no clock, no I/O)."""
        if event is Event.WORKER_LOST:
            return Decision(Action.RETRY)
        if event is Event.CLOSURE_TIMED_OUT:
            return Decision(Action.ABORT)
        if event is Event.WORKER_BACK:
            return Decision(Action.RESUME)
        if not self._gave_up(status) or event is Event.PROBE_ANSWERED:
            return Decision(Action.WAIT)
        if event is Event.WAITED:
            return Decision(Action.PROBE)
        return Decision(Action.FAIL, self._error(status))

    def _gave_up(self, status: FleetStatus) -> bool:
        lost_for = status.all_lost_for
        return lost_for is not None and lost_for >= self.recovery_timeout and status.pending > 0

    def _error(self, status: FleetStatus) -> NoWorkerAvailableError:
        hung = f"; still running a function past its deadline {list(status.hung)}" if status.hung else ""
        return NoWorkerAvailableError(
            f"No worker was available for {self.recovery_timeout:g}s: lost {list(status.lost)}{hung}. "
            "HINT: restart the worker tasks (they rejoin by themselves), or check their logs."
        )


class WorkerStateMachine:
    """The state of every worker, as the coordinator's threads report it. Thread-safe; pure
    apart from its lock (``clock`` gives the time).

    Args:
        names: The workers' names in messages, by index.
        policy: Decides what each event calls for.
        clock: Monotonic seconds (a fake one in tests).
    """

    def __init__(
        self, names: Sequence[str], policy: FailurePolicy, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._names = list(names)
        self._states = [WorkerState.RUNNING] * len(self._names)
        self._policy, self._clock = policy, clock
        self._all_lost_since: float | None = None
        self._lock = threading.Lock()

    def state(self, index: int) -> WorkerState:
        """Worker ``index``'s state."""
        return self._states[index]

    @property
    def lost(self) -> frozenset[int]:
        """The indices of the lost workers."""
        with self._lock:
            return frozenset(i for i, s in enumerate(self._states) if s is WorkerState.LOST)

    def worker_lost(self, index: int) -> Decision:
        """Worker ``index`` was lost running a function: RUNNING -> LOST (RETRY)."""
        return self._transition(index, WorkerState.LOST, Event.WORKER_LOST)

    @property
    def hung(self) -> frozenset[int]:
        """The indices of the hung workers."""
        with self._lock:
            return frozenset(i for i, s in enumerate(self._states) if s is WorkerState.HUNG)

    def closure_timed_out(self, index: int) -> Decision:
        """Worker ``index`` answers but its function overran the deadline: RUNNING -> HUNG (ABORT)."""
        return self._transition(index, WorkerState.HUNG, Event.CLOSURE_TIMED_OUT)

    def worker_back(self, index: int) -> Decision:
        """Lost or hung worker ``index`` answered, running nothing: LOST/HUNG -> RUNNING (RESUME)."""
        return self._transition(index, WorkerState.RUNNING, Event.WORKER_BACK)

    def waited(self, pending: int) -> Decision:
        """A lost worker's thread waited without an answer; ``pending`` functions are queued
        or running (WAIT or PROBE)."""
        with self._lock:
            return self._policy.make_decision(Event.WAITED, self._status(pending))

    def probed(self, answered: bool, pending: int) -> Decision:
        """The probe that PROBE asked for: whether any worker answered (WAIT or FAIL)."""
        event = Event.PROBE_ANSWERED if answered else Event.PROBE_UNANSWERED
        with self._lock:
            return self._policy.make_decision(event, self._status(pending))

    def _transition(self, index: int, state: WorkerState, event: Event) -> Decision:
        with self._lock:
            self._states[index] = state
            if WorkerState.RUNNING in self._states:
                self._all_lost_since = None
            elif self._all_lost_since is None:
                self._all_lost_since = self._clock()
            return self._policy.make_decision(event, self._status(pending=0))

    def _status(self, pending: int) -> FleetStatus:
        since = self._all_lost_since
        return FleetStatus(
            lost=self._named(WorkerState.LOST),
            all_lost_for=None if since is None else self._clock() - since,
            pending=pending,
            hung=self._named(WorkerState.HUNG),
        )

    def _named(self, state: WorkerState) -> tuple[str, ...]:
        return tuple(n for n, s in zip(self._names, self._states, strict=True) if s is state)
