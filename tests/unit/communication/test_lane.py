"""Lane: one thread that runs queued calls in order; a call's references end with the call."""

from __future__ import annotations

import gc
import time
import weakref
from datetime import timedelta

import pytest
import torch

from phalanx.communication.group.work import Lane


def test_a_call_and_its_tensors_are_let_go_once_it_ran():
    """The last call (an all-gather's closure over a whole gathered layer) must not stay
    alive in the thread until the next call is queued: FSDP2 queues that after a layer."""
    lane = Lane("test-lane")
    try:
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
    finally:
        lane.close()


def test_a_failed_call_fails_every_later_one():
    lane = Lane("test-lane")
    try:

        def fail() -> None:
            raise ValueError("broken")

        first, second = lane.submit("fail", fail), lane.submit("after", lambda: None)
        for work in (first, second):
            with pytest.raises(ValueError, match="broken"):
                work.wait(timedelta(seconds=10))
    finally:
        lane.close()
