"""The same-machine shared-memory all-reduce between worker processes (real processes, 127.0.0.1)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest

from phalanx.communication.group.work import QueuedWork
from phalanx.communication.transports.shm.shared_memory import (
    SHARED_MEMORY_ENV,
    SharedMemoryAllReduce,
    _alive,
    shared_memory_supported,
)
from support.cluster import run_cluster

pytestmark = pytest.mark.multiprocess
SCRIPTS = Path(__file__).parent / "scripts"
needs_shm = pytest.mark.skipif(not shared_memory_supported(), reason="needs Linux x86-64 with /dev/shm")


def _run(tmp_path, workers, env=None):
    run_cluster(SCRIPTS / "shared_memory_checks.py", tmp_path, workers=workers, env=env, timeout=180).check()
    return [json.loads((tmp_path / f"shm-{r}.json").read_text()) for r in range(workers)]


@needs_shm
@pytest.mark.parametrize("workers", [2, 3, 4])
def test_shared_memory_all_reduce_agrees_with_gloo_and_is_identical_on_every_worker(tmp_path, workers):
    # two-shot forced: with more workers than this machine's cores it would not be chosen
    for result in _run(tmp_path, workers, env={"PHALANX_SHM_TWO_SHOT": "1"}):
        assert result["uses_shared_memory"]
        cases = result["cases"]
        assert len(cases) == 12
        assert all(c["close"] and c["same_on_every_worker"] for c in cases.values()), cases
        assert all(c["rank_order"] for c in cases.values()), cases  # one-shot and two-shot
        if workers == 2:  # a + b either way round: bit for bit what gloo gives
            assert all(c["equal"] for c in cases.values()), cases
        assert all(all(checks.values()) for checks in result["moves"].values()), result["moves"]
        assert result["overlapped"] == sum(range(1, workers + 1))
        assert result["reduce_sum"] == sum(range(1, workers + 1))
        assert result["left_in_dev_shm"] == []
        assert result["gloo_threads_after_close"] == []


def test_the_environment_variable_turns_it_off(tmp_path, monkeypatch):
    for result in _run(tmp_path, 2, {SHARED_MEMORY_ENV: "0"}):
        assert not result["uses_shared_memory"]
        assert all(c["equal"] for c in result["cases"].values())  # gloo against itself
        assert all(all(checks.values()) for checks in result["moves"].values()), result["moves"]
        assert result["gloo_threads_after_close"] == []
    monkeypatch.setenv(SHARED_MEMORY_ENV, "off")
    assert not shared_memory_supported()


def test_a_work_times_out_while_running_and_raises_its_error_once_done():
    work = QueuedWork()
    assert not work.is_completed()
    with pytest.raises(RuntimeError, match="timed out"):
        work.wait(timedelta(seconds=0.01))
    work.finish(ValueError("boom"))
    assert work.is_completed()
    with pytest.raises(ValueError, match="boom"):
        work.wait(timedelta(seconds=1))


def test_an_exited_child_that_is_not_reaped_counts_as_gone():
    assert _alive(os.getpid())
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 30
    while _alive(child.pid) and time.monotonic() < deadline:  # a zombie until we wait()
        time.sleep(0.01)
    assert not _alive(child.pid)
    child.wait()
    assert not _alive(child.pid)


def test_a_transport_needs_two_workers():
    with pytest.raises(ValueError, match="at least 2 workers. Received: 1"):
        SharedMemoryAllReduce("t", 0, 1, [os.getpid()], None, lambda: None, str, 1.0)
