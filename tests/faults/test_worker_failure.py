"""A dead, silent or missing worker becomes an error naming it on the others; nothing hangs."""

from __future__ import annotations

import io
import logging
import signal
import socket
import time
from pathlib import Path

import pytest

import phalanx
from phalanx.cluster import SimpleClusterResolver, launch
from phalanx.communication.group.worker_group import PeerUnavailableError
from support.cluster import LocalCluster, free_ports

pytestmark = pytest.mark.multiprocess
SCRIPTS = Path(__file__).resolve().parents[1] / "multiprocess" / "scripts"
BOUND_SECONDS = 12.0  # heartbeat timeout (10 s) + beat (1 s) + poll (0.5 s): the documented bound


def _start_workers(cluster, args):
    """Both workers run train_forever.py; none is stopped when another dies (a launcher would)."""
    return cluster.start(SCRIPTS / "train_forever.py", *args)


@pytest.mark.parametrize("transport", ["shared_memory", "gloo"])
def test_sigkilled_worker_is_named_by_the_survivor_within_the_bound(tmp_path, transport):
    env = {"PHALANX_SHARED_MEMORY": "1" if transport == "shared_memory" else "0"}
    with LocalCluster(2, env=env) as cluster:
        run = _start_workers(cluster, [1, 20, tmp_path]).wait(timeout=90)
    assert run["worker-1"].returncode == -signal.SIGKILL
    assert run["worker-0"].returncode != 0
    error = (tmp_path / "error-0.txt").read_text().splitlines()
    elapsed, message = float(error[0]), "\n".join(error[1:])
    assert elapsed < BOUND_SECONDS, run.output
    assert f"worker:1 ({cluster.address('worker-1')})" in message
    assert "PeerUnavailableError" in run["worker-0"].output


@pytest.mark.parametrize("transport", ["shared_memory", "gloo"])
def test_a_worker_killed_inside_a_late_bucket_exchange_is_named_within_the_bound(tmp_path, transport):
    # step 40 of a long run: the buckets settled long before (one model idle, not expected)
    env = {"PHALANX_SHARED_MEMORY": "1" if transport == "shared_memory" else "0"}
    with LocalCluster(2, env=env) as cluster:
        run = cluster.start(SCRIPTS / "die_in_late_exchange.py", 40, tmp_path).wait(timeout=90)
    assert run["worker-1"].returncode == -signal.SIGKILL, run.output
    assert run["worker-0"].returncode != 0
    error = (tmp_path / "error-0.txt").read_text().splitlines()
    elapsed, message = float(error[0]), "\n".join(error[1:])
    assert elapsed < BOUND_SECONDS, run.output
    assert f"worker:1 ({cluster.address('worker-1')})" in message


def test_a_worker_that_stops_answering_is_named_after_its_heartbeat_timeout(tmp_path):
    # SIGSTOP keeps the sockets open: only the heartbeats can tell. A 2 s heartbeat timeout
    # bounds the detection by 2 + 1 (beat) + 0.5 (poll) seconds.
    with LocalCluster(2, env={"PHALANX_HEARTBEAT_TIMEOUT_SECONDS": "2"}) as cluster:
        run = _start_workers(cluster, [1, 10, tmp_path, "STOP"]).wait(timeout=90, names=["worker-0"])
    assert run["worker-0"].returncode != 0, run.output  # the stopped worker was killed after it
    error = (tmp_path / "error-0.txt").read_text().splitlines()
    elapsed, message = float(error[0]), "\n".join(error[1:])
    assert 1.0 < elapsed < 2 + 1 + 0.5 + 2.5, run.output  # 2.5 s of slack for a loaded machine
    assert f"worker:1 ({cluster.address('worker-1')}) stopped sending heartbeats" in message


def test_launcher_stops_the_others_and_fails_when_a_worker_dies(tmp_path):
    out = io.StringIO()
    code = launch(
        str(SCRIPTS / "train_forever.py"), workers=2, args=["1", "5", str(tmp_path)], timeout=90, out=out
    )
    assert code == -signal.SIGKILL
    assert "worker-1 exited with code -9; stopping the other tasks" in out.getvalue()


def _two_worker_resolver(index):
    workers = [f"127.0.0.1:{p}" for p in free_ports(2)]
    return SimpleClusterResolver({"worker": workers}, task_type="worker", task_id=index), workers


def test_a_worker_that_never_joins_is_named_after_the_deadline(caplog):
    resolver, workers = _two_worker_resolver(0)  # the chief; worker 1 never starts
    start = time.monotonic()
    with (
        caplog.at_level(logging.WARNING, logger="phalanx"),
        pytest.raises(
            PeerUnavailableError, match=rf"Gave up after 1.5s waiting for \['worker:1 \({workers[1]}\)'\]"
        ),
    ):
        phalanx.MultiWorkerMirroredStrategy(resolver, join_timeout=1.5)
    # the deadline, not the 120 s default (a store connection may wait 5 s for torch's DNS lookup)
    assert 1.5 <= time.monotonic() - start < 15
    assert f"Still waiting for ['worker:1 ({workers[1]})'] to join" in caplog.text  # logged while waiting


def test_a_chief_that_never_starts_is_named_after_the_deadline(caplog, monkeypatch):
    resolver, workers = _two_worker_resolver(1)
    monkeypatch.setenv("PHALANX_JOIN_TIMEOUT_SECONDS", "1.5")  # the variable sets the default
    with (
        caplog.at_level(logging.WARNING, logger="phalanx"),
        pytest.raises(
            PeerUnavailableError, match=rf"waiting for \['worker:0 \({workers[0]}\)'\] to join: nothing"
        ),
    ):
        phalanx.MultiWorkerMirroredStrategy(resolver)
    assert f"Still waiting for ['worker:0 ({workers[0]})'] to join (the chief" in caplog.text


def test_a_chief_whose_port_is_taken_says_so():
    resolver, workers = _two_worker_resolver(0)
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", int(workers[0].rsplit(":", 1)[1])))
        taken.listen()
        with pytest.raises(ValueError, match="must serve the rendezvous at port .* cannot listen there"):
            phalanx.MultiWorkerMirroredStrategy(resolver, join_timeout=1)
