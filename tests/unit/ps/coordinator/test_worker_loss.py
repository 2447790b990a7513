"""The worker-loss state machine and its policy, one transition at a time (no process, no
thread, a fake clock)."""

from __future__ import annotations

import pytest

from phalanx.ps.coordinator.worker_loss import (
    Action,
    Event,
    FailurePolicy,
    FleetStatus,
    NoWorkerAvailableError,
    WorkerState,
    WorkerStateMachine,
)


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock():
    return FakeClock()


@pytest.fixture
def machine(clock):
    return WorkerStateMachine(["worker:0", "worker:1"], FailurePolicy(recovery_timeout=10.0), clock)


def _all_lost(machine):
    machine.worker_lost(0)
    machine.worker_lost(1)


def test_every_worker_starts_running(machine):
    assert [machine.state(i) for i in range(2)] == [WorkerState.RUNNING] * 2
    assert machine.lost == frozenset()


def test_a_worker_lost_running_a_function_is_lost_and_the_function_is_retried_elsewhere(machine):
    decision = machine.worker_lost(1)
    assert decision.action is Action.RETRY
    assert machine.state(1) is WorkerState.LOST
    assert machine.state(0) is WorkerState.RUNNING
    assert machine.lost == frozenset({1})


def test_a_lost_worker_that_answers_runs_again(machine):
    machine.worker_lost(1)
    decision = machine.worker_back(1)
    assert decision.action is Action.RESUME
    assert machine.state(1) is WorkerState.RUNNING
    assert machine.lost == frozenset()


def test_while_another_worker_runs_a_lost_worker_is_waited_for_forever(machine, clock):
    machine.worker_lost(1)
    clock.now += 1e6
    assert machine.waited(pending=5).action is Action.WAIT


def test_with_every_worker_lost_the_chief_waits_until_the_recovery_timeout(machine, clock):
    _all_lost(machine)
    clock.now += 9.9
    assert machine.waited(pending=1).action is Action.WAIT


def test_every_worker_lost_for_the_recovery_timeout_with_functions_pending_asks_for_a_probe(machine, clock):
    _all_lost(machine)
    clock.now += 10.0
    decision = machine.waited(pending=1)
    assert decision.action is Action.PROBE
    assert decision.error is None


def test_every_worker_lost_for_the_recovery_timeout_with_nothing_pending_waits(machine, clock):
    _all_lost(machine)
    clock.now += 60.0
    assert machine.waited(pending=0).action is Action.WAIT


def test_a_probe_that_a_worker_answered_keeps_waiting(machine, clock):
    _all_lost(machine)
    clock.now += 10.0
    assert machine.probed(answered=True, pending=1).action is Action.WAIT


def test_an_unanswered_probe_fails_the_queue_naming_the_lost_workers(machine, clock):
    _all_lost(machine)
    clock.now += 10.0
    decision = machine.probed(answered=False, pending=1)
    assert decision.action is Action.FAIL
    assert isinstance(decision.error, NoWorkerAvailableError)
    with pytest.raises(NoWorkerAvailableError, match=r"for 10s: lost \['worker:0', 'worker:1'\]\. HINT"):
        raise decision.error


def test_an_unanswered_probe_after_a_worker_came_back_waits(machine, clock):
    _all_lost(machine)
    clock.now += 10.0
    machine.worker_back(0)  # between the PROBE decision and the probe's result
    assert machine.probed(answered=False, pending=1).action is Action.WAIT


def test_the_outage_starts_when_the_last_running_worker_is_lost(machine, clock):
    machine.worker_lost(0)
    clock.now += 50.0
    machine.worker_lost(1)
    clock.now += 9.0
    assert machine.waited(pending=1).action is Action.WAIT
    clock.now += 1.0
    assert machine.waited(pending=1).action is Action.PROBE


def test_a_worker_coming_back_ends_the_outage_and_the_next_one_starts_from_zero(machine, clock):
    _all_lost(machine)
    clock.now += 8.0
    machine.worker_back(0)
    machine.worker_lost(0)
    clock.now += 8.0  # 16s since the first outage began, 8s since this one
    assert machine.waited(pending=1).action is Action.WAIT


@pytest.mark.parametrize(
    ("event", "status", "action"),
    [
        (Event.WORKER_LOST, FleetStatus(("w",), 99.0, 1), Action.RETRY),
        (Event.WORKER_BACK, FleetStatus((), None, 1), Action.RESUME),
        (Event.WAITED, FleetStatus(("w",), None, 1), Action.WAIT),
        (Event.WAITED, FleetStatus(("w",), 4.9, 1), Action.WAIT),
        (Event.WAITED, FleetStatus(("w",), 5.0, 0), Action.WAIT),
        (Event.WAITED, FleetStatus(("w",), 5.0, 1), Action.PROBE),
        (Event.PROBE_ANSWERED, FleetStatus(("w",), 5.0, 1), Action.WAIT),
        (Event.PROBE_UNANSWERED, FleetStatus(("w",), 4.0, 1), Action.WAIT),
        (Event.PROBE_UNANSWERED, FleetStatus(("w",), 5.0, 1), Action.FAIL),
    ],
)
def test_the_policy_decides_from_the_event_and_the_status_alone(event, status, action):
    assert FailurePolicy(recovery_timeout=5.0).make_decision(event, status).action is action


# ---------------------------------------------------------------------- a function past its deadline
def test_a_function_past_its_deadline_on_a_live_worker_fails_and_its_worker_is_hung(machine):
    decision = machine.closure_timed_out(0)
    assert decision.action is Action.ABORT  # the function's own fault: not retried elsewhere
    assert machine.state(0) is WorkerState.HUNG
    assert machine.hung == frozenset({0})
    assert machine.lost == frozenset()


def test_a_hung_worker_whose_function_returned_runs_again(machine):
    machine.closure_timed_out(0)
    assert machine.worker_back(0).action is Action.RESUME
    assert machine.state(0) is WorkerState.RUNNING
    assert machine.hung == frozenset()


def test_when_no_worker_runs_the_error_names_the_lost_and_the_hung_workers(machine, clock):
    machine.worker_lost(0)
    machine.closure_timed_out(1)
    clock.now += 10.0
    assert machine.waited(pending=1).action is Action.PROBE
    decision = machine.probed(answered=False, pending=1)
    assert decision.action is Action.FAIL
    assert isinstance(decision.error, NoWorkerAvailableError)
    assert str(decision.error) == (
        "No worker was available for 10s: lost ['worker:0']; still running a function past its "
        "deadline ['worker:1']. HINT: restart the worker tasks (they rejoin by themselves), or check "
        "their logs."
    )
