"""Leaving a MultiWorkerMirrored job together: every worker announces it reached `close` and
waits (bounded) until every healthy worker did, before anyone tears its connections down.

gloo finishes a collective on one worker before the last bytes reached the others, and the
TLS ring's last sends may still be in flight: a worker that destroyed its group (or exited) at
once could break a peer's last collective and abort that process. Nobody leaves while a
healthy peer may still be in one. The announcing and waiting run on a thread of their own: a
store call across a partition blocks (it does not fail), and closing must not.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["LEAVE_TIMEOUT", "leave_together"]

LEAVE_TIMEOUT = 10.0


def leave_together(
    store: Any,
    rank: int,
    world_size: int,
    failure: Callable[[], str | None],
    bound: float,
    someone_waits: Callable[[], bool],
    extra: float,
) -> None:
    """Announces that worker ``rank`` leaves and returns once every worker did, a failure is
    known (``failure()``), or the bound passed (all workers, at the end of the job).

    Args:
        store: The job's rendezvous store (``left/<rank>`` keys).
        rank, world_size: This worker and the number of workers.
        failure: The group's health: a reason once a peer is known dead (stop waiting).
        bound: The longest wait: `LEAVE_TIMEOUT`, longer while the stall inspector may still
            have to name a mismatch on every worker.
        someone_waits: Whether a peer waits in a collective (past `LEAVE_TIMEOUT`, the wait
            goes on only while one does).
        extra: Seconds the caller gives the thread beyond ``bound`` (a blocked store call).
    """

    def announce_and_wait() -> None:
        with contextlib.suppress(Exception):  # the chief's store may be gone already
            store.set(f"left/{rank}", "1")
            keys = [f"left/{r}" for r in range(world_size)]
            start = time.monotonic()
            while failure() is None and time.monotonic() - start < bound:
                if time.monotonic() - start > LEAVE_TIMEOUT and not someone_waits():
                    return
                if store.check(keys):
                    return
                time.sleep(0.01)

    leaving = threading.Thread(target=announce_and_wait, name="phalanx-leave", daemon=True)
    leaving.start()
    leaving.join(bound + extra)
