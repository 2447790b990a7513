"""The handle of a collective that phalanx's own transports run on a thread of their own
(shared memory, the TLS ring), waited on as `WorkerGroup` waits on a gloo work."""

from __future__ import annotations

import threading
from datetime import timedelta

__all__ = ["PeerGoneError", "QueuedWork"]


class PeerGoneError(RuntimeError):
    """A peer failed during one of phalanx's own collectives; ``failure`` says who and how."""

    def __init__(self, failure: str) -> None:
        super().__init__(failure)
        self.failure = failure


class QueuedWork:
    """One queued collective: finished (or failed) by the transport's thread.

    Args:
        what: The collective, for the "still running" error of a timed wait.
    """

    def __init__(self, what: str = "collective") -> None:
        self._what = what
        self._done = threading.Event()
        self._error: BaseException | None = None

    def is_completed(self) -> bool:
        """Whether the collective finished, with or without an error."""
        return self._done.is_set()

    def done_within(self, seconds: float) -> bool:
        """Whether the collective finished within ``seconds`` (raises nothing)."""
        return self._done.wait(seconds)

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Waits; raises RuntimeError("... timed out") while running, or the collective's error."""
        seconds = None if timeout is None else timeout.total_seconds()
        if not self._done.wait(seconds):
            raise RuntimeError(f"{self._what} timed out (still running)")
        if self._error is not None:
            raise self._error
        return True

    def finish(self, error: BaseException | None = None) -> None:
        """Marks the collective finished (``error``: it failed)."""
        self._error = error
        self._done.set()
