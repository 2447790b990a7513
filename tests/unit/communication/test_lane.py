"""Lane: one thread that runs queued calls in order; a call's references end with the call."""

from __future__ import annotations

import gc
import threading
import time
import weakref
from datetime import timedelta

import pytest
import torch

from phalanx.communication.group.work import Lane


@pytest.fixture
def lane():
    lane = Lane("test-lane")
    yield lane
    lane.close()


def test_a_call_and_its_tensors_are_let_go_once_it_ran(lane):
    """The last call (an all-gather's closure over a whole gathered layer) must not stay
    alive in the thread until the next call is queued: FSDP2 queues that after a layer."""
    tensor = torch.ones(4)
    seen = weakref.ref(tensor)
    work = lane.submit("fill", lambda t=tensor: t.fill_(2.0))
    assert work.wait(timedelta(seconds=10))
    assert float(tensor.sum()) == 8.0
    del tensor
    deadline = time.monotonic() + 5.0  # the thread lets go right after finishing the work
    while seen() is not None and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.01)
    assert seen() is None, "the lane's thread still holds its last call's tensor after 5 s"


def test_a_failed_call_fails_every_later_one(lane):

    def fail() -> None:
        raise ValueError("broken")

    first, second = lane.submit("fail", fail), lane.submit("after", lambda: None)
    for work in (first, second):
        with pytest.raises(ValueError, match="broken"):
            work.wait(timedelta(seconds=10))


def test_a_call_that_may_run_here_runs_on_the_caller_when_the_lane_is_idle(lane):
    ran_on: list[str] = []
    work = lane.submit("here", lambda: ran_on.append(threading.current_thread().name), here=True)
    assert work.is_completed()  # finished before submit returned
    assert ran_on == [threading.current_thread().name]
    lane.submit("queued", lambda: ran_on.append(threading.current_thread().name)).wait(timedelta(seconds=10))
    assert ran_on[1] == "test-lane"  # without ``here``: the lane's thread, as always


def test_a_call_that_may_run_here_waits_its_turn_behind_a_busy_lane(lane):
    release, order = threading.Event(), []
    first = lane.submit("slow", lambda: (release.wait(10), order.append("slow")))
    second = lane.submit("here", lambda: order.append(threading.current_thread().name), here=True)
    assert not second.is_completed()  # queued behind the running call, not run here
    release.set()
    second.wait(timedelta(seconds=10))
    assert first.is_completed()
    assert order == ["slow", "test-lane"]


def test_a_call_queued_while_one_runs_on_its_caller_runs_after_it(lane):
    order: list[str] = []
    queued: list = []

    def here() -> None:  # another thread queues a call while this one runs on the caller
        other = threading.Thread(
            target=lambda: queued.append(lane.submit("queued", lambda: order.append("queued")))
        )
        other.start()
        other.join(10)
        time.sleep(0.05)  # the lane's thread has the queued call now: it must wait for this one
        order.append("here")

    lane.submit("here", here, here=True)
    queued[0].wait(timedelta(seconds=10))
    assert order == ["here", "queued"]


def test_a_failure_on_the_caller_fails_every_later_call(lane):
    def fail() -> None:
        raise ValueError("broken here")

    first = lane.submit("fail", fail, here=True)
    second = lane.submit("after", lambda: None, here=True)
    for work in (first, second):
        with pytest.raises(ValueError, match="broken here"):
            work.wait(timedelta(seconds=10))
