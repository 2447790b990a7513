"""Torch.distributed works held from Python until their process group's threads are gone.

Why (the abort it prevents): a gloo worker thread drops its reference to a work a moment after
the work completes. If that reference is the last one, the thread frees the work's tensors,
which takes the GIL; once the interpreter is finalizing, Python ends any thread that asks for
the GIL, here from inside a C++ destructor, and the process aborts ("terminate called without
an active exception"). `WorkerGroup` keeps each work here for a while, and its ``close``
tears the process groups down (joining those threads) before it lets the last works go.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

__all__ = ["KEEP_WORKS_SECONDS", "RecentWorks"]

KEEP_WORKS_SECONDS = 2.0


class RecentWorks:
    """Keeps every torch.distributed work alive for ``keep_seconds`` after it was started
    (see the module docstring). Thread-safe.

    Args:
        keep_seconds: How long a work is held at least (longer while it has not completed).
        clock: Monotonic clock (a fake one in tests).
    """

    def __init__(self, keep_seconds: float = KEEP_WORKS_SECONDS, clock: Callable[[], float] = time.monotonic):
        self._keep, self._clock = keep_seconds, clock
        self._works: deque[tuple[float, Any]] = deque()
        self._lock = threading.Lock()

    def add(self, work: Any) -> Any:
        """Holds ``work`` (and lets go of the works older than ``keep_seconds`` that completed);
        returns ``work``."""
        now = self._clock()
        with self._lock:
            while self._works and now - self._works[0][0] > self._keep and self._works[0][1].is_completed():
                self._works.popleft()
            self._works.append((now, work))
        return work

    def pending(self) -> list[Any]:
        """The works held that have not completed yet, oldest first."""
        with self._lock:
            return [work for _, work in self._works if not work.is_completed()]

    def __len__(self) -> int:
        return len(self._works)

    def clear(self) -> None:
        """Lets every work go (once no process-group thread can hold one any more)."""
        with self._lock:
            self._works.clear()
