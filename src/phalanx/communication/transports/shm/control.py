"""The control block of the shared-memory transport: where workers meet (`shared_memory`).

Three rows of one int64 cell per worker, in a shared segment of ``3 x W`` cells:

* row 0 (`CALLS`): the number of worker r's last call whose slot is written;
* row 1 (`SUMS`): the number of its last two-shot call whose segment sum is written;
* row 2 (`CODES`): the number and code of its current call (``number << 32 | code``), for the
  signature check (`phalanx.communication.checks.collective_check`).

Cells are read and written through a raw int64 view of the mapping (a Python ``memoryview``:
a fraction of a microsecond, where a tensor index and ``min`` cost microseconds), and written
after the data they announce; x86-64 keeps stores in order, so this transport is only used
there.

**Waiting without polling.** A worker that waits for a peer's cell sleeps on a futex on that
cell (the word holding its low 32 bits; row 2: its call number) and the peer wakes it when it
publishes: no spinning, no growing sleeps, and the waiter runs again as soon as the cell
changes. Each futex wait is bounded by `CHECK_SECONDS`, after which the waiter checks that
the late peers' processes still exist (a SIGKILLed worker is named within that time), the
group's health check, the codes the peers announced (a peer blocked in another collective)
and the deadline. Where the futex call is refused (a sandbox without it), waiting falls back
to short sleeps.
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from phalanx.communication.checks.collective_check import Signed
from phalanx.communication.group.work import PeerGoneError
from phalanx.communication.transports.gloo.signed import Mismatch

__all__ = ["CALLS", "CHECK_SECONDS", "CODES", "SUMS", "ControlBlock", "alive"]

CALLS, SUMS, CODES = 0, 1, 2
CHECK_SECONDS = 0.05
_SYS_FUTEX = 202  # x86-64's syscall number (the only architecture this transport runs on)
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1  # not FUTEX_PRIVATE: the word is shared between processes
_ALL = 0x7FFFFFFF
_REFUSED = (1, 22, 38)  # EPERM, EINVAL, ENOSYS (EAGAIN, ETIMEDOUT, EINTR are a wait's normal ends)


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Futex:
    """``futex(2)`` on a word of shared memory, through libc's ``syscall`` (ctypes releases the
    GIL while it waits)."""

    def __init__(self) -> None:
        try:
            self._syscall: Any = ctypes.CDLL(None, use_errno=True).syscall
        except (OSError, AttributeError):
            self._syscall = None
        self.works = self._syscall is not None

    def wait(self, address: int, expected: int, seconds: float) -> None:
        """Sleeps while the 32-bit word at ``address`` holds ``expected`` (at most ``seconds``)."""
        span = _Timespec(int(seconds), int((seconds % 1) * 1e9))
        word = ctypes.c_int(expected & 0xFFFFFFFF).value  # the word as the kernel compares it
        self._call(_FUTEX_WAIT, address, word, ctypes.byref(span))

    def wake(self, address: int) -> None:
        """Wakes every waiter on the word at ``address``."""
        self._call(_FUTEX_WAKE, address, _ALL, None)

    def _call(self, op: int, address: int, value: int, span: Any) -> None:
        result = self._syscall(_SYS_FUTEX, ctypes.c_void_p(address), op, value, span, None, 0)
        if result == -1 and ctypes.get_errno() in _REFUSED:  # not usable here: sleep instead
            self.works = False


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs (an exited, not yet reaped child counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in (b"Z", b"X")


class ControlBlock:
    """This worker's view of the control block (see the module doc).

    Args:
        cells: The mapped ``3 x world`` int64 cells (a tensor on the shared segment).
        rank, world: This worker and the number of workers.
        pids: Every worker's process id, by rank.
        name: ``name(rank) -> "worker:1"`` for messages.
        timeout: Seconds one wait may last.
        failure: The group's verdict on its peers (heartbeats), None while healthy.
        closing: Set when the transport closes (a waiting call fails).
        mismatch: ``mismatch(signed, peer)``: the error of a call whose code differs.
    """

    def __init__(
        self,
        cells: torch.Tensor,
        rank: int,
        world: int,
        pids: list[int],
        name: Callable[[int], str],
        timeout: float,
        failure: Callable[[], str | None],
        closing: threading.Event,
        mismatch: Mismatch,
    ) -> None:
        self.tensor = cells  # keeps the mapping alive
        self._view = cells.numpy().data  # a memoryview: int64 loads and stores, no tensor ops
        self._address = cells.data_ptr()
        self._rank, self._world, self._pids, self._name = rank, world, pids, name
        self._timeout, self._failure, self._closing, self._mismatch = timeout, failure, closing, mismatch
        self._futex = _Futex()

    def cell(self, row: int, rank: int) -> int:
        return int(self._view[row * self._world + rank])

    def publish(self, row: int, value: int) -> None:
        """Stores this worker's cell of ``row`` (after what it announces) and wakes its waiters."""
        index = row * self._world + self._rank
        self._view[index] = value
        if self._futex.works:
            self._futex.wake(self._word(row, index))

    def clear(self) -> None:
        """Zeroes this worker's cells (before the first meeting)."""
        for row in (CALLS, SUMS, CODES):
            self._view[row * self._world + self._rank] = 0

    def _word(self, row: int, index: int) -> int:
        """The futex word of cell ``index``: its low half, or its call number in row `CODES`."""
        return self._address + 8 * index + (4 if row == CODES else 0)

    # ---------------------------------------------------------------- signatures (row CODES)
    def announce(self, number: int, signed: Signed) -> None:
        """Publishes the code of this worker's call ``number`` (number and code in one cell: a
        peer reads both or neither), before anything that could wait on a peer."""
        if signed.code:
            self.publish(CODES, (number << 32) | signed.code)

    def verify(self, signed: Signed | None, target: int, every: bool) -> None:
        """Compares the peers' announced codes of call ``target`` with this worker's; ``every``:
        every peer must have announced it (else only those that did are compared)."""
        if signed is None or not signed.code:
            return
        for peer in range(self._world):
            cell = self.cell(CODES, peer)
            number, code = cell >> 32, cell & 0xFFFFFFFF
            if number == target and code != signed.code:
                raise self._mismatch(signed, peer)
            if every and number < target:  # cannot be once its call cell passed target
                raise self._mismatch(signed, None)

    def wait_announced(self, signed: Signed, target: int) -> None:
        """Waits until every peer announced call ``target`` and compares the codes: before a
        new segment is agreed on through gloo, which a peer in another collective never joins."""
        if signed.code:
            self._wait(CODES, target, signed, lambda cell: cell >> 32)
            self.verify(signed, target, every=True)

    # ---------------------------------------------------------------- waiting
    def wait_for(self, row: int, target: int, signed: Signed | None = None) -> None:
        """Waits until every peer's cell of ``row`` reached ``target``; with ``signed``, compares
        the codes of the call (those announced, every `CHECK_SECONDS`; then all, before any sum).

        Raises:
            CollectiveMismatchError: (from ``mismatch``) a peer announced another collective.
            PeerGoneError: A late peer exited or failed its heartbeats, or the deadline passed.
        """
        self._wait(row, target, signed, lambda cell: cell)
        self.verify(signed, target, every=True)

    def _late(self, row: int, target: int, number: Callable[[int], int]) -> int:
        """The first peer whose cell of ``row`` is below ``target`` (-1: none)."""
        base = row * self._world
        for peer in range(self._world):
            if number(int(self._view[base + peer])) < target:
                return peer
        return -1

    def _wait(self, row: int, target: int, signed: Signed | None, number: Callable[[int], int]) -> None:
        start = time.monotonic()
        deadline, next_check = start + self._timeout, start + CHECK_SECONDS
        pause = 0.0
        while (peer := self._late(row, target, number)) >= 0:
            index = row * self._world + peer
            seen = int(self._view[index])
            now = time.monotonic()
            if now >= next_check:
                next_check = now + CHECK_SECONDS
                self.verify(signed, target, every=False)  # a peer blocked in another collective
                self._check_peers(row, target, number, now, deadline)
            if self._futex.works:
                word = seen >> 32 if row == CODES else seen
                self._futex.wait(self._word(row, index), word, max(next_check - now, 0.0001))
            else:
                time.sleep(pause)  # 0 first: just give the core away
                pause = min(0.0005, pause * 2 or 0.00002)

    def _check_peers(
        self, row: int, target: int, number: Callable[[int], int], now: float, deadline: float
    ) -> None:
        late = [r for r in range(self._world) if number(self.cell(row, r)) < target]
        gone = [r for r in late if not alive(self._pids[r])]
        if gone:
            raise PeerGoneError(f"{self._name(gone[0])} (pid {self._pids[gone[0]]}) exited")
        failure = self._failure()
        if failure is not None:
            raise PeerGoneError(failure)
        if self._closing.is_set():
            raise RuntimeError("the shared-memory transport was closed while waiting")
        if now >= deadline:
            names = [self._name(r) for r in late]
            raise PeerGoneError(f"no answer from {names} within {self._timeout:g}s")
