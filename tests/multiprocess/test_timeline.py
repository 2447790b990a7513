"""PHALANX_TIMELINE across processes: every task of a multi-worker job writes its own trace."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from support.cluster import run_cluster

pytestmark = pytest.mark.multiprocess

SCRIPTS = Path(__file__).resolve().parent / "scripts"


def test_each_worker_writes_its_trace(tmp_path):
    trace = tmp_path / "traces" / "step.json"
    env = {"PHALANX_TIMELINE": str(trace)}
    run_cluster(SCRIPTS / "tf_config_program.py", tmp_path, chief=True, workers=1, env=env).check()
    files = sorted(p.name for p in trace.parent.iterdir())
    assert files == ["step.chief-0.json", "step.worker-0.json"]
    for name in files:
        events = json.loads((trace.parent / name).read_text())["traceEvents"]
        spans = [e["name"] for e in events if e["ph"] == "X"]
        assert spans.count("forward Linear") == spans.count("backward") == spans.count("SGD.step") > 0
        assert any(e.get("cat") == "collective" for e in events)  # gradient all-reduces, broadcasts
        assert next(e for e in events if e["name"] == "process_name")["args"]["name"] == name.split(".")[1]


def test_parameter_server_workers_trace_their_reads_and_pushes(tmp_path):
    trace = tmp_path / "traces" / "ps.json"
    env = {"PHALANX_TIMELINE": str(trace), "PHALANX_TIMELINE_FLUSH_SECONDS": "0.5"}
    run_cluster(
        SCRIPTS / "ps_checks.py", tmp_path, "train", chief=True, workers=2, ps=2, env=env, timeout=240
    ).check()
    # the workers are stopped when the chief is done: their traces come from the periodic flush
    names = set()
    for path in trace.parent.glob("ps.worker-*.json"):
        names |= {e["name"] for e in json.loads(path.read_text())["traceEvents"] if e["ph"] == "X"}
    assert {"ps read", "ps push", "forward Sequential", "backward"} <= names
