"""A dead or missing worker becomes an error naming it on the others; nothing hangs."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from phalanx.cluster import launch
from phalanx.cluster.launcher import task_environments

pytestmark = pytest.mark.multiprocess
SCRIPTS = Path(__file__).resolve().parents[1] / "multiprocess" / "scripts"
BOUND_SECONDS = 12.0  # heartbeat timeout (10 s) + poll interval: the documented bound


def test_sigkilled_worker_is_named_by_the_survivor_within_the_bound(tmp_path):
    # started by hand: the launcher would stop the survivor as soon as worker 1 dies
    envs = task_environments(2)
    procs = [
        subprocess.Popen(
            [sys.executable, str(SCRIPTS / "train_forever.py"), "1", "20", str(tmp_path)],
            env={**os.environ, **envs[f"worker-{r}"]},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for r in range(2)
    ]
    try:
        outputs = [p.communicate(timeout=90)[0].decode() for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert procs[1].returncode == -signal.SIGKILL
    assert procs[0].returncode != 0
    error = (tmp_path / "error-0.txt").read_text().splitlines()
    elapsed, message = float(error[0]), "\n".join(error[1:])
    assert elapsed < BOUND_SECONDS, outputs[0]
    assert "worker:1" in message
    assert "PeerUnavailableError" in outputs[0]


def test_launcher_stops_the_others_and_fails_when_a_worker_dies(tmp_path):
    out = io.StringIO()
    code = launch(
        str(SCRIPTS / "train_forever.py"), workers=2, args=["1", "5", str(tmp_path)], timeout=90, out=out
    )
    assert code == -signal.SIGKILL
    assert "worker-1 exited with code -9; stopping the other tasks" in out.getvalue()


def test_a_worker_that_never_joins_is_named(tmp_path):
    out = io.StringIO()
    code = launch(
        str(SCRIPTS / "never_joins.py"),
        workers=2,
        timeout=60,
        out=out,
        env={"PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1])])},
    )
    text = out.getvalue()
    assert code != 0, text
    assert "waiting for ['worker:1" in text
    assert "to join" in text
