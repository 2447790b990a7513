"""The works of `phalanx.communication.transports.gloo.transport`: a signed first message in flight, a gloo
call queued behind one, and the work a signed collective hands back (waited on as a gloo work)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch

from phalanx.communication.checks.collective_check import Signed
from phalanx.communication.transports.gloo.signed import Mismatch, verify_header

__all__ = ["Call", "Header", "SignedWork", "wait_gloo"]

Release = Callable[["Header | None"], None]  # issues what waited for a verified first message


def _span(timeout: float | None) -> timedelta | None:
    return None if timeout is None else timedelta(seconds=max(timeout, 0.001))


def _left(deadline: float | None) -> float | None:
    return None if deadline is None else deadline - time.monotonic()


def wait_gloo(work: Any, timeout: float | None) -> None:
    """Waits for a gloo work: raises RuntimeError while still running after ``timeout``, or its
    error. Never waits inside the work's own completion callback: gloo completes a work's
    future (running its callbacks) before the work itself, so there the future is asked."""
    if work.is_completed():  # not inside its callback (the work completes after its future)
        work.wait()  # at once: raises gloo's error, if it failed
        return
    future = work.get_future()
    if not future.done():
        if timeout is None or work.is_completed():
            work.wait()
        else:
            work.wait(_span(timeout))
    future.value()  # gloo's error, if it failed


def _finished(work: Any) -> bool:
    return bool(work.is_completed() or work.get_future().done())


class Header:
    """A signed first message in flight, verified once by whoever needs it first."""

    def __init__(self, message: torch.Tensor, signed: Signed, world: int, mismatch: Mismatch) -> None:
        self.message, self.signed, self._world, self._mismatch = message, signed, world, mismatch
        self.work: Any = None
        self.verified = False
        self.error: BaseException | None = None
        self._lock = threading.Lock()

    def completed(self) -> bool:
        return self.verified or self.error is not None or _finished(self.work)

    def verify(self, timeout: float | None = None) -> None:
        """Waits for the message, then compares every worker's code with ours.

        Raises:
            RuntimeError: Still running after ``timeout``, or gloo's own error.
            CollectiveMismatchError: (from ``mismatch``) another worker's collective differs.
        """
        if not self.verified and self.error is None:
            wait_gloo(self.work, timeout)
        with self._lock:
            if not self.verified and self.error is None:
                try:
                    verify_header(self.message, self._world, self.signed, self._mismatch)
                except BaseException as exc:  # sticky: every waiter sees the same report
                    self.error = exc
                else:
                    self.verified = True
        if self.error is not None:
            raise self.error


class Call:
    """A gloo call that may wait, queued, for the first message before it to verify."""

    __slots__ = ("start", "work")

    def __init__(self, start: Callable[[], Any]) -> None:
        self.start = start
        self.work: Any = None


class SignedWork:
    """One signed collective: its first message (verified before anything of it is used), the
    gloo call queued behind it, and what finishes it (copies, checks).

    Waited on as a gloo work (`WorkerGroup.wait`): ``wait(timeout)`` raises RuntimeError
    while it still runs. Callbacks (`add_done_callback`, for the phalanx process group) run
    on the thread that finishes it.

    Args:
        release: The transport's ``release(header)``: issues what was queued behind it.
        header: The first message verified before anything of it is used (its own, or the
            announcement of the gradient all-reduces).
        call: The gloo call queued behind ``header`` (None: the first message is all of it).
        finish: Run once the gloo calls finished and the codes matched (copies, checks).
    """

    def __init__(
        self,
        release: Release,
        header: Header | None,
        call: Call | None = None,
        finish: Callable[[], None] | None = None,
    ) -> None:
        self._release, self._header, self._call, self._finish = release, header, call, finish
        self._lock = threading.Lock()
        self._done = False
        self._error: BaseException | None = None
        self._callbacks: list[Callable[[BaseException | None], None]] = []

    def is_completed(self) -> bool:
        """Whether it finished, or every gloo call of it did (its error then comes from `wait`)."""
        if self._done:
            return True
        header = self._header
        if header is not None and not header.verified:
            if not header.completed():
                return False
            try:
                header.verify()  # no wait: it completed
            except BaseException:  # noqa: BLE001 (it failed: `wait` raises why)
                return True
        call = self._call
        return call is None or (call.work is not None and _finished(call.work))

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Waits (raises RuntimeError "... timed out" while running), verifies, finishes.

        Raises:
            CollectiveMismatchError: Another worker's collective differs.
            RuntimeError: gloo's error (a peer left).
        """
        if not self._done:
            deadline = None if timeout is None else time.monotonic() + timeout.total_seconds()
            if self._header is not None:
                self._header.verify(_left(deadline))
            if self._call is not None:
                self._release(self._header)
                if self._call.work is None:
                    raise RuntimeError("the collective was dropped: its transport was closed")
                wait_gloo(self._call.work, _left(deadline))
            self._complete(None)
        if self._error is not None:
            raise self._error
        return True

    def _complete(self, error: BaseException | None) -> None:
        with self._lock:
            if self._done:
                return
            if error is None and self._finish is not None:
                try:
                    self._finish()
                except BaseException as exc:  # a failed check fails the collective
                    error = exc
            self._error, self._done = error, True
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback(error)

    # ---------------------------------------------------------------- callbacks (process group)
    def add_done_callback(self, callback: Callable[[BaseException | None], None]) -> None:
        """Calls ``callback(error or None)`` once finished (at once if it is): progress is then
        driven by gloo's completion callbacks, not only by a waiter."""
        with self._lock:
            if not self._done:
                self._callbacks.append(callback)
                first = len(self._callbacks) == 1
            else:
                first = None
        if first is None:
            callback(self._error)
        elif first:
            self._advance()

    def _advance(self) -> None:
        """One step without blocking; chains itself on the gloo work it needs next."""
        try:
            pending = self._next_pending()
        except BaseException as exc:  # the collective's error, for every callback
            self._complete(exc)
            return
        if pending is None:
            self._complete(None)
        else:
            pending.add_done_callback(lambda _: self._advance())

    def _next_pending(self) -> Any:
        """The future of the gloo work this collective waits for next (None: none left)."""
        header = self._header
        if header is not None and not header.completed():
            return header.work.get_future()
        if header is not None:
            header.verify()
        if self._call is None:
            return None
        self._release(header)
        if self._call.work is None:
            raise RuntimeError("the collective was dropped: its transport was closed")
        future = self._call.work.get_future()
        if not future.done():
            return future
        future.value()  # gloo's error, if it failed
        return None
