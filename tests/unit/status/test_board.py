"""What /status.json makes of the reports: rows, lost tasks, events, the straggler, secrets."""

from __future__ import annotations

import pytest

from phalanx.status.board import Board
from phalanx.status.reports import LOST_AFTER


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _report(task: str, **fields) -> dict:
    report = {"task": task, "pid": 10 + int(task[-1]), "host": "node", "state": "running", "step": 0}
    return {**report, **fields}


def _rows(board: Board) -> dict[str, dict]:
    return {row["task"]: row for row in board.snapshot()["workers"]}


def test_the_board_names_the_straggler_and_the_job():
    clock = Clock()
    board = Board(clock=clock, wall=lambda: 5.0)
    board.receive(_report("worker:1", step=40, steps_per_second=5.0, collective_wait_fraction=0.02))
    board.receive(_report("worker:0", step=41, steps_per_second=5.0, collective_wait_fraction=0.9))
    board.receive(_report("worker:2", state="joining"))
    clock.now += 3.0
    view = board.snapshot()
    assert [row["task"] for row in view["workers"]] == ["worker:0", "worker:1", "worker:2"]
    rows = _rows(board)
    assert rows["worker:1"]["straggler"]
    assert not rows["worker:0"]["straggler"]
    assert not rows["worker:2"]["straggler"]  # joining workers are not judged
    job = view["job"]
    assert job["straggler"] == "worker:1"
    assert job["workers"] == {"joining": 1, "running": 2, "done": 0, "lost": 0}
    assert job["elapsed_seconds"] == 3.0
    assert job["eta_seconds"] is None  # no step count
    assert [e["event"] for e in view["events"]] == ["joined"] * 3
    assert view["parameter_server"] is None


def test_eta_from_the_step_count():
    board = Board(clock=Clock())
    board.receive(_report("worker:0", step=100, total_steps=1100, steps_per_second=4.0))
    board.receive(_report("worker:1", step=99, total_steps=1100, steps_per_second=4.0))
    assert board.snapshot()["job"]["eta_seconds"] == pytest.approx(250.0)


def test_a_silent_task_is_lost_and_a_done_one_is_not():
    clock = Clock()
    board = Board(clock=clock)
    board.receive(_report("worker:0"))
    board.receive(_report("worker:1", state="done"))
    clock.now += LOST_AFTER + 1
    rows = _rows(board)
    assert rows["worker:0"]["state"] == "lost"
    assert "no report for 11s" in rows["worker:0"]["lost_reason"]
    assert rows["worker:0"]["steps_per_second"] is None
    assert rows["worker:1"]["state"] == "done"
    assert [(e["task"], e["event"]) for e in board.snapshot()["events"]][-1] == ("worker:0", "left")


def test_an_exit_the_launcher_saw_is_lost_at_once_and_a_restart_joins_again():
    board = Board(clock=Clock())
    board.receive(_report("worker:1"))
    board.task_exited("worker:1", "exited with code -9 (killed by SIGKILL)")
    assert _rows(board)["worker:1"]["state"] == "lost"
    board.receive(_report("worker:1", pid=99))  # the restarted process
    assert _rows(board)["worker:1"]["state"] == "running"
    events = [(e["event"], e["reason"]) for e in board.snapshot()["events"]]
    assert events[-2:] == [
        ("left", "exited with code -9 (killed by SIGKILL)"),
        ("joined", "restarted: pid 99 on node"),
    ]


def test_a_task_that_failed_reports_lost_with_its_error():
    board = Board(clock=Clock())
    board.receive(_report("worker:0"))
    board.receive(_report("worker:0", state="lost", last_error="PeerUnavailableError: worker:1 exited"))
    row = _rows(board)["worker:0"]
    assert row["state"] == "lost"
    assert row["last_error"] == "PeerUnavailableError: worker:1 exited"


def test_membership_epochs_are_events():
    board = Board(clock=Clock())
    board.receive(_report("worker:0", membership_epoch=0))
    board.receive(_report("worker:1", membership_epoch=0))
    board.receive(_report("worker:0", membership_epoch=1))
    view = board.snapshot()
    assert view["job"]["membership_epoch"] == 1
    assert [e["reason"] for e in view["events"] if e["event"] == "membership"] == [
        "epoch 0 (first reported by worker:0)",
        "epoch 1 (first reported by worker:0)",
    ]


def test_secrets_are_never_shown():
    board = Board(secrets=("s3cret-token-value",), clock=Clock())
    board.receive(_report("worker:0", last_error="connect failed with token s3cret-token-value"))
    text = repr(board.snapshot())
    assert "s3cret-token-value" not in text
    assert "connect failed with token ***" in text


def test_parameter_server_section():
    board = Board(clock=Clock())
    closures = {"worker:0": {"done": 5, "lost": 1, "rescheduled": 1, "per_second": 2.0}}
    board.receive(_report("chief:0", closures=closures))
    board.receive(_report("ps:0", requests_per_second=30.0))
    ps = board.snapshot()["parameter_server"]
    assert ps["closures"] == closures
    assert ps["lost_closures"] == 1
    assert ps["rescheduled_closures"] == 1
    assert ps["ps_tasks"] == {"ps:0": {"state": "running", "requests_per_second": 30.0}}


@pytest.mark.parametrize(
    "report",
    [
        [],
        {"task": "worker:0"},
        {"task": "worker:0", "pid": "1", "host": "h", "state": "running"},
        _report("worker:0", state="sleeping"),
    ],
)
def test_a_malformed_report_is_refused(report):
    with pytest.raises(ValueError, match=r"A status report must be a JSON object with 'task' \(str\), 'pid'"):
        Board().receive(report)


def test_a_task_that_makes_a_strategy_again_joins_again():
    board = Board(clock=Clock())
    board.receive(_report("worker:0"))
    board.receive(_report("worker:0", state="done"))
    board.receive(_report("worker:0", state="joining"))
    events = [(e["event"], e["reason"]) for e in board.snapshot()["events"]]
    assert events == [
        ("joined", "pid 10 on node"),
        ("done", "closed its strategy"),
        ("joined", "reports again"),
    ]
