"""The coordinator's deadlines: where they come from, the bounded wait of join()/fetch(), and
join()'s first error (real in-process gRPC cluster where a worker is needed)."""

from __future__ import annotations

import time

import pytest
import torch

from phalanx.ps.coordinator.cluster_coordinator import ClusterCoordinator
from phalanx.ps.coordinator.deadlines import (
    CLOSURE_TIMEOUT_ENV,
    DEFAULT_CLOSURE_TIMEOUT,
    DEFAULT_HEARTBEAT_TIMEOUT,
    WAIT_TIMEOUT_ENV,
    Deadlines,
    Waiter,
)


def test_deadlines_come_from_the_arguments_else_the_environment_else_the_defaults(monkeypatch):
    monkeypatch.delenv(CLOSURE_TIMEOUT_ENV, raising=False)
    monkeypatch.delenv(WAIT_TIMEOUT_ENV, raising=False)
    monkeypatch.delenv("PHALANX_HEARTBEAT_TIMEOUT_SECONDS", raising=False)
    default = Deadlines.resolve()
    assert default.closure_timeout == DEFAULT_CLOSURE_TIMEOUT
    assert default.heartbeat_timeout == DEFAULT_HEARTBEAT_TIMEOUT
    # the default wait outlasts every deadline the coordinator itself applies
    assert default.wait_timeout == DEFAULT_CLOSURE_TIMEOUT + DEFAULT_HEARTBEAT_TIMEOUT + 60.0
    monkeypatch.setenv(CLOSURE_TIMEOUT_ENV, "30")
    monkeypatch.setenv(WAIT_TIMEOUT_ENV, "7")
    from_env = Deadlines.resolve()
    assert (from_env.closure_timeout, from_env.wait_timeout) == (30.0, 7.0)
    given = Deadlines.resolve(closure_timeout=2, heartbeat_timeout=3, recovery_timeout=4, wait_timeout=5)
    assert given == Deadlines(2.0, 3.0, 4.0, 5.0)


@pytest.mark.parametrize("name", ["closure_timeout", "heartbeat_timeout", "wait_timeout"])
def test_a_deadline_that_is_not_positive_is_refused_with_the_rule(name):
    with pytest.raises(
        ValueError,
        match=rf"ClusterCoordinator's {name} must be a positive number of "
        rf"seconds\. Received: 0\. HINT: leave it unset",
    ):
        Deadlines.resolve(**{name: 0})


def test_an_environment_deadline_that_is_not_a_number_is_refused(monkeypatch):
    monkeypatch.setenv(CLOSURE_TIMEOUT_ENV, "soon")
    with pytest.raises(ValueError, match=r"PHALANX_CLOSURE_TIMEOUT_SECONDS must be a positive number"):
        Deadlines.resolve()


def test_a_wait_without_a_timeout_ends_once_nothing_progressed_for_the_stall_bound():
    waiter = Waiter(0.2, time.monotonic, lambda: "function 'f' (#1) on worker:0")
    stalled = Waiter(0.2, lambda: 0.0, lambda: "function 'f' (#1) on worker:0")
    # progress that never stops keeps the wait going: it ends when the thing is ready
    calls = []
    waiter.wait(lambda s: calls.append(s) or len(calls) > 3, None, "join()")
    with pytest.raises(TimeoutError) as raised:
        stalled.wait(lambda s: False, None, "join()")
    assert str(raised.value).startswith(
        "join() waited 0s and no scheduled function finished for 0.2s, the coordinator's wait_timeout. "
        "Received: pending: function 'f' (#1) on worker:0. HINT:"
    )


def test_a_wait_with_a_timeout_names_it_and_what_is_pending():
    waiter = Waiter(1000.0, time.monotonic, lambda: "2 function(s) queued or running")
    with pytest.raises(
        TimeoutError,
        match=r"^join\(\) did not finish within its timeout of 0\.05s\. "
        r"Received: timeout=0\.05; pending: 2 function\(s\) queued or running\. HINT:",
    ):
        waiter.wait(lambda s: False, 0.05, "join()")


def test_the_function_s_error_is_what_a_wait_raises():
    def ready(seconds):
        raise ValueError("the function's error")

    with pytest.raises(ValueError, match="the function's error"):
        Waiter(1.0, time.monotonic, str).wait(ready, None, "join()")


def _bump(model):
    with torch.no_grad():
        model.bias.add_(1.0)


def test_join_raises_the_function_s_error_not_the_stopped_ps_task_s(ps_2workers_1ps):
    strategy = ps_2workers_1ps.strategy()
    coordinator = ClusterCoordinator(strategy)
    with strategy.scope():
        model = torch.nn.Linear(2, 1)
    coordinator.schedule(_bump, args=(model,))  # the copies are stale: join() would read them
    coordinator.join()
    coordinator.schedule(lambda: 1 / 0)
    ps_2workers_1ps.servers[("ps", 0)].stop()  # a refresh now could only fail
    with pytest.raises(ZeroDivisionError):
        coordinator.join()  # the function's error, not the ps task's


def test_the_ps_call_deadline_comes_from_the_environment(monkeypatch):
    from phalanx.ps.coordinator.deadlines import DEFAULT_PS_CALL_TIMEOUT, PS_CALL_TIMEOUT_ENV, ps_call_timeout

    monkeypatch.delenv(PS_CALL_TIMEOUT_ENV, raising=False)
    assert ps_call_timeout() == DEFAULT_PS_CALL_TIMEOUT
    monkeypatch.setenv(PS_CALL_TIMEOUT_ENV, "8")
    assert ps_call_timeout() == 8.0
    monkeypatch.setenv(PS_CALL_TIMEOUT_ENV, "-1")
    with pytest.raises(ValueError, match="PHALANX_PS_CALL_TIMEOUT_SECONDS must be a positive number"):
        ps_call_timeout()
