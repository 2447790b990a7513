"""`phalanx launch`: one TF_CONFIG per task, prefixed output, failures stop everything."""

from __future__ import annotations

import argparse
import io
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from phalanx.cluster.launcher import launch, run_launch, task_environments

pytestmark = pytest.mark.multiprocess
SCRIPT = str(Path(__file__).parent / "scripts" / "launcher_task.py")


def test_every_task_gets_its_tf_config_and_prefix():
    out = io.StringIO()
    assert launch(SCRIPT, workers=2, chief=True, args=["ok"], out=out, timeout=60) == 0
    text = out.getvalue()
    assert "[chief-0] task chief:0 rank=0 world=3" in text
    assert "[worker-1] task worker:1 rank=2 world=3" in text


def test_a_failing_task_stops_the_others_and_is_named():
    out = io.StringIO()
    start = time.monotonic()
    assert launch(SCRIPT, workers=2, ps=1, args=["fail"], out=out, timeout=60) == 3
    assert time.monotonic() - start < 20
    assert "worker-1 exited with code 3; stopping the other tasks" in out.getvalue()


def test_timeout_names_the_tasks_still_running():
    out = io.StringIO()
    assert launch(SCRIPT, workers=1, args=["sleep"], out=out, timeout=2) == 124
    assert "still running: ['worker-0']" in out.getvalue()


def test_cli_and_argument_errors():
    done = subprocess.run(
        [sys.executable, "-m", "phalanx", "launch", "--workers", "2", SCRIPT, "ok"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "[worker-0] task worker:0" in done.stdout
    ns = argparse.Namespace(
        workers=2, nproc_per_node=3, ps=0, chief=False, timeout=None, script=SCRIPT, script_args=[]
    )
    with pytest.raises(ValueError, match="disagree"):
        run_launch(ns)
    with pytest.raises(ValueError, match="No such script"):
        launch("missing.py")
    with pytest.raises(ValueError, match="at least one chief or worker"):
        task_environments(0)
    with pytest.raises(ValueError, match="module-level function"):
        launch(lambda: None)


def test_per_node_mode_starts_only_this_nodes_tasks():
    from phalanx.cluster.launcher import free_ports, launch_node, node_environments

    a, b, c = free_ports(3)
    cluster = {"worker": [f"127.0.0.1:{a}", f"127.0.0.1:{b}", f"otherhost:{c}"]}
    envs = node_environments(cluster, node="127.0.0.1")
    assert sorted(envs) == ["worker-0", "worker-1"]
    out = io.StringIO()
    code = launch_node(
        SCRIPT, json.dumps({"cluster": cluster}), node="127.0.0.1", args=["ok"], out=out, timeout=60
    )
    assert code == 0
    assert "[worker-1] task worker:1" in out.getvalue()
    assert "worker-2" not in out.getvalue()
    with pytest.raises(ValueError, match="No task of the cluster runs on node"):
        node_environments(cluster, node="nowhere")
