"""The launcher's policy, one rule at a time, without processes."""

from __future__ import annotations

import pytest

from phalanx.cluster._supervisor import Outcome, TaskState, decide, describe_exit


def _decide(*states, timed_out=False, stop_auxiliary=True):
    tasks = [TaskState(name, not name.startswith(("ps", "evaluator")), code) for name, code in states]
    return decide(tasks, timed_out=timed_out, timeout=5.0, stop_auxiliary=stop_auxiliary)


def test_running_while_workers_run():
    assert _decide(("worker-0", None), ("worker-1", 0), ("ps-0", None)).outcome is Outcome.RUNNING


def test_success_when_every_worker_exited_0_even_if_ps_still_run():
    decision = _decide(("chief-0", 0), ("worker-0", 0), ("ps-0", None))
    assert (decision.outcome, decision.exit_code, decision.message) == (Outcome.SUCCEEDED, 0, "")


def test_a_failed_worker_is_named_with_its_code():
    decision = _decide(("worker-0", None), ("worker-1", 3))
    assert (decision.outcome, decision.exit_code) == (Outcome.FAILED, 3)
    assert decision.message == "worker-1 exited with code 3; stopping the other tasks."


def test_a_signal_death_keeps_popens_negative_code_and_names_the_signal():
    decision = _decide(("worker-0", -9), ("worker-1", None))
    assert decision.exit_code == -9
    assert decision.message == "worker-0 exited with code -9; stopping the other tasks. (killed by SIGKILL)"
    assert describe_exit(-999) == " (killed by signal 999)"


def test_workers_failures_are_reported_before_a_ps_failure():
    assert _decide(("ps-0", 1), ("worker-0", 2)).message.startswith("worker-0")


def test_a_ps_that_ends_before_the_workers_is_a_failure_in_local_mode():
    decision = _decide(("worker-0", None), ("ps-0", 0))
    assert (decision.outcome, decision.exit_code) == (Outcome.FAILED, 1)
    assert "ps-0 exited with code 0 before the workers finished" in decision.message


def test_per_node_mode_waits_for_every_task():
    assert _decide(("worker-0", 0), ("ps-0", None), stop_auxiliary=False).outcome is Outcome.RUNNING
    assert _decide(("worker-0", None), ("ps-0", 0), stop_auxiliary=False).outcome is Outcome.RUNNING
    assert _decide(("worker-0", 0), ("ps-0", 0), stop_auxiliary=False).outcome is Outcome.SUCCEEDED
    assert _decide(("ps-0", 0), stop_auxiliary=False).outcome is Outcome.SUCCEEDED  # a ps-only node
    assert _decide(("ps-0", 4), stop_auxiliary=False).exit_code == 4


@pytest.mark.parametrize("stop_auxiliary", [True, False])
def test_timeout_names_the_tasks_still_running(stop_auxiliary):
    decision = _decide(("worker-0", None), ("worker-1", 0), timed_out=True, stop_auxiliary=stop_auxiliary)
    assert (decision.outcome, decision.exit_code) == (Outcome.TIMED_OUT, 124)
    assert decision.message == "timed out after 5.0s; still running: ['worker-0']. Stopping them."


def test_success_and_failure_win_over_a_timeout_seen_at_the_same_poll():
    assert _decide(("worker-0", 0), timed_out=True).outcome is Outcome.SUCCEEDED
    assert _decide(("worker-0", 2), timed_out=True).outcome is Outcome.FAILED


def _coordinated(*states):
    tasks = [
        TaskState(name, name.startswith("chief"), code, not name.startswith("chief")) for name, code in states
    ]
    return decide(tasks, timed_out=False, timeout=5.0, stop_auxiliary=True)


def test_in_a_parameter_server_cluster_a_lost_worker_or_ps_is_the_coordinators_to_handle():
    decision = _coordinated(("chief-0", None), ("worker-0", -9), ("worker-1", None), ("ps-0", None))
    assert decision.outcome is Outcome.RUNNING
    assert _coordinated(("chief-0", None), ("ps-0", 1)).outcome is Outcome.RUNNING


def test_in_a_parameter_server_cluster_the_chief_alone_decides():
    assert _coordinated(("chief-0", 0), ("worker-0", None), ("ps-0", None)).outcome is Outcome.SUCCEEDED
    failed = _coordinated(("chief-0", 2), ("worker-0", None), ("ps-0", None))
    assert (failed.outcome, failed.exit_code) == (Outcome.FAILED, 2)


def _per_node_coordinated(*states):
    tasks = [
        TaskState(
            name, name.startswith("chief"), code, not name.startswith("chief"), name.startswith("chief")
        )
        for name, code in states
    ]
    return decide(tasks, timed_out=False, timeout=5.0, stop_auxiliary=False)


def test_per_node_mode_ends_with_a_local_chief_of_a_parameter_server_cluster():
    assert _per_node_coordinated(("chief-0", None), ("ps-0", None)).outcome is Outcome.RUNNING
    done = _per_node_coordinated(("chief-0", 0), ("worker-0", None), ("ps-0", None))
    assert (done.outcome, done.exit_code) == (Outcome.SUCCEEDED, 0)
    failed = _per_node_coordinated(("chief-0", 5), ("worker-0", None), ("ps-0", None))
    assert (failed.outcome, failed.exit_code) == (Outcome.FAILED, 5)


def test_a_node_whose_serving_tasks_all_ended_is_done_with_the_first_failure():
    assert _per_node_coordinated(("worker-0", 1), ("ps-0", None)).outcome is Outcome.RUNNING
    decision = _per_node_coordinated(("worker-0", -9), ("ps-0", 0))
    assert (decision.outcome, decision.exit_code) == (Outcome.FAILED, -9)
    assert decision.message == "worker-0 exited with code -9; no task is left. (killed by SIGKILL)"
    assert _per_node_coordinated(("worker-0", 0), ("ps-0", 0)).outcome is Outcome.SUCCEEDED


@pytest.mark.parametrize(("signum", "code"), [(2, 130), (15, 143), (1, 129)])
def test_a_signal_to_the_launcher_wins_and_gives_128_plus_its_number(signum, code):
    tasks = [TaskState("worker-0", True, None), TaskState("worker-1", True, 0)]
    decision = decide(tasks, timed_out=True, timeout=5.0, stop_auxiliary=True, signalled=signum)
    assert (decision.outcome, decision.exit_code) == (Outcome.SIGNALLED, code)
    name = {2: "SIGINT", 15: "SIGTERM", 1: "SIGHUP"}[signum]
    assert decision.message == f"received {name}; passing it on to ['worker-0'] and stopping them."
