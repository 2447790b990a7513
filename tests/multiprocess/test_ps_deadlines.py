"""The coordinator's deadlines on a real parameter-server cluster (chief, 2 workers, 1 ps):
``fetch``, ``join``, the ``run`` RPC and a function that hangs on a live worker are bounded,
and their errors name the function and the worker."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from support.cluster import run_cluster

pytestmark = pytest.mark.multiprocess
SCRIPTS = Path(__file__).parent / "scripts"


@pytest.fixture(scope="module")
def seen(tmp_path_factory):
    out = tmp_path_factory.mktemp("deadlines")
    run = run_cluster(SCRIPTS / "ps_deadlines.py", out, chief=True, workers=2, ps=1, timeout=180)
    run.check()
    return json.loads((out / "deadlines.json").read_text())


def test_fetch_without_a_timeout_gives_up_after_wait_timeout_naming_the_function_and_worker(seen):
    error, seconds = seen["fetch_stall"]
    assert error.startswith("TimeoutError: fetch() of function 'sleeper' (#")
    assert "no scheduled function finished for 2s, the coordinator's wait_timeout" in error
    assert "'sleeper' (#" in error
    assert " on worker:" in error
    assert "HINT:" in error
    assert "PHALANX_WAIT_TIMEOUT_SECONDS" in error
    assert seconds < 3.0  # the function takes 3 s: the bound (2 s) ended the wait


def test_join_with_a_timeout_names_what_is_pending(seen):
    error, seconds = seen["join_timeout"]
    assert error.startswith("TimeoutError: join() did not finish within its timeout of 0.3s.")
    assert "1 function(s) queued or running" in error
    assert "'sleeper'" in error
    assert seconds < 1.5


def test_a_function_that_hangs_on_a_live_worker_fails_after_the_closure_deadline(seen):
    error, seconds = seen["hung"]
    assert error.startswith("ClosureTimeoutError: function 'sleeper' (#")
    assert "on worker:" in error
    assert "longer than the closure deadline of 4s" in error
    assert "kept answering heartbeats" in error
    assert "closure_timeout" in error
    assert 4.0 <= seconds < 8.0  # not the function's 8 s, nor the RPC's old 365 days
    assert seen["hung_fetch"][0] == error  # its RemoteValue holds the same error


def test_the_other_worker_serves_while_one_is_hung_and_both_serve_after(seen):
    assert len(seen["while_hung"]) == 1
    assert seen["after"] == [0, 1]


def test_joins_first_error_is_raised_as_is_when_the_ps_hangs(seen):
    error, seconds = seen["first_error"]
    assert error == "ValueError: the function's own error"
    assert seconds < 20.0  # not hidden behind a 60 s read of the stopped ps task
