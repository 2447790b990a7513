"""What this process counts for the status page: seconds waited in collectives, steps, closures.

The code that waits or steps adds to these counters (one call, under a lock); the worker's
`phalanx.status.reports.Reporter` reads them on its own thread and turns the differences
between two readings into rates. Nothing here talks to anyone.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

__all__ = ["COUNTERS", "ClosureCounts", "Counters", "Reading"]


@dataclass
class ClosureCounts:
    """What the parameter-server coordinator (chief only) did with one worker's closures.

    Args:
        done: Closures that finished on this worker.
        lost: Closures running on this worker when it was lost.
        rescheduled: Closures put back in the queue to run on another worker after a loss.
    """

    done: int = 0
    lost: int = 0
    rescheduled: int = 0


@dataclass(frozen=True)
class Reading:
    """The totals at one moment (`Counters.reading`)."""

    collective_wait_seconds: float
    steps: int
    requests: int
    total_steps: int | None
    last_error: str | None
    closures: dict[str, ClosureCounts]


@dataclass
class Counters:
    """This process's running totals (see the module doc). All methods are thread-safe."""

    collective_wait_seconds: float = 0.0
    steps: int = 0
    requests: int = 0
    total_steps: int | None = None
    last_error: str | None = None
    closures: dict[str, ClosureCounts] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def waited(self, seconds: float) -> None:
        """Adds the time one collective's wait took (the worker group, after each wait)."""
        with self._lock:
            self.collective_wait_seconds += seconds

    def stepped(self) -> None:
        """Counts one finished training step (`MultiWorkerMirroredStrategy.run`)."""
        with self._lock:
            self.steps += 1

    def served(self) -> None:
        """Counts one request served (a parameter-server or worker task's `phalanx.Server`)."""
        with self._lock:
            self.requests += 1

    def expect_steps(self, total: int | None) -> None:
        """Sets how many steps the job runs in all (for the page's ETA; None: unknown)."""
        if total is not None and total < 1:
            raise ValueError(f"The total number of steps must be >= 1 or None. Received: {total!r}.")
        with self._lock:
            self.total_steps = total

    def failed(self, error: BaseException | str) -> None:
        """Keeps the last error this process met (shown on the page, never a secret)."""
        text = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
        with self._lock:
            self.last_error = text[:2000]

    def closure(self, worker: str, *, done: int = 0, lost: int = 0, rescheduled: int = 0) -> None:
        """Counts closures of ``worker`` (the coordinator's worker threads, chief only)."""
        with self._lock:
            counts = self.closures.setdefault(worker, ClosureCounts())
            counts.done += done
            counts.lost += lost
            counts.rescheduled += rescheduled

    def reading(self) -> Reading:
        """A consistent copy of the totals."""
        with self._lock:
            closures = {k: ClosureCounts(v.done, v.lost, v.rescheduled) for k, v in self.closures.items()}
            return Reading(
                self.collective_wait_seconds,
                self.steps,
                self.requests,
                self.total_steps,
                self.last_error,
                closures,
            )


COUNTERS = Counters()
