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

__all__ = ["KEEP_WORKS_COUNT", "KEEP_WORKS_SECONDS", "SUBGROUP_KEEP_WORKS_COUNT", "RecentWorks"]

KEEP_WORKS_SECONDS = 2.0
# A completed work is let go sooner once this many newer works were started: a gloo thread
# holds at most the work it runs, and lets it go microseconds after it completes. Holding every
# work for the full `KEEP_WORKS_SECONDS` kept ~2 s of a training loop's gradients alive (about
# 0.5 GB for a 7.4 MB model over gloo) and made malloc return and fault in their pages again
# every step (docs/performance.md, multi-worker).
KEEP_WORKS_COUNT = 16
# A group made with ``torch.distributed.new_group()`` keeps works of its own, fewer: its gloo
# (torch's ``ProcessGroupGloo``, 2 threads) runs at most 2 works at a time, and its works carry
# whole tensors (FSDP2's gathered layers over a mesh's batch axis, ModelParallelStrategy's
# subgroups): the job's 16 kept up to 16 gathered layers alive after FSDP2 had let them go.
# Its 2 newest cover the works those threads may still hold.
SUBGROUP_KEEP_WORKS_COUNT = 2


class RecentWorks:
    """Keeps every torch.distributed work alive until it completed and either ``keep_seconds``
    passed since it was started or ``keep_count`` newer works were started (see the module
    docstring). Thread-safe.

    Args:
        keep_seconds: How long a completed work is held at most, unless `keep_count` newer
            works let it go first.
        keep_count: How many of the newest works are held whether they completed or not.
        clock: Monotonic clock (a fake one in tests).
    """

    def __init__(
        self,
        keep_seconds: float = KEEP_WORKS_SECONDS,
        clock: Callable[[], float] = time.monotonic,
        keep_count: int = KEEP_WORKS_COUNT,
    ) -> None:
        self._keep, self._clock, self._count = keep_seconds, clock, keep_count
        self._works: deque[tuple[float, Any]] = deque()
        self._lock = threading.Lock()

    def add(self, work: Any) -> Any:
        """Holds ``work`` (and lets go of the oldest works that completed and are older than
        ``keep_seconds`` or than the ``keep_count`` newest); returns ``work``."""
        now = self._clock()
        with self._lock:
            works = self._works
            while (
                works
                and (now - works[0][0] > self._keep or len(works) >= self._count)
                and works[0][1].is_completed()
            ):
                works.popleft()
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
