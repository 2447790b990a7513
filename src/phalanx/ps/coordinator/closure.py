"""Scheduled functions and the queue the coordinator's worker threads take them from.

The queue follows tf.distribute's coordinator: the first function that fails stores its
error and cancels everything still queued; the error is raised once, by the next
`schedule`, `join` or `done`, and then forgotten so the coordinator can be used again. A
function whose worker was lost is put back at the front and runs on another worker.
"""

from __future__ import annotations

import collections
import itertools
import threading
import time
from collections.abc import Callable
from typing import Any

from phalanx.ps.coordinator.deadlines import Waiter
from phalanx.ps.coordinator.remote_value import RemoteValue

_ids = itertools.count(1)

__all__ = ["Closure", "ClosureAbortedError", "ClosureQueue"]


class ClosureAbortedError(RuntimeError):
    """A scheduled function did not run because an earlier one failed (fetch raises this)."""


class Closure:
    """A function and its arguments, scheduled once, possibly run more than once (retries).

    Args:
        fn, args, kwargs: What to run.
        waiter: The coordinator's bound on waits for `output` without a timeout (None: the
            value's own, as for a closure made outside a coordinator).
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        waiter: Waiter | None = None,
    ) -> None:
        self.fn, self.args, self.kwargs = fn, args, kwargs
        self.id = next(_ids)  # named in the worker's heartbeats
        self.output = RemoteValue(self.describe(), waiter)
        self.attempts = 0

    def describe(self) -> str:
        """The function, for messages (``"function 'step' (#3)"``)."""
        return f"function {getattr(self.fn, '__qualname__', type(self.fn).__name__)!r} (#{self.id})"

    def __repr__(self) -> str:
        return f"Closure({getattr(self.fn, '__qualname__', self.fn)!r}, attempts={self.attempts})"


class ClosureQueue:
    """Thread-safe FIFO of closures with TF's error and cancellation rules.

    Args:
        max_size: `put` blocks while this many closures wait (TF's bound on the queue).
    """

    def __init__(self, max_size: int = 256 * 1024) -> None:
        self._max = max_size
        self._queue: collections.deque[Closure] = collections.deque()
        self._in_flight = 0
        self._error: BaseException | None = None
        self._stopped = False
        self._cond = threading.Condition()
        self.last_progress = time.monotonic()  # a closure was queued or finished (monotonic)

    # ------------------------------------------------------------------ coordinator side
    def put(self, closure: Closure) -> None:
        """Queues ``closure`` (blocks while the queue is full).

        Raises:
            The error of an earlier function that failed since the last raise (and forgets it).
        """
        with self._cond:
            self._raise_if_error()
            self._cond.wait_for(lambda: len(self._queue) < self._max or self._error is not None)
            self._raise_if_error()
            self._queue.append(closure)
            self.last_progress = time.monotonic()
            self._cond.notify_all()

    def wait(self, timeout: float | None = None) -> bool:
        """Blocks until every queued and running closure finished; False after ``timeout``.

        Raises:
            The first error of a function that failed (once; then forgotten).
        """
        with self._cond:
            finished = self._cond.wait_for(
                lambda: self._error is not None or (not self._queue and not self._in_flight), timeout
            )
            self._raise_if_error()
            return finished

    def done(self) -> bool:
        """Whether nothing is queued or running (does not block).

        Raises:
            The first error of a function that failed (once; then forgotten).
        """
        with self._cond:
            self._raise_if_error()
            return not self._queue and not self._in_flight

    def _raise_if_error(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    @property
    def pending(self) -> int:
        """Closures queued or running."""
        with self._cond:
            return len(self._queue) + self._in_flight

    # ------------------------------------------------------------------ worker-thread side
    def get(self, timeout: float | None = None) -> Closure | None:
        """The next closure for a worker thread; None once stopped or after ``timeout``."""
        with self._cond:
            self._cond.wait_for(lambda: self._queue or self._stopped, timeout)
            if self._stopped or not self._queue:
                return None
            closure = self._queue.popleft()
            self._in_flight += 1
            closure.attempts += 1
            self._cond.notify_all()
            return closure

    def mark_finished(self, closure: Closure, value: Any) -> None:
        """``closure`` returned ``value``."""
        with self._cond:
            closure.output.set_result(value)
            self._in_flight -= 1
            self.last_progress = time.monotonic()
            self._cond.notify_all()

    def mark_failed(self, closure: Closure, error: BaseException) -> None:
        """``closure`` raised ``error``: store it (the first one wins) and cancel all queued."""
        with self._cond:
            closure.output.set_exception(error)
            self._in_flight -= 1
            self.last_progress = time.monotonic()
            if self._error is None:
                self._error = error
            self._cancel_queued(error)
            self._cond.notify_all()

    def put_back(self, closure: Closure) -> None:
        """``closure``'s worker was lost: run it again, first, on another worker."""
        with self._cond:
            self._in_flight -= 1
            if self._error is not None:  # everything queued was cancelled meanwhile
                closure.output.set_exception(ClosureAbortedError(_aborted_message(self._error)))
            else:
                self._queue.appendleft(closure)
            self._cond.notify_all()

    def fail_all(self, error: BaseException) -> None:
        """No worker can run anything any more: every queued closure fails with ``error``
        (nothing happens when nothing is queued)."""
        with self._cond:
            if not self._queue:
                return
            if self._error is None:
                self._error = error
            self._cancel_queued(error)
            self._cond.notify_all()

    def _cancel_queued(self, error: BaseException) -> None:
        while self._queue:
            self._queue.popleft().output.set_exception(ClosureAbortedError(_aborted_message(error)))

    def stop(self) -> None:
        """Wakes every worker thread with None (the coordinator shuts down)."""
        with self._cond:
            self._stopped = True
            self._cond.notify_all()


def _aborted_message(error: BaseException) -> str:
    return (
        f"This function was cancelled because an earlier scheduled function failed with "
        f"{type(error).__name__}: {error}"
    )
