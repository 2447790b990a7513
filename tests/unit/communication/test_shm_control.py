"""The shared-memory transport's control block: meetings, futex waits, and how a wait fails
(two "workers" as two views of one tensor in this process; the multi-process tests use
/dev/shm: tests/multiprocess/test_shared_memory.py)."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import threading
import time

import pytest
import torch

from phalanx.communication.checks.collective_check import Signed
from phalanx.communication.group.work import PeerGoneError
from phalanx.communication.transports.shm.control import CALLS, CODES, SUMS, ControlBlock


class _Mismatch(Exception):
    pass


def _blocks(pids=None, timeout=5.0, failure=lambda: None):
    cells = torch.zeros(6, dtype=torch.int64)
    closing = threading.Event()
    pids = pids or [os.getpid(), os.getpid()]

    def block(rank):
        return ControlBlock(
            cells,
            rank,
            2,
            pids,
            lambda r: f"worker:{r}",
            timeout,
            failure,
            closing,
            lambda signed, peer: _Mismatch(f"#{signed.seq} differs from worker {peer}"),
        )

    return block(0), block(1), closing


def _later(seconds, fn):
    thread = threading.Thread(target=lambda: (time.sleep(seconds), fn()), daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("futex", [True, False])
def test_a_wait_returns_once_the_peer_publishes(futex):
    me, peer, _ = _blocks()
    me._futex.works = futex  # False: the sleeping fallback where futex(2) is refused
    me.publish(CALLS, 1)
    thread = _later(0.2, lambda: peer.publish(CALLS, 1))
    start = time.monotonic()
    me.wait_for(CALLS, 1)
    assert 0.1 < time.monotonic() - start < 2.0
    assert (me.cell(CALLS, 0), me.cell(CALLS, 1)) == (1, 1)
    thread.join()
    peer.publish(SUMS, 1)  # the rows are apart
    assert me.cell(CALLS, 1) == 1
    assert me.cell(SUMS, 1) == 1


def test_the_codes_are_compared_before_the_wait_returns():
    me, peer, _ = _blocks()
    me.announce(1, Signed(1, 11))
    peer.announce(1, Signed(1, 12))
    peer.publish(CALLS, 1)
    me.publish(CALLS, 1)
    with pytest.raises(_Mismatch, match="#1 differs from worker 1"):
        me.wait_for(CALLS, 1, Signed(1, 11))
    # a peer that published the call without announcing it: it made another collective
    me2, peer2, _ = _blocks()
    me2.announce(1, Signed(1, 11))
    me2.publish(CALLS, 1)
    peer2.publish(CALLS, 1)
    with pytest.raises(_Mismatch, match="worker None"):
        me2.wait_for(CALLS, 1, Signed(1, 11))


def test_a_peer_blocked_in_another_collective_is_seen_while_waiting():
    me, peer, _ = _blocks()
    peer.announce(1, Signed(1, 99))  # announced, never publishes its slot
    start = time.monotonic()
    with pytest.raises(_Mismatch, match="worker 1"):
        me.wait_for(CALLS, 1, Signed(1, 5))
    assert time.monotonic() - start < 2.0


def test_waiting_for_announcements_compares_them():
    me, peer, _ = _blocks()
    _later(0.1, lambda: peer.announce(1, Signed(1, 7)))
    me.announce(1, Signed(1, 7))
    me.wait_announced(Signed(1, 7), 1)  # woken on the number half of the cell
    peer.announce(2, Signed(2, 8))
    me.announce(2, Signed(2, 9))
    with pytest.raises(_Mismatch):
        me.wait_announced(Signed(2, 9), 2)


def test_a_peer_process_that_exited_is_named():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    me, _, _ = _blocks(pids=[os.getpid(), child.pid])
    with pytest.raises(PeerGoneError, match=f"worker:1 \\(pid {child.pid}\\) exited"):
        me.wait_for(CALLS, 1)


def test_a_wait_ends_at_the_deadline_the_groups_failure_or_close():
    me, _, closing = _blocks(timeout=0.2)
    me.publish(CALLS, 1)
    with pytest.raises(PeerGoneError, match=r"no answer from \['worker:1'\] within 0.2s"):
        me.wait_for(CALLS, 1)
    failed, _, _ = _blocks(failure=lambda: "worker:1 stopped its heartbeats")
    with pytest.raises(PeerGoneError, match="stopped its heartbeats"):
        failed.wait_for(CALLS, 1)
    me, _, closing = _blocks()
    _later(0.1, closing.set)
    with pytest.raises(RuntimeError, match="closed while waiting"):
        me.wait_for(SUMS, 1)


def test_clear_zeroes_only_this_workers_cells():
    me, peer, _ = _blocks()
    for block in (me, peer):
        for row in (CALLS, SUMS, CODES):
            block.publish(row, 3)
    me.clear()
    assert [me.cell(row, 0) for row in (CALLS, SUMS, CODES)] == [0, 0, 0]
    assert [me.cell(row, 1) for row in (CALLS, SUMS, CODES)] == [3, 3, 3]


def test_a_refused_futex_falls_back_to_sleeping():
    me, peer, _ = _blocks()

    def refused(*args):
        ctypes.set_errno(38)  # ENOSYS: a sandbox without futex(2)
        return -1

    me._futex._syscall = refused
    me.publish(CALLS, 1)
    assert not me._futex.works  # the wake was refused too: no more futex calls
    thread = _later(0.1, lambda: peer.publish(CALLS, 1))
    me.wait_for(CALLS, 1)
    thread.join()
    assert me.cell(CALLS, 1) == 1
