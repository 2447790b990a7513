"""The handle of a collective that phalanx's own transports run on a thread of their own
(shared memory, the TLS ring), waited on as `WorkerGroup` waits on a gloo work."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from datetime import timedelta

__all__ = ["Lane", "PeerGoneError", "QueuedWork"]


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
        self._callbacks: list[Callable[[BaseException | None], None]] = []
        self._lock = threading.Lock()

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

    def add_done_callback(self, callback: Callable[[BaseException | None], None]) -> None:
        """Calls ``callback(error or None)`` when the collective finishes (at once if it did),
        on the thread that finishes it."""
        with self._lock:
            if not self._done.is_set():
                self._callbacks.append(callback)
                return
        callback(self._error)

    def finish(self, error: BaseException | None = None) -> None:
        """Marks the collective finished (``error``: it failed) and runs the callbacks."""
        with self._lock:
            self._error = error
            self._done.set()
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback(error)


class Lane:
    """One thread that runs queued calls in the order they were queued, each finishing its
    `QueuedWork` (how a transport keeps every worker's collectives in the same order). After
    a call fails, every later one fails with the same error (sticky).

    A call submitted with ``here=True`` while nothing is queued or running runs on the
    submitting thread instead, in its turn all the same: calls queued meanwhile wait for it.

    Args:
        name: The thread's name.
    """

    def __init__(self, name: str) -> None:
        self._queue: queue.SimpleQueue[tuple[Callable[[], None], QueuedWork] | None] = queue.SimpleQueue()
        self._broken: BaseException | None = None
        self._closed = False
        self._count_lock = threading.Lock()
        self._unfinished = 0  # calls queued or running
        self._running = threading.Lock()  # held while a call runs, on whichever thread
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def submit(self, what: str, run: Callable[[], None], here: bool = False) -> QueuedWork:
        """Queues ``run`` and returns its work (finished when ``run`` returned or raised).

        ``here``: run it on this thread if the lane is idle (the call then returns once ``run``
        did): for a caller that may block until every worker met.
        """
        work = QueuedWork(what)
        if self._closed:
            work.finish(RuntimeError(f"{what} was issued after its transport was closed"))
            return work
        with self._count_lock:
            idle = self._unfinished == 0
            self._unfinished += 1
        if here and idle:
            with self._running:
                self._serve_one(run, work)
            self._finished_one()
        else:
            self._queue.put((run, work))
        return work

    def _finished_one(self) -> None:
        with self._count_lock:
            self._unfinished -= 1

    def _serve(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            with self._running:  # after a call running on its submitter's thread
                self._serve_one(*item)
            self._finished_one()
            # nothing of the call outlives it here: ``item`` held the call, and the call its
            # tensors (an all-gather's whole gathered layer, through views of it) until the
            # next call was queued, which FSDP2 makes only after a layer's compute
            del item

    def _serve_one(self, run: Callable[[], None], work: QueuedWork) -> None:
        """Runs one call and finishes its work (each call's references end with this frame)."""
        if self._broken is not None:
            work.finish(self._broken)
            return
        try:
            run()
        except BaseException as exc:  # every later call fails the same way
            self._broken = exc
            work.finish(exc)
        else:
            work.finish()

    @property
    def alive(self) -> bool:
        """Whether the thread still runs."""
        return self._thread.is_alive()

    def close(self, timeout: float = 5.0) -> None:
        """Stops the thread after the calls queued so far (waits at most ``timeout``)."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)
