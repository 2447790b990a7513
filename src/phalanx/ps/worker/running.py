"""The worker's side of the coordinator's heartbeat: which function it runs, and whether the
coordinator still waits for it.

While a function runs, the coordinator pings its worker every second naming the function
(``{"closure": id}``) and counts the worker lost after ``heartbeat_timeout`` seconds without an
answer; the ping's reply says what the worker runs and for how long, so a function that hangs
on a live worker is told from a lost worker. The worker applies the same bound from its side:
a function that has not been asked about for ``heartbeat_timeout`` seconds (a network partition
cut it off from the coordinator, which reruns it elsewhere) writes nothing more to the ps tasks
— `check_wanted` raises before each write — so a partition does not apply a step twice.
Each call to a ps task for the function carries its ``fence`` tag (`tag`), which lets a ps
task refuse what arrives late (`phalanx.ps.coordinator.fencing`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["ClosureAbandonedError", "RunningClosure"]


class ClosureAbandonedError(RuntimeError):
    """The coordinator stopped asking about this function: it was rerun on another worker."""


@dataclasses.dataclass
class _Current:
    closure: int
    started: float
    heard: float  # the last time the coordinator asked about it (or sent it)
    heartbeat_timeout: float | None
    fence: list[Any] | None  # [session, worker, run] for the ps tasks' fences


class RunningClosure:
    """What this worker runs now (thread-safe: the function runs on one server thread, pings
    arrive on others).

    Args:
        clock: Monotonic seconds (a fake one in tests).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._current: _Current | None = None
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def running(
        self, closure: int, heartbeat_timeout: float | None, fence: list[Any] | None = None
    ) -> Iterator[None]:
        """Marks function ``closure`` as running for the duration of the ``with`` block;
        ``fence`` is the tag its calls to the ps tasks carry."""
        now = self._clock()
        with self._lock:
            self._current = _Current(closure, now, now, heartbeat_timeout, fence)
        try:
            yield
        finally:
            with self._lock:
                self._current = None

    def heard(self, closure: Any) -> None:
        """The coordinator pinged about function ``closure`` (None: a ping about none)."""
        with self._lock:
            if self._current is not None and closure == self._current.closure:
                self._current.heard = self._clock()

    def tag(self) -> list[Any] | None:
        """The fence tag of the running function (None when idle or untagged)."""
        with self._lock:
            return None if self._current is None else self._current.fence

    def status(self) -> dict[str, Any]:
        """The heartbeat's reply: the running function's id (None when idle) and its seconds."""
        with self._lock:
            current = self._current
            if current is None:
                return {"running": None, "running_for": 0.0}
            return {"running": current.closure, "running_for": self._clock() - current.started}

    def check_wanted(self, what: str) -> None:
        """Raises before ``what`` (a write to the ps tasks) if the coordinator gave up on the
        running function.

        Raises:
            ClosureAbandonedError: No ping about it for longer than its heartbeat timeout.
        """
        with self._lock:
            current = self._current
            if current is None or current.heartbeat_timeout is None:
                return
            silent = self._clock() - current.heard
            if silent <= current.heartbeat_timeout:
                return
        raise ClosureAbandonedError(
            f"Function {current.closure} stopped before {what}: the coordinator has not asked about it "
            f"for {silent:.1f}s, longer than its heartbeat timeout of {current.heartbeat_timeout:g}s, "
            "so it counts this worker as lost and runs the function on another worker. Received: a "
            "network partition or a coordinator that stopped. HINT: nothing to do; this worker serves "
            "the coordinator again once it can reach it."
        )
