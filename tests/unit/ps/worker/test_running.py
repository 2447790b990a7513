"""The worker's side of the heartbeat: which function runs, and when it stops writing (a fake clock)."""

from __future__ import annotations

import pytest

from phalanx.ps.worker.running import ClosureAbandonedError, RunningClosure


class FakeClock:
    def __init__(self) -> None:
        self.now = 50.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock():
    return FakeClock()


def test_the_heartbeat_reply_names_the_running_function_and_how_long_it_runs(clock):
    current = RunningClosure(clock)
    assert current.status() == {"running": None, "running_for": 0.0}
    with current.running(7, heartbeat_timeout=4.0):
        clock.now += 3.0
        assert current.status() == {"running": 7, "running_for": 3.0}
    assert current.status() == {"running": None, "running_for": 0.0}


def test_a_function_the_coordinator_still_asks_about_keeps_writing(clock):
    current = RunningClosure(clock)
    with current.running(7, heartbeat_timeout=4.0):
        for _ in range(5):
            clock.now += 3.0
            current.heard(7)
            current.check_wanted("pushing its gradients")  # does not raise


def test_a_function_nobody_asked_about_for_the_heartbeat_timeout_writes_nothing_more(clock):
    current = RunningClosure(clock)
    with current.running(7, heartbeat_timeout=4.0):
        clock.now += 3.0
        current.heard(8)  # a ping about another function (or about none) does not count
        current.heard(None)
        current.check_wanted("pushing its gradients")
        clock.now += 1.5
        with pytest.raises(ClosureAbandonedError) as raised:
            current.check_wanted("pushing its gradients to the ps tasks")
    assert str(raised.value).startswith(
        "Function 7 stopped before pushing its gradients to the ps tasks: the coordinator has not asked "
        "about it for 4.5s, longer than its heartbeat timeout of 4s"
    )
    assert "HINT:" in str(raised.value)


def test_without_a_heartbeat_timeout_or_a_function_nothing_is_refused(clock):
    current = RunningClosure(clock)
    current.check_wanted("anything")
    with current.running(1, heartbeat_timeout=None):
        clock.now += 1e6
        current.check_wanted("anything")
