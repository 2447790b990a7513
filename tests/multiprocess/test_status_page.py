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
