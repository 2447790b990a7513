"""A parameter-server cluster of real processes on 127.0.0.1: chief, 2 workers, 2 ps (gRPC)."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import pytest

from phalanx.cluster import launch

pytestmark = pytest.mark.multiprocess
SCRIPTS = Path(__file__).parent / "scripts"


def _run(tmp_path, mode, workers=2, ps=2):
    out = io.StringIO()
    path = str(Path(__file__).resolve().parents[1])
    env = {"PYTHONPATH": path + os.pathsep + os.environ.get("PYTHONPATH", ""), "PYTHONFAULTHANDLER": "1"}
    script = str(SCRIPTS / "ps_checks.py")
    code = launch(
        script, workers=workers, ps=ps, chief=True, args=[str(tmp_path), mode], env=env, timeout=240, out=out
    )
    assert code == 0, out.getvalue()
    return json.loads((tmp_path / "ps.json").read_text()), out.getvalue()


def test_training_is_asynchronous_on_every_worker_and_the_variables_live_on_the_ps_tasks(tmp_path):
    result, _ = _run(tmp_path, "train")
    assert result["placement"] == [0, 1]  # round-robin over both ps tasks
    assert result["workers_used"] == [0, 1]
    assert sum(result["last_losses"]) < 0.5 * sum(result["first_losses"])
    assert all(result["changed"])  # the coordinator's copies were refreshed from the ps tasks
    assert result["running_mean_moved"]
    assert result["num_batches_tracked"] == 80  # every worker's BatchNorm update arrived
    assert result["bias_seen_by_worker"] == 123.0


def test_model_fit_trains_on_every_worker_process(tmp_path):
    result, _ = _run(tmp_path, "fit")
    assert result["losses"][-1] < result["losses"][0]
    assert result["examples_counted"] == 256  # the last epoch's metric updates all reached the ps


def test_a_failing_function_cancels_the_queued_ones_and_join_raises_its_error(tmp_path):
    result, _ = _run(tmp_path, "error")
    assert "a bad batch" in result["join_raised"]
    assert result["statuses"][0] == "ABORTED"
    assert result["usable_after"]


def test_a_killed_worker_is_replaced_by_the_others(tmp_path):
    result, out = _run(tmp_path, "kill-worker")
    assert result["finished"] == 20
    assert result["workers_after_kill"] == [0]
    assert "Lost worker:1" in out


def test_a_killed_ps_task_is_an_error_that_names_it(tmp_path):
    result, _ = _run(tmp_path, "kill-ps", ps=1)
    assert "ps:0" in result["error"]
    assert result["seconds"] < 120
