"""The status page of a job not started by ``phalanx launch``: with PHALANX_STATUS_ADDRESS on
every task, the chief serves it and every task reports there (the route for torchrun, Ray,
SLURM and Kubernetes jobs). The launcher's own page is tested in tests/faults/test_status_page.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from support.cluster import free_ports, run_cluster

pytestmark = pytest.mark.multiprocess

SCRIPT = Path(__file__).parent / "scripts" / "status_chief.py"
PS_SCRIPT = Path(__file__).parent / "scripts" / "status_ps.py"


def test_the_chief_serves_the_page_and_every_worker_reports(tmp_path):
    (port,) = free_ports(1, "127.0.0.1")
    run_cluster(
        SCRIPT, tmp_path, workers=2, env={"PHALANX_STATUS_ADDRESS": f"127.0.0.1:{port}"}, timeout=180
    ).check()
    running = json.loads((tmp_path / "running.json").read_text())
    rows = {row["task"]: row for row in running["workers"]}
    assert sorted(rows) == ["worker:0", "worker:1"]
    for row in rows.values():
        assert row["state"] == "running"
        assert row["step"] >= 10
        assert row["resident_memory_bytes"] > 0
        assert row["last_error"] is None
    assert rows["worker:0"]["pid"] != rows["worker:1"]["pid"]
    assert running["job"]["membership_epoch"] is None  # not an elastic job
    done = json.loads((tmp_path / "done.json").read_text())
    assert {row["task"]: (row["state"], row["step"]) for row in done["workers"]} == {
        "worker:0": ("done", 20),
        "worker:1": ("done", 20),
    }
    assert [e["event"] for e in done["events"]].count("done") == 2


def test_a_parameter_server_job_shows_closures_and_ps_load(tmp_path):
    (port,) = free_ports(1, "127.0.0.1")
    env = {"PHALANX_STATUS_ADDRESS": f"127.0.0.1:{port}"}
    run_cluster(PS_SCRIPT, tmp_path, workers=2, chief=True, ps=1, env=env, timeout=180).check()
    view = json.loads((tmp_path / "ps.json").read_text())
    rows = {row["task"]: row for row in view["workers"]}
    assert sorted(rows) == ["chief:0", "ps:0", "worker:0", "worker:1"]
    assert all(row["state"] == "running" for row in rows.values()), rows
    ps = view["parameter_server"]
    assert sorted(ps["closures"]) == ["worker:0", "worker:1"]  # both workers ran closures
    assert sum(c["done"] for c in ps["closures"].values()) == 60
    assert (ps["lost_closures"], ps["rescheduled_closures"]) == (0, 0)
    assert list(ps["ps_tasks"]) == ["ps:0"]
    assert ps["ps_tasks"]["ps:0"]["state"] == "running"
