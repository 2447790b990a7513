"""TF1 cluster mode with real processes (examples/tf1_*.py): servers started as separate
processes driven by a client outside the cluster spec; between-graph replication where every
worker is its own client, one of them killed and restarted."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

import pytest

import phalanx
from support.cluster import LocalCluster, run_python

pytestmark = pytest.mark.multiprocess
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_a_client_outside_the_cluster_drives_servers_started_as_processes():
    with LocalCluster(workers=2, ps=1) as cluster:  # no chief: the client is no task of it
        cluster.start(EXAMPLES / "tf1_server.py")
        token = {"PHALANX_CLUSTER_TOKEN": cluster.env["PHALANX_CLUSTER_TOKEN"]}
        done = run_python(
            EXAMPLES / "tf1_client.py",
            "--cluster",
            json.dumps(cluster.spec),
            "--steps",
            80,
            env=token,
            timeout=180,
        )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "steps ran on workers [0, 1]" in done.stdout  # both server processes ran steps
    first, last = map(float, re.search(r"loss: first (\S+), last (\S+)", done.stdout).groups())
    assert last < 0.1 * first
    weights = json.loads(re.search(r"weights: (\[.*\])", done.stdout).group(1))
    assert weights == pytest.approx([2.0, -3.0, 0.5], abs=0.2)  # read back from the ps task


def _latest_step(directory: Path) -> int:
    latest = phalanx.checkpoint.latest_checkpoint(str(directory))
    return -1 if latest is None else int(latest.rsplit("-", 1)[1].split(".")[0])


def _wait_for_checkpoint(directory: Path, step: int, timeout: float) -> int:
    deadline = time.monotonic() + timeout
    while _latest_step(directory) < step:
        assert time.monotonic() < deadline, f"the chief wrote no checkpoint of step >= {step} in {timeout}s"
        time.sleep(0.2)
    return _latest_step(directory)


def test_between_graph_replication_survives_a_killed_and_restarted_worker(tmp_path):
    script, ckpt = EXAMPLES / "tf1_between_graph.py", tmp_path / "train_logs"
    args = ["--checkpoint-dir", ckpt, "--last-step", 600]
    with LocalCluster(workers=2, ps=1) as cluster:
        cluster.start(script, *args)
        reached = _wait_for_checkpoint(ckpt, 50, timeout=120)  # training is under way
        os.killpg(cluster.pid("worker-1"), signal.SIGKILL)
        config = {"cluster": cluster.spec, "task": {"type": "worker", "index": 1}}
        env = {"TF_CONFIG": json.dumps(config), "PHALANX_CLUSTER_TOKEN": cluster.env["PHALANX_CLUSTER_TOKEN"]}
        restarted = run_python(script, *args, env=env, timeout=180)
        run = cluster.wait(180, names=["worker-0"])
    run.check("worker-0")
    assert run["worker-1"].returncode == -signal.SIGKILL
    assert restarted.returncode == 0, restarted.stdout[-3000:] + restarted.stderr[-3000:]
    # the restarted worker started from the cluster's global step and values, not from scratch
    start = int(re.search(r"worker:1 starts at global step (\d+)", restarted.stdout).group(1))
    assert start >= reached
    chief = run["worker-0"].output
    assert "worker:0 starts at global step 0" in chief
    final, loss = re.search(r"worker:0 took \d+ steps; global step (\d+); loss (\S+)", chief).groups()
    assert int(final) >= 600
    assert float(loss) < 0.1
    # the chief alone wrote checkpoints (the last at the end) and TensorBoard summaries; the
    # last is saved when its session closes, after it printed the step: the other worker's
    # step in flight then (it stops after its first step that sees the last step) may land first
    assert int(final) <= _latest_step(ckpt) <= int(final) + 1
    assert list(ckpt.glob("events.out.tfevents.*"))
