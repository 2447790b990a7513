"""How long the chief waits for anything: the coordinator's deadlines, their environment
variables, and the bounded wait that `ClusterCoordinator.join` and `RemoteValue.fetch` use.

=====================  ======================================  ==========================  =======
deadline               what it bounds                          environment variable        default
=====================  ======================================  ==========================  =======
``closure_timeout``    one function on a worker that still     PHALANX_CLOSURE_TIMEOUT_    3600 s
                       answers heartbeats (then it fails)      SECONDS
``heartbeat_timeout``  a worker silent this long is lost (its  PHALANX_HEARTBEAT_TIMEOUT_  10 s
                       function reruns elsewhere)              SECONDS
``wait_timeout``       ``join()``/``fetch()`` with no timeout  PHALANX_WAIT_TIMEOUT_       see
                       of their own: raise once no function    SECONDS                     below
                       finished for this long
ps call timeout        one call to a ps task (read, write,     PHALANX_PS_CALL_TIMEOUT_    60 s
                       gradients) by the chief or a worker:    SECONDS
                       a partitioned ps fails the function
                       with `TaskUnavailableError` naming it
=====================  ======================================  ==========================  =======

The default ``wait_timeout`` is longer than anything the coordinator itself may take to finish
a function (its closure deadline, or the worker recovery timeout, plus a heartbeat timeout and a
minute), so it fires only if something is wrong beyond those deadlines; the worker recovery
timeout is ``ClusterCoordinator(worker_recovery_timeout=...)``.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

from phalanx.communication.group.worker_group import (
    DEFAULT_HEARTBEAT_TIMEOUT,
    HEARTBEAT_TIMEOUT_ENV,
    seconds_from_env,
)

__all__ = [
    "CLOSURE_TIMEOUT_ENV",
    "DEFAULT_CLOSURE_TIMEOUT",
    "DEFAULT_HEARTBEAT_TIMEOUT",
    "DEFAULT_PS_CALL_TIMEOUT",
    "PS_CALL_TIMEOUT_ENV",
    "WAIT_TIMEOUT_ENV",
    "Deadlines",
    "Waiter",
    "ps_call_timeout",
]

CLOSURE_TIMEOUT_ENV = "PHALANX_CLOSURE_TIMEOUT_SECONDS"
WAIT_TIMEOUT_ENV = "PHALANX_WAIT_TIMEOUT_SECONDS"
DEFAULT_CLOSURE_TIMEOUT = 3600.0
PS_CALL_TIMEOUT_ENV = "PHALANX_PS_CALL_TIMEOUT_SECONDS"
DEFAULT_PS_CALL_TIMEOUT = 60.0
_SLICE = 0.5  # how often a wait looks at the clock


def _positive(name: str, value: float) -> float:
    if not value > 0:
        raise ValueError(
            f"ClusterCoordinator's {name} must be a positive number of seconds. Received: {value!r}. "
            f"HINT: leave it unset for the default, or e.g. {name}=600."
        )
    return float(value)


def ps_call_timeout() -> float:
    """The deadline of one call to a ps task: ``PHALANX_PS_CALL_TIMEOUT_SECONDS``, else 60 s.

    Raises:
        ValueError: The variable is set but is not a positive number.
    """
    return seconds_from_env(PS_CALL_TIMEOUT_ENV, DEFAULT_PS_CALL_TIMEOUT)


def _given(value: float | None, env: str, default: float) -> float:
    return seconds_from_env(env, default) if value is None else value


@dataclasses.dataclass(frozen=True)
class Deadlines:
    """The coordinator's deadlines in seconds (see the module docstring)."""

    closure_timeout: float
    heartbeat_timeout: float
    recovery_timeout: float
    wait_timeout: float

    @classmethod
    def resolve(
        cls,
        closure_timeout: float | None = None,
        heartbeat_timeout: float | None = None,
        recovery_timeout: float = 3600.0,
        wait_timeout: float | None = None,
    ) -> Deadlines:
        """The deadlines from the arguments, else the environment, else the defaults.

        Raises:
            ValueError: A deadline (argument or variable) is not a positive number.
        """
        closure = _positive(
            "closure_timeout", _given(closure_timeout, CLOSURE_TIMEOUT_ENV, DEFAULT_CLOSURE_TIMEOUT)
        )
        heartbeat = _positive(
            "heartbeat_timeout", _given(heartbeat_timeout, HEARTBEAT_TIMEOUT_ENV, DEFAULT_HEARTBEAT_TIMEOUT)
        )
        recovery = _positive("worker_recovery_timeout", recovery_timeout)
        longest = max(closure, recovery) + heartbeat + 60.0
        wait = _positive("wait_timeout", _given(wait_timeout, WAIT_TIMEOUT_ENV, longest))
        return cls(closure, heartbeat, recovery, wait)


class Waiter:
    """Waits for something scheduled, bounded: by the caller's ``timeout``, or else by
    ``stall`` seconds in which no scheduled function finished.

    Args:
        stall: The bound without a timeout (the coordinator's ``wait_timeout``).
        last_progress: The monotonic time a scheduled function last finished (or was queued).
        report: What is pending, for the error (which functions, where, for how long).
    """

    def __init__(self, stall: float, last_progress: Callable[[], float], report: Callable[[], str]) -> None:
        self.stall, self._last_progress, self._report = stall, last_progress, report

    @classmethod
    def alone(cls) -> Waiter:
        """For a value no coordinator made (tests): the default bound from its creation."""
        made = time.monotonic()
        stall = Deadlines.resolve().wait_timeout
        return cls(stall, lambda: made, lambda: "nothing is known: no coordinator made this value")

    def wait(self, ready: Callable[[float], bool], timeout: float | None, what: str) -> None:
        """Calls ``ready(seconds)`` (which waits up to that long) until it returns True.

        Args:
            ready: Waits up to the given seconds; whether the awaited thing is done (it may
                raise the thing's error).
            timeout: The caller's bound in seconds; None: the stall bound.
            what: The waiter, for the error (e.g. "join()").

        Raises:
            TimeoutError: The bound passed; the message names what is pending.
        """
        start = time.monotonic()
        while True:
            now = time.monotonic()
            if timeout is not None:
                left = start + timeout - now
            else:
                left = max(start, self._last_progress()) + self.stall - now
            if ready(min(max(left, 0.0), _SLICE)):
                return
            if left <= 0:
                raise TimeoutError(self._message(what, timeout, time.monotonic() - start))

    def _message(self, what: str, timeout: float | None, waited: float) -> str:
        if timeout is not None:
            return (
                f"{what} did not finish within its timeout of {timeout:g}s. Received: timeout={timeout:g}; "
                f"pending: {self._report()}. HINT: call coordinator.join() to wait for every scheduled "
                "function, or wait longer."
            )
        return (
            f"{what} waited {waited:.0f}s and no scheduled function finished for {self.stall:g}s, the "
            f"coordinator's wait_timeout. Received: pending: {self._report()}. HINT: the log of the "
            "worker running the function shows where it is; to wait longer, pass a timeout, or set "
            f"ClusterCoordinator(wait_timeout=...) or {WAIT_TIMEOUT_ENV}."
        )
