"""The coordinator's closure queue and RemoteValue, one rule at a time (no processes)."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from phalanx.ps.coordinator.closure import Closure, ClosureAbortedError, ClosureQueue
from phalanx.ps.coordinator.deadlines import Waiter
from phalanx.ps.coordinator.remote_value import RemoteValue, RemoteValueStatus


def _closure(name="f"):
    return Closure(lambda: name, (), {})


def test_a_closure_runs_and_its_value_is_fetched_as_numpy():
    queue = ClosureQueue()
    closure = _closure()
    queue.put(closure)
    assert not queue.done()
    taken = queue.get(timeout=1)
    assert taken is closure
    assert closure.attempts == 1
    queue.mark_finished(taken, {"loss": torch.tensor([1.5])})
    assert queue.wait(timeout=1)
    assert queue.done()
    assert closure.output.status == RemoteValueStatus.READY
    fetched = closure.output.fetch()
    assert isinstance(fetched["loss"], np.ndarray)
    assert isinstance(closure.output.get()["loss"], torch.Tensor)


def test_the_first_error_cancels_the_queued_closures_and_is_raised_once():
    queue = ClosureQueue()
    first, second, third = _closure("1"), _closure("2"), _closure("3")
    for c in (first, second, third):
        queue.put(c)
    running = queue.get(timeout=1)
    queue.mark_failed(running, ValueError("bad batch"))
    assert second.output.status == RemoteValueStatus.ABORTED
    with pytest.raises(ClosureAbortedError, match="bad batch"):
        third.output.fetch()
    with pytest.raises(ValueError, match="bad batch"):
        first.output.fetch()
    with pytest.raises(ValueError, match="bad batch"):
        queue.wait(timeout=1)
    assert queue.wait(timeout=1)  # raised once, then forgotten
    queue.put(_closure())  # usable again


def test_schedule_raises_the_pending_error():
    queue = ClosureQueue()
    queue.put(_closure())
    queue.mark_failed(queue.get(timeout=1), KeyError("x"))
    with pytest.raises(KeyError):
        queue.put(_closure())
    queue.put(_closure())


def test_done_raises_the_pending_error():
    queue = ClosureQueue()
    queue.put(_closure())
    queue.mark_failed(queue.get(timeout=1), RuntimeError("boom"))
    with pytest.raises(RuntimeError, match="boom"):
        queue.done()


def test_a_closure_put_back_runs_first_and_counts_its_attempts():
    queue = ClosureQueue()
    lost, other = _closure("lost"), _closure("other")
    queue.put(lost)
    queue.put(other)
    assert queue.get(timeout=1) is lost
    queue.put_back(lost)
    assert lost.output.status == RemoteValueStatus.NOT_READY
    again = queue.get(timeout=1)
    assert again is lost
    assert lost.attempts == 2


def test_a_closure_put_back_after_a_failure_is_aborted():
    queue = ClosureQueue()
    a, b = _closure("a"), _closure("b")
    queue.put(a)
    queue.put(b)
    taken_a, taken_b = queue.get(timeout=1), queue.get(timeout=1)
    queue.mark_failed(taken_b, ValueError("b failed"))
    queue.put_back(taken_a)
    with pytest.raises(ClosureAbortedError):
        a.output.fetch()


def test_fail_all_fails_what_is_queued():
    queue = ClosureQueue()
    c = _closure()
    queue.put(c)
    queue.fail_all(RuntimeError("no worker"))
    with pytest.raises(ClosureAbortedError, match="no worker"):
        c.output.get()
    with pytest.raises(RuntimeError, match="no worker"):
        queue.wait(timeout=1)


def test_wait_times_out_while_work_is_pending_and_get_times_out_when_empty():
    queue = ClosureQueue()
    assert queue.get(timeout=0.01) is None
    queue.put(_closure())
    assert not queue.wait(timeout=0.05)
    assert queue.pending == 1


def test_stop_wakes_the_worker_threads():
    queue = ClosureQueue()
    results = []
    thread = threading.Thread(target=lambda: results.append(queue.get()))
    thread.start()
    queue.stop()
    thread.join(timeout=5)
    assert results == [None]


def test_put_blocks_while_the_queue_is_full():
    queue = ClosureQueue(max_size=1)
    queue.put(_closure())
    started = threading.Event()
    done = threading.Event()

    def put_second():
        started.set()
        queue.put(_closure())
        done.set()

    thread = threading.Thread(target=put_second)
    thread.start()
    started.wait(1)
    assert not done.wait(0.1)
    queue.get(timeout=1)
    assert done.wait(5)
    thread.join()


def test_remote_value_fetch_times_out_with_a_hint():
    value = RemoteValue()
    assert value.status == RemoteValueStatus.NOT_READY
    with pytest.raises(TimeoutError, match="join"):
        value.fetch(timeout=0.01)
    value.set_result((torch.ones(2), 3))
    fetched = value.fetch()
    assert isinstance(fetched, tuple)
    assert fetched[1] == 3
    value._reset()
    assert value.status == RemoteValueStatus.NOT_READY


def test_fail_all_with_nothing_queued_leaves_no_error_behind():
    queue = ClosureQueue()
    queue.fail_all(RuntimeError("no worker"))
    assert queue.done()
    queue.put(_closure())


def test_a_closure_s_value_waits_as_long_as_its_coordinator_s_waiter_allows():
    stalled = Waiter(0.05, lambda: 0.0, lambda: "function 'f' (#1) on worker:0")
    closure = Closure(lambda: None, (), {}, stalled)
    message = r"^fetch\(\) of function '.*' \(#\d+\) waited 0s and no .* for 0\.05s"
    with pytest.raises(TimeoutError, match=message):
        closure.output.fetch()  # no timeout of its own: the waiter's stall bound, not the default's
