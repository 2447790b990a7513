"""A task's part: off without PHALANX_STATUS_ADDRESS; on the chief, one server per address
that a strategy made again reuses; every task reports to it."""

from __future__ import annotations

from phalanx.cluster._ports import free_ports
from phalanx.status.settings import ADDRESS_ENV, SERVED_BY_ENV
from phalanx.status.taking_part import join_status


def test_off_without_the_address(monkeypatch):
    monkeypatch.delenv(ADDRESS_ENV, raising=False)
    assert join_status("worker:0", is_chief=True) is None


def test_the_chief_serves_once_per_address_and_every_task_reports(monkeypatch):
    (port,) = free_ports(1, "127.0.0.1")
    monkeypatch.setenv(ADDRESS_ENV, f"127.0.0.1:{port}")
    monkeypatch.delenv(SERVED_BY_ENV, raising=False)
    monkeypatch.delenv("PHALANX_CLUSTER_TOKEN", raising=False)
    monkeypatch.setattr("phalanx.status.taking_part._SERVERS", {})  # this test's server only
    first = join_status("worker:0", is_chief=True)
    assert first is not None
    assert first.server is not None
    first.running()
    other = join_status("worker:1", is_chief=False)
    assert other is not None
    assert other.server is None
    first.close()
    again = join_status("worker:0", is_chief=True)  # a second strategy in the same process
    assert again is not None
    assert again.server is first.server
    other.close()
    again.close()
    rows = {row["task"]: row["state"] for row in first.server.board.snapshot()["workers"]}
    assert rows == {"worker:0": "done", "worker:1": "done"}
    first.server.stop()


def test_a_launcher_served_job_starts_no_server_on_the_chief(monkeypatch):
    (port,) = free_ports(1, "127.0.0.1")
    monkeypatch.setenv(ADDRESS_ENV, f"127.0.0.1:{port}")
    monkeypatch.setenv(SERVED_BY_ENV, "launcher")
    status = join_status("worker:0", is_chief=True)
    assert status is not None
    assert status.server is None
    status.close()  # nobody listens: the last report is dropped, nothing waits long
